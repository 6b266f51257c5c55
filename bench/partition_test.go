package bench

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// kafkaWindow is Kafka's default safe window: 7 days' retention.ms, 7 days'
// segment.ms and a day's margin.
const kafkaWindow = 15 * 24 * time.Hour

// partitionedRows is how many rows each inbox table of
// BenchmarkPartitionedClaim holds before it runs, spread evenly over the
// window, fixed so that runs compare (BenchmarkScale varies the size).
const partitionedRows = 200_000

// BenchmarkPartitionedClaim/conc=<n>: the inbox variant of
// BenchmarkThroughput (one business insert per message, dup=0) on three
// tables that each hold partitionedRows rows spread over the Kafka-default
// window (15 days), side by side (see compare):
//
//   - plain: inbox.PostgreSQL;
//   - week: inbox.PostgreSQLPartitioned with weekly partitions (the
//     default) covering the window and DefaultPartitionsAhead days ahead;
//   - day: the same with daily partitions.
//
// It reports each side's msgs/s and p50, x-week and x-day (the median over
// the rounds of the partitioned side's rate over plain's), and the
// partitions each partitioned table has (week-partitions, day-partitions).
func BenchmarkPartitionedClaim(b *testing.B) {
	db := testdb.OpenPostgres(b, "")
	warm(b, db)
	plainIb, plainTable := newInbox(b, db, inbox.PostgreSQL, "bench")
	fillWindow(b, db, plainTable, partitionedRows)
	plain := side{"plain", inboxHandler(plainIb, insertSQL(db, businessTable(b, db)))}
	week, weekParts := partitionedSide(b, db, inbox.PartitionWeek)
	day, dayParts := partitionedSide(b, db, inbox.PartitionDay)
	for _, conc := range []int{1, 8} {
		b.Run(fmt.Sprintf("conc=%d", conc), func(b *testing.B) {
			x := compare(b, conc, plain, week, day)
			b.ReportMetric(x[1], "x-week")
			b.ReportMetric(x[2], "x-day")
			b.ReportMetric(float64(weekParts), "week-partitions")
			b.ReportMetric(float64(dayParts), "day-partitions")
		})
	}
}

// partitionedSide is the inbox variant on a new PostgreSQLPartitioned
// table of interval iv whose partitions cover the Kafka-default window and
// the days ahead, filled as fillWindow does. It returns the side and how
// many partitions the table has.
func partitionedSide(b *testing.B, db *sqlx.DB, iv inbox.PartitionInterval) (side, int) {
	ctx := context.Background()
	table := "bench_inbox_" + testdb.RandomSuffix()
	b.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + table + " CASCADE") })
	if err := inbox.InitializePartitions(ctx, db, table, iv); err != nil {
		b.Fatal(err)
	}
	var now time.Time
	if err := db.Get(&now, "SELECT now()"); err != nil {
		b.Fatal(err)
	}
	days := int(kafkaWindow / (24 * time.Hour))
	if err := inbox.CreatePartitions(ctx, db, table, now.AddDate(0, 0, -days), days+1); err != nil {
		b.Fatal(err)
	}
	ib, err := inbox.New(inbox.Config{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table, Consumer: "bench"})
	if err != nil {
		b.Fatal(err)
	}
	if err := ib.InitializeSchema(ctx); err != nil {
		b.Fatal(err)
	}
	fillWindow(b, db, table, partitionedRows)
	var parts int
	if err := db.Get(&parts, "SELECT count(*) FROM pg_inherits WHERE inhparent = to_regclass($1)", table); err != nil {
		b.Fatal(err)
	}
	return side{string(iv), inboxHandler(ib, insertSQL(db, businessTable(b, db)))}, parts
}

// fillWindow inserts n rows with random ids, processed at even steps over
// the last kafkaWindow, and analyzes the table.
func fillWindow(b *testing.B, db *sqlx.DB, table string, n int) {
	step := kafkaWindow.Microseconds() / int64(n)
	q := fmt.Sprintf(`INSERT INTO %s (consumer, message_id, processed_at)
		SELECT 'consumer-' || (g %% 4), md5(random()::text || g), now() - (g::bigint * %d) * interval '1 microsecond'
		FROM generate_series(1, %d) g`, table, step, n)
	if _, err := db.Exec(q); err != nil {
		b.Fatal(err)
	}
	if _, err := db.Exec("ANALYZE " + table); err != nil {
		b.Fatal(err)
	}
}

// BenchmarkPartitionedPurge/<scope>: Purge on a PostgreSQLPartitioned table
// (daily partitions) whose rows are all past the window, spread over three
// days across four consumers, at two sizes: 30,000 and 300,000 rows. scope
// is all (every consumer's rows) or consumer (PurgeConfig.Consumer, one
// consumer's quarter: a Purger's batches for a consumer whose partitions
// hold other consumers' rows). It reports the mean time of a 1,000-row
// batch at each size (ms/batch-30k, ms/batch-300k) and their ratio
// (x-300k/30k): a batch whose cost grows with the table makes a purge's
// time grow with the square of its rows, and never catches up with a large
// table. Each of b.N iterations purges both tables: run it -benchtime 1x.
// With -short (the suite's smoke run), 3,000 and 30,000 rows, the metrics
// named as the full sizes'.
func BenchmarkPartitionedPurge(b *testing.B) {
	db := testdb.OpenPostgres(b, "")
	warm(b, db)
	for _, scope := range []string{"all", "consumer"} {
		b.Run(scope, func(b *testing.B) {
			consumer := ""
			if scope == "consumer" {
				consumer = "consumer-0"
			}
			sizes := []int{30_000, 300_000}
			if testing.Short() {
				sizes = []int{3_000, 30_000}
			}
			perBatch := make([]time.Duration, len(sizes))
			for range b.N {
				for i, rows := range sizes {
					perBatch[i] += purgeExpiredPartitions(b, db, rows, consumer) / time.Duration(b.N)
				}
			}
			b.ReportMetric(float64(perBatch[0].Microseconds())/1000, "ms/batch-30k")
			b.ReportMetric(float64(perBatch[1].Microseconds())/1000, "ms/batch-300k")
			b.ReportMetric(float64(perBatch[1])/float64(perBatch[0]), "x-300k/30k")
		})
	}
}

// purgeExpiredPartitions fills a new daily-partitioned table with rows
// expired rows (four consumers, over three days ending two days ago),
// purges it (of consumer's rows only, unless it is "") in batches of 1,000
// with the timer running, and returns the mean time of a batch.
func purgeExpiredPartitions(b *testing.B, db *sqlx.DB, rows int, consumer string) time.Duration {
	b.StopTimer()
	ctx := context.Background()
	table := "bench_inbox_" + testdb.RandomSuffix()
	defer db.Exec("DROP TABLE IF EXISTS " + table + " CASCADE")
	if err := inbox.InitializePartitions(ctx, db, table, inbox.PartitionDay); err != nil {
		b.Fatal(err)
	}
	var now time.Time
	if err := db.Get(&now, "SELECT now()"); err != nil {
		b.Fatal(err)
	}
	if err := inbox.CreatePartitions(ctx, db, table, now.AddDate(0, 0, -6), 7); err != nil {
		b.Fatal(err)
	}
	step := (3 * 24 * time.Hour).Microseconds() / int64(rows)
	if _, err := db.Exec(fmt.Sprintf(`INSERT INTO %s (consumer, message_id, processed_at)
		SELECT 'consumer-' || (g %% 4), md5(random()::text || g), now() - interval '2 days' - (g::bigint * %d) * interval '1 microsecond'
		FROM generate_series(1, %d) g`, table, step, rows)); err != nil {
		b.Fatal(err)
	}
	if _, err := db.Exec("VACUUM ANALYZE " + table); err != nil {
		b.Fatal(err)
	}
	want := int64(rows)
	if consumer != "" {
		want /= 4
	}
	b.StartTimer()
	start := time.Now()
	n, err := inbox.Purge(ctx, inbox.PurgeConfig{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table,
		OlderThan: 24 * time.Hour, BatchSize: 1000, DutyCycle: 1, Consumer: consumer})
	took := time.Since(start)
	b.StopTimer()
	if err != nil || n != want {
		b.Fatalf("purge of %d rows: deleted %d, %v; want %d", rows, n, err, want)
	}
	return took / time.Duration((n+999)/1000)
}
