package bench

import (
	"context"
	"flag"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

var scaleRows = flag.String("scale-rows", "10000,5000000",
	"BenchmarkScale: comma-separated inbox sizes (rows already in the table); -short uses 10000,100000")

// BenchmarkScale/<db>/rows=<n>: the inbox variant at dup=0, conc=8 with n
// rows of other messages already in the inbox table (postgres-partitioned:
// spread over the 15-day Kafka-default window in weekly partitions). The claim is one
// primary-key insert, so its cost should depend on the index depth (log n),
// not on n.
func BenchmarkScale(b *testing.B) {
	sizes := *scaleRows
	if testing.Short() {
		sizes = "10000,100000"
	}
	for _, d := range databases() {
		b.Run(d.Name, func(b *testing.B) {
			db := d.Open(b)
			db.SetMaxOpenConns(16)
			db.SetMaxIdleConns(16)
			for _, s := range strings.Split(sizes, ",") {
				rows, err := strconv.Atoi(strings.TrimSpace(s))
				if err != nil {
					b.Fatalf("-scale-rows: %v", err)
				}
				// Fill the table once per size, not once per b.N probe.
				ib, table := newInbox(b, db, d.Dialect, "bench")
				if d.Dialect == inbox.PostgreSQLPartitioned {
					// The rows are spread over the Kafka-default window, in
					// the table's (weekly) partitions, at every size: the
					// partitions the claim probes stay the same, the rows in
					// them grow (BenchmarkPartitionedClaim compares
					// partition counts).
					var now time.Time
					if err := db.Get(&now, "SELECT now()"); err != nil {
						b.Fatal(err)
					}
					days := int(kafkaWindow / (24 * time.Hour))
					if err := inbox.CreatePartitions(context.Background(), db, table, now.AddDate(0, 0, -days), days+1); err != nil {
						b.Fatal(err)
					}
					fillWindow(b, db, table, rows)
				} else {
					prefill(b, db, d.Dialect, table, rows)
				}
				b.Run(fmt.Sprintf("rows=%d", rows), func(b *testing.B) {
					business := businessTable(b, db)
					query := insertSQL(db, business)
					h := inboxHandler(ib, query)
					run(b, h, messages(b.N, 0), 8)
				})
			}
		})
	}
}

// prefill inserts n rows with random message ids (UUID-like, like real
// ones, so new keys land all over the primary key index), in chunks, then
// refreshes the planner's statistics.
func prefill(b *testing.B, db *sqlx.DB, d inbox.Dialect, table string, n int) {
	const chunk = 250_000
	for lo := 0; lo < n; lo += chunk {
		k := min(chunk, n-lo)
		var q string
		switch d {
		case inbox.PostgreSQL, inbox.PostgreSQLPartitioned:
			q = fmt.Sprintf(`INSERT INTO %s (consumer, message_id, processed_at)
				SELECT 'consumer-' || (g %% 4), md5(random()::text || g), now() - g * interval '1 second'
				FROM generate_series(%d, %d) g`, table, lo, lo+k-1)
		case inbox.MySQL:
			q = fmt.Sprintf(`INSERT INTO %s (consumer, message_id, processed_at)
				SELECT CONCAT('consumer-', n %% 4), MD5(CONCAT(RAND(), n)), UTC_TIMESTAMP(6) - INTERVAL n SECOND
				FROM (SELECT %d + a.i + 10*b.i + 100*c.i + 1000*d.i + 10000*e.i + 100000*f.i AS n
				      FROM d10 a, d10 b, d10 c, d10 d, d10 e, d10 f) g WHERE n < %d`, table, lo, lo+k)
		default:
			q = fmt.Sprintf(`WITH RECURSIVE g(n) AS (SELECT %d UNION ALL SELECT n + 1 FROM g WHERE n < %d)
				INSERT INTO %s (consumer, message_id, processed_at)
				SELECT 'consumer-' || (n %% 4), lower(hex(randomblob(16))), CAST(unixepoch('subsec') * 1000000 AS INTEGER) - n * 1000000
				FROM g`, lo, lo+k-1, table)
		}
		if d == inbox.MySQL {
			// The temporary digits table lives on one connection.
			conn, err := db.Connx(context.Background())
			if err != nil {
				b.Fatal(err)
			}
			for _, s := range []string{
				"CREATE TEMPORARY TABLE IF NOT EXISTS d10 (i INT)", "DELETE FROM d10",
				"INSERT INTO d10 VALUES (0),(1),(2),(3),(4),(5),(6),(7),(8),(9)", q,
			} {
				if _, err := conn.ExecContext(context.Background(), s); err != nil {
					conn.Close()
					b.Fatal(err)
				}
			}
			conn.Close()
			continue
		}
		if _, err := db.Exec(q); err != nil {
			b.Fatal(err)
		}
	}
	analyze := map[inbox.Dialect]string{inbox.PostgreSQL: "ANALYZE " + table, inbox.PostgreSQLPartitioned: "ANALYZE " + table, inbox.MySQL: "ANALYZE TABLE " + table, inbox.SQLite: "ANALYZE"}
	if _, err := db.Exec(analyze[d]); err != nil {
		b.Fatal(err)
	}
}
