package kafkaoutbox_test

import (
	"bytes"
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/watermill-inbox/inbox/kafkaoutbox"
)

// The relay host's clock runs two hours ahead of the broker's (NTP down, a
// VM resumed), past the topic's message.timestamp.after.max.ms: the broker
// refuses every record, whose timestamp sarama took from that clock
// (kafka.DefaultMarshaler sets none). That is the clock's state, not the
// messages': nothing is set aside, and once the clock is right every
// message reaches the topic. INVALID_TIMESTAMP was the message's own
// refusal, and every pending output went to the dead-letter table within
// MaxAttempts rounds.
func TestRelayHostClockSkewSetsNothingAside(t *testing.T) {
	var skew atomic.Int64 // how far this host's clock runs ahead of the broker's
	skew.Store(int64(2 * time.Hour))
	c := controlledCluster(t, 1, func(_ *kfake.Cluster, req *kmsg.ProduceRequest) kmsg.Response {
		limit := time.Now().Add(time.Hour - time.Duration(skew.Load())).UnixMilli() // the broker's clock + 1 h, seen from here
		for _, tp := range req.Topics {
			for _, p := range tp.Partitions {
				var batch kmsg.RecordBatch
				if batch.ReadFrom(p.Records) == nil && batch.MaxTimestamp > limit {
					return produceError(req, kerr.InvalidTimestamp.Code)
				}
			}
		}
		return nil
	}, "invoices")
	db, ob := newFailFastRelay(t, c.ListenAddrs()) // MaxAttempts 2
	msgs, want := customerInvoices(6)
	writeOutputs(t, db, ob, "invoices", msgs...)
	for range 4 {
		ob.RelayOnce(context.Background())
	}
	skew.Store(0) // the clock is right again
	waitForRelayed(t, ob)
	if s, err := ob.Stats(context.Background()); err != nil || s.DeadLettered != 0 {
		t.Fatalf("%d of %d messages set aside in the dead-letter table because this host's clock ran ahead (%v)",
			s.DeadLettered, len(msgs), err)
	}
	collectAll(t, c.ListenAddrs(), "invoices", want)
}

// eventTimeMarshaler is the tests' marshaler with the event time of a
// message that carries one ("event_time" metadata, RFC 3339) as its
// record's timestamp; sarama stamps the others.
type eventTimeMarshaler struct{ kafka.MarshalerUnmarshaler }

func (m eventTimeMarshaler) Marshal(topic string, msg *message.Message) (*sarama.ProducerMessage, error) {
	pm, err := m.MarshalerUnmarshaler.Marshal(topic, msg)
	if err != nil {
		return nil, err
	}
	if s := msg.Metadata.Get("event_time"); s != "" {
		if pm.Timestamp, err = time.Parse(time.RFC3339, s); err != nil {
			return nil, err
		}
	}
	return pm, nil
}

// A message whose own timestamp the topic refuses (a replayed event older
// than message.timestamp.before.max.ms), between two that sarama stamped,
// all of one key: Kafka refuses their record batch whole. The one with the
// refused timestamp is set aside once it used its attempts, and the others
// are sent. Taking the stamped ones' refusal for this host's clock ended
// the walk before the bad one was tried alone: the partition stuck for
// ever, nothing set aside.
func TestOwnRefusedTimestampBesideStampedMessagesIsSetAside(t *testing.T) {
	c := controlledCluster(t, 1, func(_ *kfake.Cluster, req *kmsg.ProduceRequest) kmsg.Response {
		for _, tp := range req.Topics {
			for _, p := range tp.Partitions {
				var batch kmsg.RecordBatch
				// Only the replayed event's record carries the event_time
				// header (records go uncompressed).
				if batch.ReadFrom(p.Records) == nil && batch.Attributes&0x7 == 0 && bytes.Contains(batch.Records, []byte("event_time")) {
					return produceError(req, kerr.InvalidTimestamp.Code)
				}
			}
		}
		return nil
	}, "invoices")
	cfg := kafkaoutbox.DefaultSaramaConfig()
	cfg.Producer.Retry.Max, cfg.Producer.Retry.BackoffFunc, cfg.Producer.Retry.Backoff = 1, nil, 10*time.Millisecond
	cfg.Metadata.Retry.Backoff = 10 * time.Millisecond
	pc := publisherConfig(c.ListenAddrs(), cfg)
	pc.Marshaler = eventTimeMarshaler{byKey()}
	pub, err := kafkaoutbox.NewPublisher(pc, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pub.Close() })
	db := sqliteDB(t)
	ob := newOutbox(t, db, pub, 2)
	var msgs []*message.Message
	for i := range 3 {
		m := message.NewMessage(watermill.NewUUID(), []byte("invoice"))
		m.Metadata.Set("key", "customer-1")
		if i == 1 {
			m.Metadata.Set("event_time", time.Now().Add(-48*time.Hour).UTC().Format(time.RFC3339))
		}
		msgs = append(msgs, m)
	}
	writeOutputs(t, db, ob, "invoices", msgs...)
	for range 8 {
		ob.RelayOnce(context.Background())
	}
	s, err := ob.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if s.Pending != 0 || s.DeadLettered != 1 {
		t.Fatalf("after 8 rounds (MaxAttempts 2): %d pending, %d set aside (first last error: %s); want the message with a"+
			" refused timestamp of its own set aside and the 2 others sent", s.Pending, s.DeadLettered, s.FirstLastError)
	}
}
