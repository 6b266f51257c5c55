package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// On a partitioned table whose interval was migrated from weeks to days
// (inbox partitions -interval day -migrate), the weekly partitions age out
// one by one: a row of one is kept until all of that week is past the
// window, up to a week longer than the window. "inbox stats" must not warn
// that the purge is falling behind while the purge rightly keeps that row:
// the allowance is the interval of the partition that holds the oldest row,
// not that of the newest partition.
func TestStatsAllowsTheIntervalOfThePartitionHoldingTheOldestRow(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	ctx := context.Background()
	table := "cli_" + testdb.RandomSuffix()
	testdb.DropLater(t, db, table)
	t.Cleanup(func() {
		db.Exec(`DO $$DECLARE f regprocedure; BEGIN FOR f IN SELECT oid::regprocedure FROM pg_proc WHERE proname = '` + table + `_claim'
			LOOP EXECUTE 'DROP FUNCTION IF EXISTS ' || f::text; END LOOP; END$$`)
	})
	if code, out, errOut := cli(t, "schema", "-db", testdb.PostgresDSN(), "-dialect", "postgres-partitioned", "-table", table, "-apply"); code != 0 {
		t.Fatalf("schema -apply: %d %q %q", code, out, errOut)
	}
	var now time.Time
	if err := db.Get(&now, "SELECT now()"); err != nil {
		t.Fatal(err)
	}
	now = now.UTC()
	// The Monday of the ISO week a week ago: a weekly partition from it
	// ended at this week's Monday, less than a week ago.
	weekAgo := now.AddDate(0, 0, -7).Truncate(24 * time.Hour)
	weekStart := weekAgo.AddDate(0, 0, -((int(weekAgo.Weekday()) + 6) % 7))
	weekEnd := weekStart.AddDate(0, 0, 7)
	if err := inbox.CreatePartitions(ctx, db, table, weekStart, 14); err != nil {
		t.Fatal(err)
	}
	if err := inbox.MigratePartitionInterval(ctx, db, table, inbox.PartitionDay); err != nil {
		t.Fatal(err)
	}
	if iv, err := inbox.TablePartitionInterval(ctx, db, table); err != nil || iv != inbox.PartitionDay {
		t.Fatalf("after migrating to days: interval %q, %v", iv, err)
	}
	row := weekStart.Add(time.Minute)
	if _, err := db.Exec("INSERT INTO "+table+" (consumer, message_id, processed_at) VALUES ('billing', 'm1', $1)", row); err != nil {
		t.Fatal(err)
	}
	// A window the weekly partition has not passed yet: the purge keeps it.
	window := now.Sub(weekEnd).Truncate(time.Hour) + 2*time.Hour
	purger, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table, OlderThan: window}})
	if err != nil {
		t.Fatal(err)
	}
	round := purger.RunOnce(ctx)
	if round.Err != nil || round.Deleted != 0 || round.OldestAge > round.Window {
		t.Fatalf("purge round with window %v: deleted %d, oldest age %v, %v; want nothing deleted and the oldest partition within the window",
			window, round.Deleted, round.OldestAge, round.Err)
	}
	code, out, errOut := cli(t, "stats", "-db", testdb.PostgresDSN(), "-table", table, "-older-than", window.String(), "-purge-lag", "1h")
	if code != 0 {
		t.Fatalf("stats: exit %d, stderr %q", code, errOut)
	}
	if strings.Contains(out, "warning:") {
		t.Errorf("oldest row %v old in a weekly partition that ended %v ago, window %v, right after a purge round that kept it as it should:"+
			" stats warns that the purge is falling behind\n%s", now.Sub(row).Round(time.Minute), now.Sub(weekEnd).Round(time.Minute), window, out)
	}
}
