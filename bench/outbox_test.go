package bench

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// countingPublisher is a broker that only counts what it is given.
type countingPublisher struct{ n atomic.Int64 }

func (p *countingPublisher) Publish(_ string, msgs ...*message.Message) error {
	p.n.Add(int64(len(msgs)))
	return nil
}

func (p *countingPublisher) Close() error { return nil }

// newBenchOutbox returns an Outbox relaying to broker on a table of its
// own, created, and dropped when b ends.
func newBenchOutbox(b *testing.B, db *sqlx.DB, d inbox.Dialect, broker message.Publisher) *inbox.Outbox {
	b.Helper()
	return newBenchOutboxWith(b, inbox.OutboxConfig{DB: db, Dialect: d, Publisher: broker})
}

// newBenchOutboxWith is newBenchOutbox with cfg's other settings.
func newBenchOutboxWith(b *testing.B, cfg inbox.OutboxConfig) *inbox.Outbox {
	b.Helper()
	table := "bench_outbox_" + testdb.RandomSuffix()
	testdb.DropLater(b, cfg.DB, table)
	testdb.DropLater(b, cfg.DB, table+"_dead")
	cfg.Table = table
	ob, err := inbox.NewOutbox(cfg)
	if err != nil {
		b.Fatal(err)
	}
	if err := ob.InitializeSchema(context.Background()); err != nil {
		b.Fatal(err)
	}
	return ob
}

// fillOutbox writes n messages through publisher factory pub, in
// transactions of 100, as handlers that emit one message each would, 100
// at a time.
func fillOutbox(b *testing.B, db *sqlx.DB, pub func(*sqlx.Tx) (message.Publisher, error), topic string, n int) {
	b.Helper()
	fillOutboxOver(b, db, pub, []string{topic}, n)
}

// fillOutboxOver is fillOutbox with the messages spread over topics, round
// robin.
func fillOutboxOver(b *testing.B, db *sqlx.DB, pub func(*sqlx.Tx) (message.Publisher, error), topics []string, n int) {
	b.Helper()
	for start := 0; start < n; start += 100 {
		tx, err := db.Beginx()
		if err != nil {
			b.Fatal(err)
		}
		p, err := pub(tx)
		if err != nil {
			b.Fatal(err)
		}
		for i := start; i < min(n, start+100); i++ {
			m := message.NewMessage(watermill.NewUUID(), []byte(`{"order":"o-1","amount":100}`))
			m.Metadata.Set("order_id", "o-1")
			if err := p.Publish(topics[i%len(topics)], m); err != nil {
				b.Fatal(err)
			}
		}
		if err := tx.Commit(); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkOutboxRelay relays a backlog of b.N outbox messages (written
// before the clock starts, in transactions of 100) to a publisher that only
// counts, and reports msgs/s (BENCHMARKS.md: -benchtime 20000x): this project's relay (inbox.Outbox,
// default batch) and watermill-sql v4's forwarder with the queue schema and
// delete-on-ack at SubscribeBatchSize 1 (the setup it replaces; PostgreSQL
// and MariaDB, which v4 supports).
func BenchmarkOutboxRelay(b *testing.B) {
	for _, tdb := range databases() {
		if tdb.Name == "postgres-partitioned" {
			continue // the outbox does not depend on the inbox table's partitioning
		}
		b.Run(tdb.Name+"/relay", func(b *testing.B) {
			db := tdb.Open(b)
			broker := &countingPublisher{}
			ob := newBenchOutbox(b, db, tdb.Dialect, broker)
			fillOutbox(b, db, ob.Publisher, "orders", b.N)
			b.ResetTimer()
			relayBacklog(b, ob)
		})
		if tdb.Name == "postgres" {
			// The backlog written through pgxinbox's writer (pgx.Tx.Exec,
			// payloads as bytea), relayed by the same relay.
			b.Run("postgres-pgx/relay", func(b *testing.B) {
				p := openPgxPool(b, 4, nil)
				broker := &countingPublisher{}
				ob := newBenchOutbox(b, p.db, tdb.Dialect, broker)
				fillOutboxPgx(b, p.pool, pgxinbox.OutboxPublisher(ob), "orders", b.N)
				b.ResetTimer()
				relayBacklog(b, ob)
			})
		}
		if tdb.Dialect == inbox.SQLite {
			continue
		}
		b.Run(tdb.Name+"/wsql-queue-batch1", func(b *testing.B) {
			db := tdb.Open(b)
			broker := &countingPublisher{}
			var schema wsql.SchemaAdapter = wsql.MySQLQueueSchema{SubscribeBatchSize: 1}
			var offsets wsql.OffsetsAdapter = wsql.MySQLQueueOffsetsAdapter{DeleteOnAck: true}
			if tdb.Dialect != inbox.MySQL {
				schema, offsets = wsql.PostgreSQLQueueSchema{SubscribeBatchSize: 1}, wsql.PostgreSQLQueueOffsetsAdapter{DeleteOnAck: true}
			}
			topic := "bench_fwd_" + testdb.RandomSuffix()
			testdb.DropLater(b, db, "watermill_"+topic)
			logger := watermill.NopLogger{}
			newSubscriber := func() message.Subscriber {
				sub, err := wsql.NewSubscriber(wsql.BeginnerFromStdSQL(db.DB), wsql.SubscriberConfig{
					SchemaAdapter: schema, OffsetsAdapter: offsets, InitializeSchema: true, PollInterval: 10 * time.Millisecond,
				}, logger)
				if err != nil {
					b.Fatal(err)
				}
				if err := sub.SubscribeInitialize(topic); err != nil {
					b.Fatal(err)
				}
				return sub
			}
			newSubscriber().Close() // creates the table
			pub := func(tx *sqlx.Tx) (message.Publisher, error) {
				p, err := wsql.NewPublisher(wsql.TxFromStdSQL(tx.Tx), wsql.PublisherConfig{SchemaAdapter: schema}, logger)
				if err != nil {
					return nil, err
				}
				return forwarder.NewPublisher(p, forwarder.PublisherConfig{ForwarderTopic: topic}), nil
			}
			fillOutbox(b, db, pub, "orders", b.N)
			fwd, err := forwarder.NewForwarder(newSubscriber(), broker, logger, forwarder.Config{ForwarderTopic: topic})
			if err != nil {
				b.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			b.ResetTimer()
			start := time.Now()
			go func() { done <- fwd.Run(ctx) }()
			for broker.n.Load() < int64(b.N) {
				time.Sleep(time.Millisecond)
			}
			elapsed := time.Since(start)
			b.StopTimer()
			cancel()
			if err := fwd.Close(); err != nil {
				b.Fatal(err)
			}
			<-done
			b.ReportMetric(float64(b.N)/elapsed.Seconds(), "msgs/s")
		})
	}
}

// relayBacklog runs relay rounds of ob until one relays nothing and reports
// msgs/s over b.N messages.
func relayBacklog(b *testing.B, ob *inbox.Outbox) {
	b.ReportMetric(relayBacklogRate(b, ob), "msgs/s")
}

// relayBacklogRate runs relay rounds of ob until one relays nothing and
// returns b.N messages per second of them.
func relayBacklogRate(b *testing.B, ob *inbox.Outbox) float64 {
	start := time.Now()
	for {
		round := ob.RelayOnce(context.Background())
		if round.Err != nil {
			b.Fatal(round.Err)
		}
		if round.Relayed == 0 {
			break
		}
	}
	return float64(b.N) / time.Since(start).Seconds()
}

// fillOutboxPgx is fillOutbox through pgx transactions of pool and the
// pgx outbox writer pub.
func fillOutboxPgx(b *testing.B, pool *pgxpool.Pool, pub func(pgx.Tx) (message.Publisher, error), topic string, n int) {
	b.Helper()
	ctx := context.Background()
	for start := 0; start < n; start += 100 {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			p, err := pub(tx)
			if err != nil {
				return err
			}
			for i := start; i < min(n, start+100); i++ {
				m := message.NewMessage(watermill.NewUUID(), []byte(`{"order":"o-1","amount":100}`))
				m.Metadata.Set("order_id", "o-1")
				if err := p.Publish(topic, m); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			b.Fatal(err)
		}
	}
}
