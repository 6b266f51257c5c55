package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// "inbox stats" warns that the purge is falling behind only when it is: on a
// partitioned table, a row is dropped with its partition once all of that
// partition is past the window, so a row older than the window plus
// -purge-lag in a partition that is not yet entirely past it is what a
// healthy purge leaves. docs/purge.md supports range partitions of any width
// (made by hand, by pg_partman, or the weekly ones left by a migration to
// days); the allowance must follow the partition that holds the oldest row,
// not the newest partition's interval.
func TestStatsDoesNotWarnAboutAPartitionOfAnotherWidthThePurgeCannotDropYet(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	table := "cli_" + testdb.RandomSuffix()
	testdb.DropLater(t, db, table)
	t.Cleanup(func() {
		// Every overload of the table's claim functions (dropping the table leaves them).
		db.Exec(`DO $$DECLARE f regprocedure; BEGIN FOR f IN SELECT oid::regprocedure FROM pg_proc WHERE proname = '` + table + `_claim'
			LOOP EXECUTE 'DROP FUNCTION ' || f::text; END LOOP; END$$`) //nolint:errcheck // best effort
	})
	if code, out, errOut := cli(t, "schema", "-db", testdb.PostgresDSN(), "-dialect", "postgres-partitioned", "-table", table, "-apply"); code != 0 {
		t.Fatalf("schema -apply: %d %q %q", code, out, errOut)
	}
	// A partition made by hand for the 28 days before the library's first
	// (weekly, from yesterday's week on): [first - 28d, first).
	exec := func(q string) {
		t.Helper()
		if _, err := db.Exec(q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	var first time.Time
	if err := db.Get(&first, `SELECT date_trunc('week', (now() AT TIME ZONE 'UTC') - interval '1 day') AT TIME ZONE 'UTC'`); err != nil {
		t.Fatal(err)
	}
	lo, hi := first.UTC().AddDate(0, 0, -28).Format(time.RFC3339), first.UTC().Format(time.RFC3339)
	exec(`CREATE TABLE ` + table + `_old (LIKE ` + table + ` INCLUDING DEFAULTS INCLUDING CONSTRAINTS)`)
	exec(`ALTER TABLE ` + table + ` ATTACH PARTITION ` + table + `_old FOR VALUES FROM ('` + lo + `') TO ('` + hi + `')`)
	// Its oldest row: 27 days before the partition's end, at least 28 days old.
	exec(`INSERT INTO ` + table + ` (consumer, message_id, processed_at) VALUES ('billing', 'm-1', timestamptz '` + lo + `' + interval '1 day')`)

	// The window: 240h. The hand-made partition ends at most 8 days ago, so
	// none of its rows may go yet: the purge is not behind.
	ctx := context.Background()
	dropped, err := inbox.DropPartitions(ctx, db, table, 240*time.Hour, nil)
	if err != nil || len(dropped) != 0 {
		t.Fatalf("DropPartitions(240h) = %v, %v; want nothing dropped (no partition is entirely past the window)", dropped, err)
	}
	code, out, errOut := cli(t, "stats", "-db", testdb.PostgresDSN(), "-table", table, "-older-than", "240h", "-purge-lag", "1h")
	if code != 0 {
		t.Fatalf("stats: exit %d, stderr %q", code, errOut)
	}
	if strings.Contains(out, "warning:") {
		t.Errorf("stats of a partitioned table whose oldest row is in a partition not yet past the 240h window"+
			" (the purge can drop nothing): stdout\n%s\nwant no falling-behind warning", out)
	}
	// Under a 1h window the same partition, ended at least a day ago, is
	// past it by more than -purge-lag: that is a purge falling behind.
	code, out, errOut = cli(t, "stats", "-db", testdb.PostgresDSN(), "-table", table, "-older-than", "1h", "-purge-lag", "1h")
	if code != 0 || !strings.Contains(out, "warning:  the partition that holds the oldest row ended ") {
		t.Errorf("stats -older-than 1h: exit %d, stderr %q, stdout\n%s\nwant the falling-behind warning naming the partition's end", code, errOut, out)
	}
}
