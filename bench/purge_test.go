package bench

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// purgeRows overrides the rows each purge benchmark removes (0: the
// benchmark's own default).
var purgeRows = flag.Int("purge.rows", 0, "expired rows per purge benchmark (0: 1,000,000 for BenchmarkPurgeUnderLoad, 200,000 for BenchmarkPurgePacingCurve; -short: 20,000)")

// purgeLoadRate makes the purge benchmarks' handlers an open-loop load:
// messages arrive at this many per second in all (spread over the 4
// handlers, each message's latency counted from when it was due, so a
// handler that falls behind shows the queueing), instead of 4 handlers
// claiming back to back, which keeps the database saturated and makes any
// work of the purge a loss of the handlers' share.
var purgeLoadRate = flag.Int("purge.rate", 0, "messages per second the purge benchmarks' 4 handlers receive in all (0: as fast as they go)")

// purgeCurveBatches and purgeCurveDuties override the points of
// BenchmarkPurgePacingCurve.
var (
	purgeCurveBatches = flag.String("purge.batches", "", "comma-separated batch sizes of BenchmarkPurgePacingCurve (default: 100,1000)")
	purgeCurveDuties  = flag.String("purge.duties", "", "comma-separated duty cycles of BenchmarkPurgePacingCurve (default: 1,0.5,0.2,0.1,0.05)")
)

// purgeMode is one way of purging in the purge benchmarks.
type purgeMode struct {
	name     string
	batch    int           // PurgeConfig.BatchSize (0: default)
	duty     float64       // PurgeConfig.DutyCycle (0: default, 1: flat out)
	maxPause time.Duration // PurgeConfig.MaxPause (0: default)
	pause    time.Duration // PurgeConfig.Pause
	purges   int           // concurrent Purge calls
	dropped  bool          // partition-drop
}

// BenchmarkPurgeUnderLoad/<db>/<mode> purges 1,000,000 expired inbox rows
// (-short: 20,000; -purge.rows: any) while 4 handlers claim new messages in
// the same table, and reports the rows removed per second and the
// handlers' p99 latency while purging (p99-us-purging) against the same
// handlers with no purge running, 10 s before it and 10 s after it, pooled
// (p99-us-idle; p99-us-idle-before, p99-us-idle-after), their ratio (p99-ratio),
// and the purge's pacing (paused-s, effective duty-cycle, back-offs).
// db: sqlite, postgres, mysql. mode:
//   - defaults: one Purge with every optional field zero (BatchSize 1000,
//     DutyCycle 0.1, MaxPause 1 s): what a purge left on in production does;
//   - delete-batch<n>[-pause<d>]: one Purge with BatchSize n and Pause d,
//     flat out (DutyCycle 1), as before pacing existed;
//   - two-purges-batch1000: two flat-out Purge calls at once, BatchSize
//     1000, as two application instances whose purges are not serialised
//     (a Purger takes a lock, so two Purgers are one purge at a time);
//   - partition-drop (postgres only): PostgreSQLPartitioned, DropPartitions
//     of 10 daily partitions.
//
// The handlers claim back to back, keeping the database busy, unless
// -purge.rate gives them an open-loop rate (a consumer at N messages/s).
// One run per benchmark: use -benchtime 1x.
func BenchmarkPurgeUnderLoad(b *testing.B) {
	rows := 1_000_000
	if testing.Short() {
		rows = 5_000
	}
	runPurgeModes(b, rows, []purgeMode{
		{name: "defaults", purges: 1},
		{name: "delete-batch1000", batch: 1000, duty: 1, purges: 1},
		{name: "two-purges-batch1000", batch: 1000, duty: 1, purges: 2},
		{name: "delete-batch100", batch: 100, duty: 1, purges: 1},
		{name: "delete-batch100-pause2ms", batch: 100, duty: 1, pause: 2 * time.Millisecond, purges: 1},
		{name: "partition-drop", dropped: true},
	})
}

// BenchmarkPurgePacingCurve/<db>/batch<n>-duty<d> is the trade-off curve of
// the paced purge: BatchSize n (100, 1000) times DutyCycle d (1: flat out,
// 0.5, 0.2, 0.1 = the default, 0.05), purging 200,000 expired rows (-short:
// 20,000; -purge.rows: any) under the same load and with the same metrics as
// BenchmarkPurgeUnderLoad. Lower duty cycles trade purge speed
// (rows-removed/s) for the handlers' tail latency (p99-ratio).
//
// One run per benchmark: use -benchtime 1x.
func BenchmarkPurgePacingCurve(b *testing.B) {
	rows := 200_000
	batches, duties := []int{100, 1000}, []float64{1, 0.5, 0.2, 0.1, 0.05}
	if testing.Short() {
		// CI's short mode only keeps the code from rotting: one paced
		// point per database, a small table (a paced purge of 20,000 rows
		// at a low duty cycle sleeps for most of a minute).
		rows, batches, duties = 5_000, []int{1000}, []float64{0.5}
	}
	if *purgeCurveBatches != "" {
		batches = nil
		for _, f := range strings.Split(*purgeCurveBatches, ",") {
			n, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil {
				b.Fatalf("-purge.batches: %v", err)
			}
			batches = append(batches, n)
		}
	}
	if *purgeCurveDuties != "" {
		duties = nil
		for _, f := range strings.Split(*purgeCurveDuties, ",") {
			d, err := strconv.ParseFloat(strings.TrimSpace(f), 64)
			if err != nil {
				b.Fatalf("-purge.duties: %v", err)
			}
			duties = append(duties, d)
		}
	}
	var modes []purgeMode
	for _, batch := range batches {
		for _, duty := range duties {
			modes = append(modes, purgeMode{name: fmt.Sprintf("batch%d-duty%g", batch, duty), batch: batch, duty: duty, purges: 1})
		}
	}
	runPurgeModes(b, rows, modes)
}

// runPurgeModes runs every mode on every database, purging rows expired rows
// (-purge.rows, when set) while the handlers run.
func runPurgeModes(b *testing.B, rows int, modes []purgeMode) {
	if *purgeRows > 0 {
		rows = *purgeRows
	}
	idleFor := 10 * time.Second // a p99 of a few thousand messages, not a few dozen
	if testing.Short() {
		idleFor = time.Second
	}
	for _, tdb := range []testdb.DB{purgeDB("sqlite"), purgeDB("postgres"), purgeDB("mysql")} {
		for _, m := range modes {
			if m.dropped && tdb.Name != "postgres" {
				continue
			}
			b.Run(tdb.Name+"/"+m.name, func(b *testing.B) {
				db := tdb.Open(b)
				db.SetMaxOpenConns(8)
				ctx := context.Background()
				table := "bench_purge_" + testdb.RandomSuffix()
				b.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + table + cascade(tdb.Dialect)) })
				dialect := tdb.Dialect
				if m.dropped {
					dialect = inbox.PostgreSQLPartitioned
				}
				ib, err := inbox.New(inbox.Config{DB: db, Dialect: dialect, Table: table, Consumer: "bench"})
				if err != nil {
					b.Fatal(err)
				}
				if err := ib.InitializeSchema(ctx); err != nil {
					b.Fatal(err)
				}
				if m.dropped {
					var now time.Time
					if err := db.Get(&now, "SELECT now()"); err != nil {
						b.Fatal(err)
					}
					if err := inbox.CreatePartitions(ctx, db, table, now.AddDate(0, 0, -30), 31); err != nil {
						b.Fatal(err)
					}
				}
				fillExpired(b, db, dialect, table, rows) // over 10 days, 30 to 20 days ago
				// Whatever the machine still writes back (the fill, the last
				// benchmark's dropped table) is written before the idle
				// handlers are measured, not while: a sync of every file
				// system.
				syscall.Sync()
				h := inboxHandler(ib, insertSQL(db, businessTable(b, db)))

				b.ResetTimer()
				// The handlers' idle latency is taken before the purge and
				// again after it, and pooled: the database drifts over a run
				// (the first writes after the fill's checkpoint carry full
				// page images, the tables grow), and one side alone would
				// count that drift as the purge's effect or hide it.
				idleBefore := load(b, h, func() {
					time.Sleep(idleFor)
				})
				var removed atomic.Int64
				var purgeTime time.Duration
				var purgeErr error
				var pacing inbox.PurgePacing
				purging := load(b, h, func() {
					start := time.Now()
					if m.dropped {
						dropped, err := inbox.DropPartitions(ctx, db, table, 7*24*time.Hour, nil)
						for _, d := range dropped {
							removed.Add(d.Rows)
						}
						purgeErr = err
					} else {
						var wg sync.WaitGroup
						var mu sync.Mutex
						for range m.purges {
							wg.Add(1)
							go func() {
								defer wg.Done()
								// One purge: a Purger's round, for the pacing
								// it reports. Two: plain Purge calls, which a
								// Purger's lock would serialise.
								cfg := inbox.PurgeConfig{
									DB: db, Dialect: dialect, Table: table, OlderThan: 7 * 24 * time.Hour,
									BatchSize: m.batch, DutyCycle: m.duty, MaxPause: m.maxPause, Pause: m.pause,
								}
								var n int64
								var err error
								var pc inbox.PurgePacing
								if m.purges == 1 {
									var p *inbox.Purger
									if p, err = inbox.NewPurger(inbox.PurgerConfig{Purge: cfg}); err == nil {
										r := p.RunOnce(ctx)
										n, err, pc = r.Deleted, r.Err, r.Pacing
									}
								} else {
									n, err = inbox.Purge(ctx, cfg)
								}
								removed.Add(n)
								mu.Lock()
								purgeErr = errors.Join(purgeErr, err)
								pacing = pc
								mu.Unlock()
							}()
						}
						wg.Wait()
					}
					purgeTime = time.Since(start)
				})
				idleAfter := load(b, h, func() {
					time.Sleep(idleFor)
				})
				b.StopTimer()
				idle := p99(slices.Concat(idleBefore, idleAfter))
				if purgeErr != nil {
					b.Fatal(purgeErr)
				}
				if removed.Load() != int64(rows) {
					b.Fatalf("removed %d rows, want %d", removed.Load(), rows)
				}
				b.ReportMetric(float64(removed.Load())/purgeTime.Seconds(), "rows-removed/s")
				b.ReportMetric(float64(idle.Microseconds()), "p99-us-idle")
				b.ReportMetric(float64(p99(idleBefore).Microseconds()), "p99-us-idle-before")
				b.ReportMetric(float64(p99(idleAfter).Microseconds()), "p99-us-idle-after")
				b.ReportMetric(float64(p99(purging).Microseconds()), "p99-us-purging")
				b.ReportMetric(float64(p99(purging))/float64(idle), "p99-ratio")
				if m.purges == 1 {
					b.ReportMetric(pacing.Paused.Seconds(), "paused-s")
					b.ReportMetric(pacing.DutyCycle, "duty-cycle")
					b.ReportMetric(float64(pacing.BackOffs), "back-offs")
				}
			})
		}
	}
}

// purgeDB returns the test database named name.
func purgeDB(name string) testdb.DB {
	for _, d := range testdb.All {
		if d.Name == name {
			return d
		}
	}
	panic("no test database " + name)
}

func cascade(d inbox.Dialect) string {
	if d == inbox.PostgreSQL {
		return " CASCADE"
	}
	return ""
}

// fillExpired adds n rows for the consumer "old", processed over 10 days,
// 30 to 20 days (and an hour) ago by the database clock, in bulk statements,
// inserted in the order they were processed, as a consumer inserts them: on
// PostgreSQL, whose heap keeps insertion order, the oldest rows share heap
// pages, so a batch touches few of them (rows interleaved in time would put
// each of a batch's rows on a page of its own, 4.5 times the WAL).
func fillExpired(b *testing.B, db *sqlx.DB, d inbox.Dialect, table string, n int) {
	var err error
	switch d {
	case inbox.PostgreSQL, inbox.PostgreSQLPartitioned:
		_, err = db.Exec(fmt.Sprintf(`INSERT INTO %s (consumer, message_id, processed_at)
			SELECT 'old', md5(random()::text || g), now() - interval '30 days 1 hour' + g * (interval '10 days' / %d)
			FROM generate_series(1, %d) g`, table, n, n))
		// Rows expired weeks ago have long been vacuumed (hint bits set,
		// all-visible): so are these, and the fill's dirty pages are
		// written out before the idle handlers are measured, not while.
		if err == nil {
			_, err = db.Exec("VACUUM (ANALYZE) " + table)
		}
		if err == nil {
			_, err = db.Exec("CHECKPOINT")
		}
	case inbox.SQLite:
		_, err = db.Exec(`WITH RECURSIVE s(g) AS (SELECT 1 UNION ALL SELECT g + 1 FROM s WHERE g < ?1)
			INSERT INTO `+table+` (consumer, message_id, processed_at)
			SELECT 'old', lower(hex(randomblob(16))),
			       CAST(unixepoch('subsec') * 1000000 AS INTEGER) - 30 * 86400000000 - 3600000000 + g * (10 * 86400000000 / ?1)
			FROM s`, n)
		if err == nil {
			_, err = db.Exec("PRAGMA wal_checkpoint(TRUNCATE)")
		}
	default: // MySQL/MariaDB
		for lo := 0; lo < n && err == nil; lo += 10_000 {
			var values []string
			for g := lo; g < min(n, lo+10_000); g++ {
				values = append(values, fmt.Sprintf("('old', '%s', UTC_TIMESTAMP(6) - INTERVAL 30 DAY - INTERVAL 1 HOUR + INTERVAL %d MICROSECOND)",
					watermill.NewUUID(), int64(g)*int64(10*24*time.Hour/time.Microsecond)/int64(n)))
			}
			_, err = db.Exec("INSERT INTO " + table + " (consumer, message_id, processed_at) VALUES " + strings.Join(values, ", "))
		}
		// Write the fill's dirty pages out before the idle handlers are
		// measured: FLUSH TABLES ... FOR EXPORT flushes the table's pages
		// (InnoDB's own flushing leaves thousands dirty for as long as it
		// likes); UNLOCK TABLES on the same session ends it.
		if err == nil {
			err = flushForExport(db, table)
		}
	}
	if err != nil {
		b.Fatal(err)
	}
}

// load runs 4 handlers on fresh messages while during runs, back to back
// or at -purge.rate, and returns their latencies.
func load(b *testing.B, h message.HandlerFunc, during func()) []time.Duration {
	var stop atomic.Bool
	var mu sync.Mutex
	var latencies []time.Duration
	var wg sync.WaitGroup
	const handlers = 4
	var every time.Duration // one handler's interval between messages; 0: back to back
	if *purgeLoadRate > 0 {
		every = time.Second * handlers / time.Duration(*purgeLoadRate)
	}
	start := time.Now()
	for w := range handlers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var mine []time.Duration
			// Open loop: message i of handler w is due at start + (i +
			// w/handlers) * every, and its latency counts from then.
			due := start.Add(every * time.Duration(w) / handlers)
			for !stop.Load() {
				msg := message.NewMessage(watermill.NewUUID(), nil)
				t0 := time.Now()
				if every > 0 {
					if wait := time.Until(due); wait > 0 {
						time.Sleep(wait)
						t0 = time.Now() // not the timer's lateness
					} else {
						t0 = due // behind: the wait in the queue counts
					}
					due = due.Add(every)
				}
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
	return latencies
}

// p99 returns the 99th percentile of latencies, which must not be empty.
func p99(latencies []time.Duration) time.Duration {
	sorted := slices.Sorted(slices.Values(latencies))
	return sorted[len(sorted)*99/100]
}

// flushForExport runs FLUSH TABLES table FOR EXPORT and UNLOCK TABLES on one
// MySQL/MariaDB session.
func flushForExport(db *sqlx.DB, table string) error {
	ctx := context.Background()
	conn, err := db.Conn(ctx)
	if err != nil {
		return err
	}
	defer conn.Close()
	if _, err := conn.ExecContext(ctx, "FLUSH TABLES "+table+" FOR EXPORT"); err != nil {
		return err
	}
	_, err = conn.ExecContext(ctx, "UNLOCK TABLES")
	return err
}
