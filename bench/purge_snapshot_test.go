package bench

import (
	"context"
	"testing"
	"time"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// BenchmarkPurgeBehindOpenSnapshot/<db> purges expired rows while another
// session holds a consistent snapshot open for the whole purge (a
// `mysqldump --single-transaction`, a long report, an idle-in-transaction
// client): MySQL/MariaDB keep every deleted row's index entry until the
// snapshot ends, and PostgreSQL its dead tuples, so a batch that scans the
// processed_at index from the oldest entry steps over every row the
// batches before it deleted. It purges 20,000 rows, then 200,000 into a
// fresh table, each behind a snapshot opened after the fill, BatchSize
// 1000, flat out, and reports the purge time per row of each
// (us-per-row-small, us-per-row-large) and their ratio (growth, large over
// small): about 1 (less, the fixed costs spread) when each batch costs the
// same, and towards 10 when each batch's cost grows with the rows deleted
// before it (the purge quadratic in its rows). -purge.rows sets the larger
// count (the smaller is a tenth of it; -short: 2,000). db: postgres, mysql
// (SQLite's readers do not keep deleted rows in the table's b-tree). It
// purges once whatever -benchtime says: use -benchtime 1x.
func BenchmarkPurgeBehindOpenSnapshot(b *testing.B) {
	large := 200_000
	if testing.Short() {
		large = 2_000
	}
	if *purgeRows > 0 {
		large = *purgeRows
	}
	for _, tdb := range []testdb.DB{purgeDB("postgres"), purgeDB("mysql")} {
		b.Run(tdb.Name, func(b *testing.B) {
			db := tdb.Open(b)
			ctx := context.Background()
			perRow := func(rows int) float64 {
				table := "bench_purge_snapshot_" + testdb.RandomSuffix()
				b.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + table + cascade(tdb.Dialect)) })
				ib, err := inbox.New(inbox.Config{DB: db, Dialect: tdb.Dialect, Table: table, Consumer: "bench"})
				if err != nil {
					b.Fatal(err)
				}
				if err := ib.InitializeSchema(ctx); err != nil {
					b.Fatal(err)
				}
				fillExpired(b, db, tdb.Dialect, table, rows)
				snapshot, err := db.BeginTxx(ctx, nil)
				if err != nil {
					b.Fatal(err)
				}
				defer snapshot.Rollback() //nolint:errcheck // read only
				read := "START TRANSACTION WITH CONSISTENT SNAPSHOT"
				if tdb.Dialect == inbox.PostgreSQL {
					read = "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"
				}
				if _, err := snapshot.Exec(read); err != nil && tdb.Dialect == inbox.PostgreSQL {
					b.Fatal(err)
				}
				var n int
				if err := snapshot.Get(&n, "SELECT count(*) FROM "+table); err != nil || n != rows {
					b.Fatalf("snapshot read %d rows, err %v; want %d", n, err, rows)
				}
				start := time.Now()
				deleted, err := inbox.Purge(ctx, inbox.PurgeConfig{DB: db, Dialect: tdb.Dialect, Table: table,
					OlderThan: 24 * time.Hour, BatchSize: 1000, DutyCycle: 1})
				took := time.Since(start)
				if err != nil || deleted != int64(rows) {
					b.Fatalf("purge deleted %d, err %v; want %d", deleted, err, rows)
				}
				return float64(took.Microseconds()) / float64(rows)
			}
			b.ResetTimer()
			// Once, whatever b.N (-benchtime 200x in CI's smoke run of
			// the benchmarks): each run is two fills and two purges.
			small, big := perRow(large/10), perRow(large)
			b.ReportMetric(small, "us-per-row-small")
			b.ReportMetric(big, "us-per-row-large")
			b.ReportMetric(big/small, "growth")
		})
	}
}
