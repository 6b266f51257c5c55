package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// partitionedByHand makes a PostgreSQL table of the canonical partitioned
// shape, with one partition made by hand covering the 60
// days before today to 30 days after (a wide range, as pg_partman's or an
// operator's), dropped at the end of the test.
func partitionedByHand(t *testing.T) string {
	t.Helper()
	db := testdb.OpenPostgres(t, "")
	table := "inbox_" + testdb.RandomSuffix()
	testdb.DropLater(t, db, table)
	for _, q := range []string{
		`CREATE TABLE ` + table + ` (consumer text NOT NULL, message_id text NOT NULL, processed_at timestamptz NOT NULL DEFAULT now(),` +
			` fingerprint bytea, PRIMARY KEY (consumer, message_id, processed_at)) PARTITION BY RANGE (processed_at)`,
		`CREATE TABLE ` + table + `_wide PARTITION OF ` + table + ` FOR VALUES FROM (date_trunc('day', now()) - interval '60 days')` +
			` TO (date_trunc('day', now()) + interval '30 days')`,
	} {
		if _, err := db.Exec(q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	return table
}

// "inbox stats -consumer" measures the headroom of a purge limited to that
// consumer, which deletes the consumer's expired rows one by one (the
// partitions it shares with other consumers are not its to drop): a row of
// the consumer far past the window means that purge is behind or not
// running, however wide the partition that holds it, and stats must warn.
func TestStatsOfAConsumerWarnsWhenItsRowsArePastTheWindowInAPartitionThatHasNotEnded(t *testing.T) {
	t.Parallel()
	table := partitionedByHand(t)
	db := testdb.OpenPostgres(t, "")
	for _, q := range []string{
		`INSERT INTO ` + table + ` (consumer, message_id, processed_at) VALUES ('billing', 'm-1', now() - interval '20 days')`,
		`INSERT INTO ` + table + ` (consumer, message_id, processed_at) VALUES ('audit', 'm-1', now() - interval '20 days')`,
	} {
		if _, err := db.Exec(q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	code, out, errOut := cli(t, "stats", "-db", testdb.PostgresDSN(), "-table", table, "-consumer", "billing",
		"-older-than", "24h", "-purge-lag", "1h")
	if code != 0 {
		t.Fatalf("stats: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	if !strings.Contains(out, "warning:") {
		t.Errorf("billing's oldest row is 20 days old, the window 24h, -purge-lag 1h: stats -consumer billing does not warn that the purge is behind\n%s", out)
	}
	// What a purge limited to billing does with that row: it deletes it, so
	// a row that old is one that purge has not reached.
	purger, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table,
		Consumer: "billing", OlderThan: 24 * time.Hour}})
	if err != nil {
		t.Fatal(err)
	}
	if round := purger.RunOnce(context.Background()); round.Err != nil || round.Deleted != 1 {
		t.Errorf("purge round limited to billing, window 24h: deleted %d, %v; want billing's row deleted", round.Deleted, round.Err)
	}
}
