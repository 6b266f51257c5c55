//go:build unix

package brokers

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/nats-io/nats.go"

	"github.com/watermill-inbox/inbox"
)

const (
	natsURLEnv     = "INBOX_TEST_NATS_URL"
	defaultNATSURL = "nats://127.0.0.1:4222"
	startNATS      = "nats-server -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server &"

	// duplicateWindow is the stream's: a message whose Nats-Msg-Id was
	// stored less than this ago is dropped by the server.
	duplicateWindow = time.Second
)

// TestNATSJetStream_effectsExactlyOnce runs worker processes on one
// JetStream durable consumer while workers are SIGKILLed between commit and
// ack and messages are published twice, by Watermill (same UUID) and by a
// plain nats.go producer (same Nats-Msg-Id). JetStream drops a Nats-Msg-Id
// repeated within its duplicate window; the inbox skips one repeated after
// it, and every redelivery of a committed message. Every message has
// exactly one effect.
func TestNATSJetStream_effectsExactlyOnce(t *testing.T) {
	if os.Getenv(workerEnv) != "" {
		t.Skip("worker process")
	}
	url := env(natsURLEnv, defaultNATSURL)
	how := fmt.Sprintf("start it with `%s`, or point %s at a server", startNATS, natsURLEnv)
	nc, err := nats.Connect(url, nats.Timeout(2*time.Second), nats.NoReconnect())
	if err != nil {
		unreachable(t, "NATS", err, how)
	}
	t.Cleanup(nc.Close)
	js, err := nc.JetStream(nats.MaxWait(10 * time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.AccountInfo(); err != nil {
		unreachable(t, "NATS JetStream", err, "run nats-server with -js: "+how)
	}
	r := newRun(t, "nats")
	r.base.URL = url
	r.base.Topic = "inbox.brokers." + r.id
	r.base.Poison = r.base.Topic + ".poison"
	r.base.Durable = consumer + "_" + r.id
	stream, poisonStream := "INBOX_BROKERS_"+r.id, "INBOX_BROKERS_POISON_"+r.id

	for _, sc := range []*nats.StreamConfig{
		{Name: stream, Subjects: []string{r.base.Topic}, Storage: nats.MemoryStorage, Duplicates: duplicateWindow},
		{Name: poisonStream, Subjects: []string{r.base.Poison}, Storage: nats.MemoryStorage},
	} {
		if _, err := js.AddStream(sc); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if err := js.DeleteStream(sc.Name); err != nil {
				t.Logf("delete stream %s: %v", sc.Name, err)
			}
		})
	}
	if err := createConsumer(js, stream, r.base.Topic, r.base.Durable); err != nil {
		t.Fatal(err)
	}

	plan := newPlan(r.id, false)
	copies := map[string]int{} // what the stream stored, but for the message with no id
	type result struct {
		dropped, accepted int
		err               error
	}
	produced := make(chan result, 1)
	go func() {
		var res result
		res.dropped, res.accepted, res.err = publishNATS(js, url, r.base.Topic, plan, copies)
		produced <- res
	}()

	var res *result
	r.supervise(func() (bool, string) {
		if res == nil {
			select {
			case got := <-produced:
				if got.err != nil {
					r.fail("publish: %v", got.err)
				}
				res = &got
			default:
				return false, fmt.Sprintf("publishing; %d messages committed", r.committed())
			}
		}
		info, err := js.ConsumerInfo(stream, r.base.Durable)
		if err != nil {
			r.fail("consumer info: %v", err)
		}
		total := 1 // the message with no id
		for _, n := range copies {
			total += n
		}
		committed, acked := r.committed(), r.acked()
		progress := fmt.Sprintf("%d of %d messages committed, %d of %d copies acked, %d pending, %d awaiting an ack",
			committed, len(copies), acked, total, info.NumPending, info.NumAckPending)
		return committed == len(copies) && acked >= total && info.NumPending == 0 && info.NumAckPending == 0, progress
	})
	r.stopAll()
	elapsed := time.Since(r.began)
	r.check(copies)

	total := 1 // the message with no id
	for _, n := range copies {
		total += n
	}
	if si, err := js.StreamInfo(stream); err != nil {
		t.Error(err)
	} else if si.State.Msgs != uint64(total) {
		t.Errorf("the stream holds %d messages, want %d", si.State.Msgs, total)
	}
	// The workers' Close left the consumer the test created in place.
	if _, err := js.ConsumerInfo(stream, r.base.Durable); err != nil {
		t.Errorf("the durable consumer after the workers stopped: %v", err)
	}
	// The message with no id lands once on the poison stream.
	if si, err := js.StreamInfo(poisonStream); err != nil {
		t.Error(err)
	} else if si.State.Msgs != 1 {
		t.Errorf("%d messages on the poison stream, want 1", si.State.Msgs)
	} else if m, err := js.GetMsg(poisonStream, si.State.FirstSeq); err != nil {
		t.Error(err)
	} else if reason := m.Header.Get(middleware.ReasonForPoisonedKey); string(m.Data) != noIDBody ||
		!strings.Contains(reason, strings.TrimPrefix(inbox.ErrInvalidMessageID.Error(), "inbox: ")) {
		t.Errorf("poisoned: body %q, reason %q; want body %q and the reason %q", m.Data, reason, noIDBody, inbox.ErrInvalidMessageID)
	}
	// JetStream dropped each foreign copy repeated at once, and stored the
	// one repeated after its duplicate window: the inbox skipped that.
	if res.dropped != foreign || res.accepted != foreign {
		t.Errorf("foreign copies repeated: %d dropped by the server within its window, %d stored after it; want %d and %d",
			res.dropped, res.accepted, foreign, foreign)
	}
	t.Logf("NATS JetStream: %d copies stored of %d messages (%d re-published by Watermill; %d foreign published three times: "+
		"the server dropped the second copy, the inbox skipped the third; 1 with no id) in %v\n%s",
		total, len(copies), republish, foreign, elapsed.Round(time.Millisecond), r.summary())
}

// createConsumer creates the workers' durable push consumer, outside the
// workers: a watermill-nats subscriber that creates its consumer itself
// deletes it on Close, under the other workers. The workers bind to it by
// name (DurablePrefix) and deliver group (QueueGroupPrefix).
func createConsumer(js nats.JetStreamContext, stream, subject, durable string) error {
	_, err := js.AddConsumer(stream, &nats.ConsumerConfig{
		Durable:        durable,
		DeliverSubject: "_deliver." + durable,
		DeliverGroup:   durable,
		FilterSubject:  subject,
		AckPolicy:      nats.AckExplicitPolicy,
		AckWait:        3 * time.Second, // a delivery not acked by then is redelivered
		MaxAckPending:  16,
	})
	return err
}

// publishNATS publishes plan to subject: Watermill's messages with
// watermill-nats's JetStream publisher (TrackMsgId off, so that JetStream
// does not drop a re-published UUID), the others with nats.go's JetStream
// API, with the Nats-Msg-Id header (but one) and no Watermill UUID. A foreign second
// copy follows its first at once, within the stream's duplicate window;
// then every foreign message is published a third time, after its window.
// copies counts what the stream stored; dropped and accepted count the
// foreign copies the server reported as duplicates and the third copies it
// stored.
func publishNATS(js nats.JetStreamContext, url, subject string, plan []publication, copies map[string]int) (dropped, accepted int, err error) {
	pub, err := wmnats.NewPublisher(wmnats.PublisherConfig{URL: url}, watermill.NopLogger{})
	if err != nil {
		return 0, 0, err
	}
	defer pub.Close()
	publishForeign := func(p publication) (bool, error) {
		m := nats.NewMsg(subject)
		m.Data = []byte(noIDBody)
		if p.id != "" {
			m.Header.Set(nats.MsgIdHdr, p.id)
			m.Data = fmt.Appendf(nil, `{"order":%q,"copy":%d}`, p.id, p.copy)
		}
		ack, err := js.PublishMsg(m)
		if err != nil {
			return false, err
		}
		return !ack.Duplicate, nil
	}
	var lastForeign time.Time
	for _, p := range plan {
		if !p.foreign {
			if err := pub.Publish(subject, message.NewMessage(p.id, fmt.Appendf(nil, `{"copy":%d}`, p.copy))); err != nil {
				return 0, 0, err
			}
			copies[p.id]++
			continue
		}
		stored, err := publishForeign(p)
		if err != nil {
			return 0, 0, err
		}
		switch {
		case p.id == "":
		case stored:
			copies[p.id]++
			lastForeign = time.Now()
		default:
			dropped++
		}
	}
	// After the window the server no longer knows the ids: the third copies
	// are stored, and reach the workers. The server forgets an id on a timer,
	// so a copy it still drops is sent again, for a while.
	time.Sleep(time.Until(lastForeign.Add(2 * duplicateWindow)))
	giveUp := time.Now().Add(5 * duplicateWindow)
	for _, p := range plan {
		if !p.foreign || p.id == "" || p.copy != 1 {
			continue
		}
		p.copy = 3
		for {
			stored, err := publishForeign(p)
			if err != nil {
				return 0, 0, err
			}
			if stored {
				copies[p.id]++
				accepted++
				break
			}
			if time.Now().After(giveUp) {
				break
			}
			time.Sleep(duplicateWindow / 4)
		}
	}
	return dropped, accepted, nil
}
