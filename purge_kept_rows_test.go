package inbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// plainTableKeepingHeldRows creates a plain PostgreSQL inbox table whose
// DELETE keeps the rows whose message id starts with "held" (a BEFORE
// DELETE trigger that returns NULL for them: a legal hold), dropped when
// the test ends.
func plainTableKeepingHeldRows(t *testing.T, db *sqlx.DB) string {
	t.Helper()
	table := "inbox_" + randomSuffix()
	hold := table + "_hold"
	t.Cleanup(func() {
		db.Exec("DROP TABLE IF EXISTS " + table)
		db.Exec("DROP FUNCTION IF EXISTS " + hold + "()")
	})
	ddl, err := inbox.SchemaSQL(inbox.PostgreSQL, table)
	if err != nil {
		t.Fatal(err)
	}
	for _, stmt := range statements(ddl) {
		exec(t, db, stmt)
	}
	exec(t, db, "CREATE FUNCTION "+hold+"() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN IF OLD.message_id LIKE 'held%' THEN RETURN NULL; END IF; RETURN OLD; END$$")
	exec(t, db, "CREATE TRIGGER "+hold+" BEFORE DELETE ON "+table+" FOR EACH ROW EXECUTE FUNCTION "+hold+"()")
	return table
}

// Expired rows that a plain table's DELETE keeps (a trigger, a row
// security policy), a batch or more of them among the oldest, end the
// purge instead of keeping it going for ever: each batch chose them again
// from the oldest row, deleted none, and the count of the rows left found
// a full batch again, so a Purger's round never ended and held the purge
// lock for good. Fewer kept rows than a batch do not stop it: the rows it
// can delete go.
func TestPurgeEndsBesideRowsItsDeleteKeeps(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	for _, c := range []struct {
		name      string
		batchSize int
		deleted   int64
	}{
		{"a batch or more kept", 10, 0},
		{"fewer kept than a batch", 100, 50},
	} {
		t.Run(c.name, func(t *testing.T) {
			table := plainTableKeepingHeldRows(t, db)
			insertRows(t, db, inbox.PostgreSQL, table, "billing", "held", 20, 3*24*time.Hour)
			insertRows(t, db, inbox.PostgreSQL, table, "billing", "m", 50, 2*24*time.Hour)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			n, err := inbox.Purge(ctx, inbox.PurgeConfig{DB: db, Table: table, OlderThan: 24 * time.Hour, BatchSize: c.batchSize, DutyCycle: 1})
			if err != nil || n != c.deleted {
				t.Errorf("purge beside 20 kept rows, BatchSize %d: deleted %d, err %v; want %d, nil (ended)", c.batchSize, n, err, c.deleted)
			}
			if held := count(t, db, table, "message_id LIKE 'held%'"); held != 20 {
				t.Errorf("%d kept rows left, want 20", held)
			}
		})
	}
}

// Two batches in a row from the oldest row that lose all their rows to
// another purge (a purge of one consumer beside a whole-table purge, or any
// second purge, which is safe: the batches delete fewer rows each, never
// the wrong ones) do not end the purge as if its DELETE kept them: the
// oldest expired row changed between them. The other consumer's expired
// rows, which nothing else deletes, are all deleted. The other purge's
// batches are two transactions that delete "billing"'s oldest rows and
// commit while the purge's DELETE waits on them.
func TestPurgeGoesOnAfterLosingTwoBatchesInARowToAnotherPurge(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	table := plainTable(t, db)
	// 20 rows of billing (oldest), then 50 of shipping, all expired, each at its own instant.
	exec(t, db, "INSERT INTO "+table+" (consumer, message_id, processed_at) SELECT CASE WHEN i <= 20 THEN 'billing' ELSE 'shipping' END,"+
		" 'm'||i, now() - interval '3 days' + i * interval '1 second' FROM generate_series(1, 70) i")

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// The other purge's two batches: billing's rows 1-10 and 11-20.
	tx1, pid1 := deleteElsewhere(t, ctx, db, table, 1, 10)
	tx2, pid2 := deleteElsewhere(t, ctx, db, table, 11, 20)
	res := make(chan purgeResult, 1)
	go func() {
		n, err := inbox.Purge(ctx, inbox.PurgeConfig{DB: db, Table: table, OlderThan: 24 * time.Hour, BatchSize: 10, DutyCycle: 1})
		res <- purgeResult{n, err}
	}()
	waitForPurgeBatchBlockedBy(t, db, table, pid1)
	if err := tx1.Commit(); err != nil {
		t.Fatal(err)
	}
	waitForPurgeBatchBlockedBy(t, db, table, pid2)
	if err := tx2.Commit(); err != nil {
		t.Fatal(err)
	}
	r := <-res
	left := count(t, db, table, "processed_at < now() - interval '1 day'")
	if r.err != nil || left != 0 {
		t.Errorf("purge deleted %d, err %v, and ended with %d expired rows of shipping left (no trigger, no policy); want all 50 deleted", r.n, r.err, left)
	}
}

// Fewer rows that the DELETE keeps than a batch, among the oldest, do not
// make the purge crawl: the batches after the first start at its bound,
// past them. Each batch started from the oldest row again after a short
// one, so 99 kept rows at BatchSize 100 let one row go a batch: 2,000
// deletable rows took 2,001 batches (each paced, the Purger's lock held).
func TestPurgePassesFewerKeptRowsThanABatchAtFullBatches(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	table := plainTableKeepingHeldRows(t, db)
	insertRows(t, db, inbox.PostgreSQL, table, "billing", "held", 99, 3*24*time.Hour)
	insertRows(t, db, inbox.PostgreSQL, table, "billing", "m", 2000, 2*24*time.Hour)
	rounds := make(chan inbox.PurgeRound, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Table: table, OlderThan: 24 * time.Hour, BatchSize: 100, DutyCycle: 1},
		OnRound: func(r inbox.PurgeRound) {
			select {
			case rounds <- r:
			default:
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	go p.Run(ctx)
	r := <-rounds
	cancel()
	if r.Err != nil || r.Deleted != 2000 || r.Pacing.Batches > 60 {
		t.Errorf("round deleted %d (err %v) in %d batches, %v in batches; want 2000 in about 20-40 batches", r.Deleted, r.Err, r.Pacing.Batches, r.Pacing.BatchTime)
	}
}

// plainTable creates a plain PostgreSQL inbox table, dropped when the test
// ends.
func plainTable(t *testing.T, db *sqlx.DB) string {
	t.Helper()
	table := "inbox_" + randomSuffix()
	t.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + table) })
	ddl, err := inbox.SchemaSQL(inbox.PostgreSQL, table)
	if err != nil {
		t.Fatal(err)
	}
	for _, stmt := range statements(ddl) {
		exec(t, db, stmt)
	}
	return table
}

type purgeResult struct {
	n   int64
	err error
}

// deleteElsewhere is another purge's batch: a transaction that deletes the
// rows of message_id 'm'||from to 'm'||to and stays open until the caller
// commits it; rolled back at cleanup if the test fails first, so that no
// transaction is left open on the shared server. It returns the
// transaction and its backend's pid.
func deleteElsewhere(t *testing.T, ctx context.Context, db *sqlx.DB, table string, from, to int) (*sqlx.Tx, int) {
	t.Helper()
	tx, err := db.BeginTxx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback() })
	var pid int
	if err := tx.Get(&pid, "SELECT pg_backend_pid()"); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec("DELETE FROM "+table+" WHERE message_id IN (SELECT 'm'||i FROM generate_series($1::int, $2::int) i)", from, to); err != nil {
		t.Fatal(err)
	}
	return tx, pid
}

// waitForPurgeBatchBlockedBy waits until the purge's DELETE on table waits on pid.
func waitForPurgeBatchBlockedBy(t *testing.T, db *sqlx.DB, table string, pid int) {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		var n int
		if err := db.Get(&n, "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'WITH batch AS (DELETE FROM ONLY%' AND query LIKE '%"+table+"%' AND $1 = ANY(pg_blocking_pids(pid))", pid); err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			return
		}
	}
	t.Fatalf("the purge never waited on pid %d", pid)
}

// A batch from the oldest row that loses part of its rows to another purge
// (a purge limited to "billing") deletes the rest and comes up short, and
// the purge goes on with the expired rows left: it counted them (fewer
// than a batch) and ended, leaving "shipping"'s, which the billing purge
// never deletes.
func TestPurgeGoesOnAfterLosingPartOfABatchToAnotherPurge(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	table := plainTable(t, db)
	// billing m1-m5 (oldest), then shipping m6-m13: 13 expired rows, each at its own instant.
	exec(t, db, "INSERT INTO "+table+" (consumer, message_id, processed_at) SELECT CASE WHEN i <= 5 THEN 'billing' ELSE 'shipping' END,"+
		" 'm'||i, now() - interval '3 days' + i * interval '1 second' FROM generate_series(1, 13) i")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	tx, pid := deleteElsewhere(t, ctx, db, table, 1, 5) // the billing purge's batch
	res := make(chan purgeResult, 1)
	go func() {
		n, err := inbox.Purge(ctx, inbox.PurgeConfig{DB: db, Table: table, OlderThan: 24 * time.Hour, BatchSize: 10, DutyCycle: 1})
		res <- purgeResult{n, err}
	}()
	waitForPurgeBatchBlockedBy(t, db, table, pid)
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	r := <-res
	left := count(t, db, table, "processed_at < now() - interval '1 day'")
	if r.err != nil || left != 0 {
		t.Errorf("whole-table purge deleted %d (err %v) and ended with %d expired shipping rows left; want all 8 shipping rows deleted", r.n, r.err, left)
	}
}

// One expired row that the DELETE keeps (a legal hold), the oldest of the
// table, does not make two batches that lost their other rows to another
// purge look like a batch of kept rows: the count of expired rows changed
// between them (all of them: a count up to ten batches stayed at its limit
// here), and the purge goes on to delete "shipping"'s rows.
func TestPurgeBesideAKeptRowGoesOnAfterLosingTwoBatchesToAnotherPurge(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	table := plainTableKeepingHeldRows(t, db)
	exec(t, db, "INSERT INTO "+table+" (consumer, message_id, processed_at) VALUES ('billing', 'held-0', now() - interval '4 days')")
	// billing m1-m18, then shipping m19-m200, all expired: more than ten batches.
	exec(t, db, "INSERT INTO "+table+" (consumer, message_id, processed_at) SELECT CASE WHEN i <= 18 THEN 'billing' ELSE 'shipping' END,"+
		" 'm'||i, now() - interval '3 days' + i * interval '1 second' FROM generate_series(1, 200) i")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	tx1, pid1 := deleteElsewhere(t, ctx, db, table, 1, 9)
	tx2, pid2 := deleteElsewhere(t, ctx, db, table, 10, 18)
	res := make(chan purgeResult, 1)
	go func() {
		n, err := inbox.Purge(ctx, inbox.PurgeConfig{DB: db, Table: table, OlderThan: 24 * time.Hour, BatchSize: 10, DutyCycle: 1})
		res <- purgeResult{n, err}
	}()
	waitForPurgeBatchBlockedBy(t, db, table, pid1)
	if err := tx1.Commit(); err != nil {
		t.Fatal(err)
	}
	waitForPurgeBatchBlockedBy(t, db, table, pid2)
	if err := tx2.Commit(); err != nil {
		t.Fatal(err)
	}
	r := <-res
	left := count(t, db, table, "consumer = 'shipping'")
	if r.err != nil || left != 0 {
		t.Errorf("whole-table purge deleted %d (err %v) and ended with %d of 182 expired shipping rows left beside one kept row; want them deleted", r.n, r.err, left)
	}
}
