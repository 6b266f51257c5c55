package inbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// DETACH PARTITION ... CONCURRENTLY waits for every transaction that uses
// the parent (a slow handler). If it is cancelled during that wait (here by
// the role's statement_timeout, as many deployments set; equally
// pg_cancel_backend or a server-side cancel), PostgreSQL leaves the
// partition "pending detach". The doc says "a partition left detached by an
// interruption is dropped by the next call"; instead every later call, and
// every Purger round, fails: the code runs DETACH ... CONCURRENTLY again
// instead of DETACH ... FINALIZE.
func TestReviewDropPartitionsAfterInterruptedDetach(t *testing.T) {
	db := testdb.OpenPostgres(t, "statement_timeout=1000")
	table := "inbox_" + randomSuffix()
	t.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + table + " CASCADE") })
	newPartitionedInbox(t, db, table, nil)
	ctx := context.Background()
	if err := inbox.CreatePartitions(ctx, db, table, dbNow(t, db).AddDate(0, 0, -5), 3); err != nil {
		t.Fatal(err)
	}
	exec(t, db, "INSERT INTO "+table+" VALUES ('billing', 'old', now() - interval '4 days')")

	// A slow handler: a transaction that has touched the inbox table.
	slow, err := db.BeginTxx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := slow.Exec("SELECT count(*) FROM " + table + " WHERE consumer = 'x'"); err != nil {
		t.Fatal(err)
	}
	_, err = inbox.DropPartitions(ctx, db, table, 48*time.Hour, nil)
	t.Logf("interrupted drop: %v", err)
	slow.Rollback()

	var pending int
	if err := db.Get(&pending, "SELECT count(*) FROM pg_inherits WHERE inhparent = $1::regclass AND inhdetachpending", table); err != nil {
		t.Fatal(err)
	}
	t.Logf("partitions pending detach: %d", pending)

	for i := range 2 {
		dropped, err := inbox.DropPartitions(ctx, db, table, 48*time.Hour, nil)
		if err != nil {
			t.Errorf("drop #%d after the interruption: %v (dropped %v)", i+1, err, dropped)
		} else {
			t.Logf("drop #%d: dropped %v", i+1, dropped)
		}
	}
	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table, OlderThan: 48 * time.Hour}})
	if err != nil {
		t.Fatal(err)
	}
	if round := p.RunOnce(ctx); round.Err != nil {
		t.Errorf("purger round: %v", round.Err)
	}
	var left int
	if err := db.Get(&left, `SELECT count(*) FROM pg_class WHERE relkind = 'r' AND relname LIKE $1 ESCAPE '!'`, table+"!_p%"); err != nil {
		t.Fatal(err)
	}
	if left != 9 {
		t.Errorf("partition tables left: %d, want 9 (yesterday to today+7)", left)
	}
}
