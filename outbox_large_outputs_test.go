package inbox_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// largeWriteCommitTimeout is the CommitTimeout of the inboxes whose
// messages write tens of MiB of outputs in their transaction: on a loaded
// machine MariaDB took longer than the default 10 s to take them, and the
// message was nacked for its time, not for what these tests check.
const largeWriteCommitTimeout = 2 * time.Minute

// With go-sql-driver/mysql's interpolateParams a statement goes in one
// packet: a handler whose outputs add up to more than MariaDB's
// max_allowed_packet (16 MiB by default; 20 of 900 KiB here, each under
// Kafka's 1 MB) failed every delivery of its message (1153), when they went
// in one INSERT. They go in several, in order.
func TestReturnedMessagesLargerTogetherThanAPacketAreWritten(t *testing.T) {
	db := testdb.OpenMySQL(t, "interpolateParams=true")
	broker := newBrokerStub()
	ob := newTestOutbox(t, db, inbox.MySQL, inbox.OutboxConfig{Publisher: broker, PollInterval: time.Hour})
	ib := newFixture(t, db).newInbox(inbox.Config{CommitTimeout: largeWriteCommitTimeout, Outbox: ob.Publisher})
	var want []string
	in, out := newFeed(), &outcomes{}
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(out.Middleware, ib.Middleware)
		r.AddHandler("billing", "orders", in, "documents", nil, func(msg *message.Message) ([]*message.Message, error) {
			var res []*message.Message
			want = want[:0]
			for i := range 20 {
				p := make([]byte, 900<<10)
				for j := range p {
					p[j] = byte(i + j*7)
				}
				m := message.NewMessage(fmt.Sprintf("%s-%02d", msg.UUID, i), p)
				res = append(res, m)
				want = append(want, m.UUID)
			}
			return res, nil
		})
	})
	if !in.deliver(t, delivery(message.NewMessage(watermill.NewUUID(), []byte("order")), "1")) {
		t.Fatalf("nacked: %v", out.last("1"))
	}
	relayUntilEmpty(t, ob)
	if got := broker.uuids("documents"); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("relayed %d messages, want the %d returned, in order", len(got), len(want))
	}
}

// mutatingPublisher refuses calls of several messages, and transforms each
// payload it is handed in place (as an encrypting decorator may).
type mutatingPublisher struct {
	mu   sync.Mutex
	sent []*message.Message
}

func (p *mutatingPublisher) Publish(_ string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	defer func() {
		for _, m := range msgs {
			for i := range m.Payload {
				m.Payload[i] ^= 0x5a
			}
		}
	}()
	if len(msgs) > 1 {
		return errors.New("batch too large for the broker's deadline")
	}
	p.sent = append(p.sent, message.NewMessage(msgs[0].UUID, bytes.Clone(msgs[0].Payload)))
	return nil
}

func (p *mutatingPublisher) Close() error { return nil }

// A message the relay sends again within a round (one by one, after the
// call of several failed) is rebuilt from its row: it went with the bytes
// the publisher had transformed in place in the failed call.
func TestMessageSentAgainKeepsItsPayloadWhenThePublisherTransformsItInPlace(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		pub := &mutatingPublisher{}
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: pub, PollInterval: time.Hour})
		tx, w := beginOutbox(t, db, ob)
		want := map[string][]byte{"m1": []byte("first payload"), "m2": []byte("second payload")}
		if err := w.Publish("t", message.NewMessage("m1", want["m1"]), message.NewMessage("m2", want["m2"])); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		if r := ob.RelayOnce(context.Background()); r.Relayed != 2 {
			t.Fatalf("relayed %d, want 2 (%v)", r.Relayed, r.Err)
		}
		for _, m := range pub.sent {
			if !bytes.Equal(m.Payload, want[m.UUID]) {
				t.Errorf("message %s reached the broker as %q, written as %q", m.UUID, m.Payload, want[m.UUID])
			}
		}
	})
}
