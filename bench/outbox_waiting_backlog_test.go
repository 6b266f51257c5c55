package bench

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// refusingPublisher refuses every message to topic gone as a broker that
// does not have it (ErrBrokerUnavailable: never set aside) and counts the
// others.
type refusingPublisher struct{ n atomic.Int64 }

func (p *refusingPublisher) Publish(topic string, msgs ...*message.Message) error {
	if topic == "gone" {
		return fmt.Errorf("topic gone does not exist: %w", inbox.ErrBrokerUnavailable)
	}
	p.n.Add(int64(len(msgs)))
	return nil
}

func (p *refusingPublisher) Close() error { return nil }

// BenchmarkOutboxRelayBesideAWaitingBacklog/<db>/backlog=<n> relays b.N
// messages (written in transactions of 100) that come after n messages of
// a topic the broker refuses as unavailable (a deleted topic), with Run,
// which leaves a refused topic out of its reads while it waits, to a
// publisher that counts the others, and reports msgs/s and, beside the
// largest backlog, its ratio to the run without one. The rounds read from
// where the waiting topic's rows end, once the relay has found it.
func BenchmarkOutboxRelayBesideAWaitingBacklog(b *testing.B) {
	backlogs := []int{0, 1_000_000}
	if testing.Short() {
		backlogs = []int{0, 20_000}
	}
	for _, tdb := range databases() {
		if tdb.Name != "postgres" && tdb.Name != "mysql" && tdb.Name != "sqlite" {
			continue
		}
		b.Run(tdb.Name, func(b *testing.B) {
			db := tdb.Open(b)
			rate := map[int]float64{}
			for _, n := range backlogs {
				b.Run(fmt.Sprintf("backlog=%d", n), func(b *testing.B) {
					broker := &refusingPublisher{}
					table := "bench_outbox_" + testdb.RandomSuffix()
					testdb.DropLater(b, db, table)
					testdb.DropLater(b, db, table+"_dead")
					ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Dialect: tdb.Dialect, Publisher: broker, Table: table})
					if err != nil {
						b.Fatal(err)
					}
					if err := ob.InitializeSchema(context.Background()); err != nil {
						b.Fatal(err)
					}
					rows := "SELECT 'gone', CONCAT('gone-', seq), CAST('p' AS BINARY), CAST('{}' AS BINARY), UTC_TIMESTAMP(6) FROM seq_1_to_" + fmt.Sprint(n)
					switch tdb.Dialect {
					case inbox.PostgreSQL:
						rows = fmt.Sprintf("SELECT 'gone', 'gone-' || g, CAST('p' AS bytea), CAST('{}' AS bytea), now() FROM generate_series(1, %d) AS g", n)
					case inbox.SQLite:
						rows = fmt.Sprintf("WITH RECURSIVE g(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM g WHERE i < %d)"+
							" SELECT 'gone', 'gone-' || i, CAST('p' AS BLOB), CAST('{}' AS BLOB), 0 FROM g", n)
					}
					if n > 0 {
						if _, err := db.Exec("INSERT INTO " + table + " (topic, uuid, payload, metadata, created_at) " + rows); err != nil {
							b.Fatal(err)
						}
					}
					if tdb.Dialect == inbox.PostgreSQL {
						if _, err := db.Exec("ANALYZE " + table); err != nil {
							b.Fatal(err)
						}
					}
					fillOutbox(b, db, ob.Publisher, "payments", b.N)
					ctx, cancel := context.WithCancel(context.Background())
					done := make(chan error, 1)
					b.ResetTimer()
					start := time.Now()
					go func() { done <- ob.Run(ctx) }()
					for broker.n.Load() < int64(b.N) {
						time.Sleep(time.Millisecond)
					}
					elapsed := time.Since(start)
					b.StopTimer()
					cancel()
					if err := <-done; err != nil {
						b.Fatal(err)
					}
					rate[n] = float64(b.N) / elapsed.Seconds()
					b.ReportMetric(rate[n], "msgs/s")
					if n > 0 && rate[0] > 0 {
						b.ReportMetric(rate[n]/rate[0], "ratio-to-no-backlog")
					}
				})
			}
		})
	}
}
