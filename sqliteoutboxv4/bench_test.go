package sqliteoutboxv4_test

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/sqliteoutboxv4"
)

// BenchmarkForward measures how fast Watermill's forwarder drains a SQLite
// outbox of b.N messages (published before the timer starts) to a
// destination that only counts, for each pair of adapters, on a handle
// with _txlock=immediate and a batch of 100 (the default) or 10: msgs/s.
func BenchmarkForward(b *testing.B) {
	for _, bc := range []struct {
		name    string
		schema  wsql.SchemaAdapter
		offsets wsql.OffsetsAdapter
	}{
		{"offsets", sqliteoutboxv4.SchemaAdapter{}, sqliteoutboxv4.OffsetsAdapter{}},
		{"queue", sqliteoutboxv4.QueueSchema{}, sqliteoutboxv4.QueueOffsetsAdapter{}},
		{"queue-delete-on-ack", sqliteoutboxv4.QueueSchema{}, sqliteoutboxv4.QueueOffsetsAdapter{DeleteOnAck: true}},
		{"queue-delete-on-ack-batch-10", sqliteoutboxv4.QueueSchema{SubscribeBatchSize: 10}, sqliteoutboxv4.QueueOffsetsAdapter{DeleteOnAck: true}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			db := testdb.OpenSQLite(b, b.TempDir()+"/outbox.db")
			topic := outboxTopic()
			logger := watermill.NopLogger{}
			sub, err := wsql.NewSubscriber(wsql.BeginnerFromStdSQL(db.DB), wsql.SubscriberConfig{
				PollInterval:   10 * time.Millisecond,
				SchemaAdapter:  bc.schema,
				OffsetsAdapter: bc.offsets,
			}, logger)
			if err != nil {
				b.Fatal(err)
			}
			defer sub.Close()
			if err := sub.SubscribeInitialize(topic); err != nil {
				b.Fatal(err)
			}
			inner, err := wsql.NewPublisher(wsql.BeginnerFromStdSQL(db.DB), wsql.PublisherConfig{SchemaAdapter: bc.schema}, logger)
			if err != nil {
				b.Fatal(err)
			}
			pub := forwarder.NewPublisher(inner, forwarder.PublisherConfig{ForwarderTopic: topic})
			for left := b.N; left > 0; left -= 100 {
				msgs := make([]*message.Message, min(left, 100))
				for i := range msgs {
					msgs[i] = message.NewMessage(watermill.NewUUID(), []byte(`{"amount":42}`))
				}
				if err := pub.Publish("invoices", msgs...); err != nil {
					b.Fatal(err)
				}
			}

			dest := &countdownPublisher{left: int64(b.N), done: make(chan struct{})}
			fwd, err := forwarder.NewForwarder(sub, dest, logger, forwarder.Config{ForwarderTopic: topic})
			if err != nil {
				b.Fatal(err)
			}
			b.ResetTimer()
			start := time.Now()
			go fwd.Run(b.Context())
			<-dest.done
			elapsed := time.Since(start)
			b.StopTimer()
			if err := fwd.Close(); err != nil {
				b.Fatal(err)
			}
			b.ReportMetric(float64(b.N)/elapsed.Seconds(), "msgs/s")
		})
	}
}

// countdownPublisher closes done once it was given left messages.
type countdownPublisher struct {
	left int64
	done chan struct{}
}

func (p *countdownPublisher) Publish(_ string, msgs ...*message.Message) error {
	if atomic.AddInt64(&p.left, -int64(len(msgs))) == 0 {
		close(p.done)
	}
	return nil
}

func (p *countdownPublisher) Close() error { return nil }
