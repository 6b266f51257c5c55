package bench

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// BenchmarkPurgeUnderLoad/postgres/<mode> purges 1,000,000 expired inbox
// rows (-short: 20,000) while 4 handlers claim new messages in the same
// table, and reports the rows removed per second and the handlers' p99
// latency while purging against the same handlers with no purge running
// (p99-ratio). mode: delete-batch<n>[-pause<d>] (Purge with BatchSize n and
// Pause d) or partition-drop
// (PostgreSQLPartitioned, DropPartitions of 10 daily partitions). One run
// per benchmark: use -benchtime 1x.
func BenchmarkPurgeUnderLoad(b *testing.B) {
	rows := 1_000_000
	if testing.Short() {
		rows = 20_000
	}
	type purgeMode struct {
		name  string
		batch int
		pause time.Duration
	}
	modes := []purgeMode{
		{"delete-batch1000", 1000, 0}, {"delete-batch100", 100, 0}, {"delete-batch100-pause2ms", 100, 2 * time.Millisecond},
		{"partition-drop", 0, 0},
	}
	for _, m := range modes {
		mode := m.name
		b.Run("postgres/"+mode, func(b *testing.B) {
			db := testdb.OpenPostgres(b, "")
			db.SetMaxOpenConns(8)
			ctx := context.Background()
			table := "bench_purge_" + testdb.RandomSuffix()
			b.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + table + " CASCADE") })
			dialect := inbox.PostgreSQL
			if mode == "partition-drop" {
				dialect = inbox.PostgreSQLPartitioned
			}
			ib, err := inbox.New(inbox.Config{DB: db, Dialect: dialect, Table: table, Consumer: "bench"})
			if err != nil {
				b.Fatal(err)
			}
			if err := ib.InitializeSchema(ctx); err != nil {
				b.Fatal(err)
			}
			if mode == "partition-drop" {
				var now time.Time
				if err := db.Get(&now, "SELECT now()"); err != nil {
					b.Fatal(err)
				}
				if err := inbox.CreatePartitions(ctx, db, table, now.AddDate(0, 0, -30), 31); err != nil {
					b.Fatal(err)
				}
			}
			// Expired rows: 10 days, 20 to 29 days ago.
			if _, err := db.Exec(fmt.Sprintf(`INSERT INTO %s (consumer, message_id, processed_at)
				SELECT 'old', md5(random()::text || g), now() - interval '20 days' - (g %% 10) * interval '1 day' - interval '1 hour'
				FROM generate_series(1, %d) g`, table, rows)); err != nil {
				b.Fatal(err)
			}
			if _, err := db.Exec("ANALYZE " + table); err != nil {
				b.Fatal(err)
			}
			h := inboxHandler(ib, insertSQL(db, businessTable(b, db)))

			b.ResetTimer()
			idle := load(b, h, func() {
				time.Sleep(3 * time.Second)
			})
			var removed int64
			var purgeTime time.Duration
			purging := load(b, h, func() {
				start := time.Now()
				if mode != "partition-drop" {
					removed, err = inbox.Purge(ctx, inbox.PurgeConfig{
						DB: db, Table: table, OlderThan: 7 * 24 * time.Hour, BatchSize: m.batch, Pause: m.pause,
					})
				} else {
					var dropped []inbox.DroppedPartition
					dropped, err = inbox.DropPartitions(ctx, db, table, 7*24*time.Hour, nil)
					for _, d := range dropped {
						removed += d.Rows
					}
				}
				purgeTime = time.Since(start)
			})
			b.StopTimer()
			if err != nil {
				b.Fatal(err)
			}
			if removed != int64(rows) {
				b.Fatalf("removed %d rows, want %d", removed, rows)
			}
			b.ReportMetric(float64(removed)/purgeTime.Seconds(), "rows-removed/s")
			b.ReportMetric(float64(idle.Microseconds()), "p99-us-idle")
			b.ReportMetric(float64(purging.Microseconds()), "p99-us-purging")
			b.ReportMetric(float64(purging)/float64(idle), "p99-ratio")
		})
	}
}

// load runs 4 handlers on fresh messages while during runs, and returns
// their p99 latency.
func load(b *testing.B, h message.HandlerFunc, during func()) time.Duration {
	var stop atomic.Bool
	var mu sync.Mutex
	var latencies []time.Duration
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var mine []time.Duration
			for !stop.Load() {
				msg := message.NewMessage(watermill.NewUUID(), nil)
				t0 := time.Now()
				if _, err := h(msg); err != nil {
					b.Error(err)
					return
				}
				mine = append(mine, time.Since(t0))
			}
			mu.Lock()
			latencies = append(latencies, mine...)
			mu.Unlock()
		}()
	}
	during()
	stop.Store(true)
	wg.Wait()
	if len(latencies) == 0 {
		b.Fatal("no handler ran")
	}
	slices.Sort(latencies)
	return latencies[len(latencies)*99/100]
}
