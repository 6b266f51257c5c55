package inbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// Two DropPartitions at once (two instances, or an operator's call during a
// Purger round) must neither fail nor count a partition twice. The first call
// is held half way through DETACH PARTITION ... CONCURRENTLY (which waits for
// a transaction that reads the table) when the second starts, and is let go
// once the second has tried the purge lock. The second call finds the work done: no
// "partition ... already pending detach" or "is not a partition" error.
func TestDropPartitionsConcurrently(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	ctx := context.Background()
	table := partitionedTable(t, db)
	now := dbNow(t, db)
	if err := inbox.InitializePartitions(ctx, db, table, inbox.PartitionDay); err != nil {
		t.Fatal(err)
	}
	if err := inbox.CreatePartitions(ctx, db, table, now.AddDate(0, 0, -6), 7); err != nil {
		t.Fatal(err)
	}
	for day := 2; day <= 6; day++ { // days -6 .. -2, past a 1-day window
		exec(t, db, fmt.Sprintf("INSERT INTO %s SELECT 'billing', 'd%d-' || g, now() - interval '%d days' FROM generate_series(1, 10) g",
			table, day, day))
	}
	second := testdb.OpenPostgres(t, "application_name=second_drop_"+randomSuffix())

	reader, err := db.BeginTxx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer reader.Rollback() //nolint:errcheck // released below
	if _, err := reader.ExecContext(ctx, "SELECT 1 FROM "+table+" LIMIT 1"); err != nil {
		t.Fatal(err)
	}
	type result struct {
		dropped []inbox.DroppedPartition
		err     error
	}
	drop := func(pool *sqlx.DB, out chan<- result) {
		dropped, err := inbox.DropPartitions(ctx, pool, table, 24*time.Hour, nil)
		out <- result{dropped, err}
	}
	first, later := make(chan result, 1), make(chan result, 1)
	go drop(db, first)
	// The first call has detached its first partition half way: it waits
	// for the reader to end.
	waitFor(t, func() bool { return pending(t, db, table) })
	go drop(second, later)
	var app string
	if err := second.Get(&app, "SELECT current_setting('application_name')"); err != nil {
		t.Fatal(err)
	}
	// The second call polls for the purge lock (it never blocks in the lock,
	// holding a connection): wait until it has tried, seen as the try itself
	// or the rollback that follows a try that failed.
	waitFor(t, func() bool {
		return count(t, db, "pg_stat_activity",
			"application_name = $1 AND (query LIKE '%pg_try_advisory_xact_lock%' OR lower(query) = 'rollback')", app) > 0
	})
	if err := reader.Rollback(); err != nil {
		t.Fatal(err)
	}
	var rows int64
	names := map[string]int{}
	for _, ch := range []chan result{first, later} {
		r := <-ch
		if r.err != nil {
			t.Errorf("DropPartitions: dropped %v, then %v", r.dropped, r.err)
		}
		for _, d := range r.dropped {
			rows += d.Rows
			names[d.Name]++
		}
	}
	if rows != 50 || len(names) != 5 {
		t.Errorf("dropped %d rows in partitions %v; want 50 rows in 5 partitions, each once", rows, names)
	}
	for name, n := range names {
		if n != 1 {
			t.Errorf("partition %s reported dropped %d times", name, n)
		}
	}
	if n := count(t, db, table, ""); n != 0 {
		t.Errorf("%d rows left, want 0", n)
	}
}

// pending reports whether a partition of table is pending detach.
func pending(t *testing.T, db *sqlx.DB, table string) bool {
	t.Helper()
	return count(t, db, "pg_inherits", "inhdetachpending AND inhparent = to_regclass($1)", table) > 0
}
