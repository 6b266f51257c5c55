package inbox_test

import (
	"context"
	"database/sql"
	"strings"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// A purge whose batch loses its rows to another transaction that deletes
// them (another purge, run without the Purger's lock) goes on with the rows
// still expired instead of taking the short batch for the end: the first
// batch's 1,000 oldest rows are deleted by an open transaction that the
// purge's batch waits for, and once it commits, the purge still deletes
// the other 1,500 expired rows and only those. PostgreSQL and MySQL/MariaDB
// (SQLite runs one writer at a time: there a batch never meets another's
// deletes).
func TestPurgeGoesOnAfterLosingABatchToAnotherPurge(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if tdb.Dialect == inbox.SQLite {
			t.Skip("SQLite serialises writers")
		}
		ctx := context.Background()
		f := newFixture(t, db)
		f.newInbox(inbox.Config{})
		insertRows(t, db, tdb.Dialect, f.inbox, "billing", "first", 1000, 3*time.Hour)
		insertRows(t, db, tdb.Dialect, f.inbox, "billing", "rest", 1500, 2*time.Hour)
		insertRows(t, db, tdb.Dialect, f.inbox, "billing", "recent", 40, 30*time.Minute)

		// The other purge: the 1,000 oldest rows, deleted and not committed.
		other, err := db.BeginTxx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
		if err != nil {
			t.Fatal(err)
		}
		defer other.Rollback() //nolint:errcheck // committed below
		if _, err := other.ExecContext(ctx, db.Rebind("DELETE FROM "+f.inbox+" WHERE consumer = ? AND message_id LIKE ?"), "billing", "first-%"); err != nil {
			t.Fatal(err)
		}

		type result struct {
			deleted int64
			err     error
		}
		done := make(chan result, 1)
		go func() {
			n, err := inbox.Purge(ctx, inbox.PurgeConfig{DB: db, Table: f.inbox, OlderThan: time.Hour, BatchSize: 1000, DutyCycle: 1})
			done <- result{n, err}
		}()
		// The purge's first batch chose the same 1,000 rows and waits for
		// their deletes to end.
		waitForPurgeLockWait(t, db, tdb.Dialect, f.inbox)
		if err := other.Commit(); err != nil {
			t.Fatal(err)
		}
		r := <-done
		if r.err != nil || r.deleted != 1500 {
			t.Fatalf("purge: deleted %d, err %v; want the 1500 rows the other purge left, nil", r.deleted, r.err)
		}
		if n := count(t, db, f.inbox, "message_id LIKE ?", "rest-%"); n != 0 {
			t.Errorf("%d expired rows left, want 0", n)
		}
		if n := f.inboxRows(); n != 40 {
			t.Errorf("rows left = %d, want the 40 recent ones", n)
		}
	})
}

// waitForPurgeLockWait waits until a purge statement on table waits for a
// row lock. On MySQL/MariaDB it reads SHOW ENGINE INNODB STATUS, not
// information_schema.INNODB_TRX, a cache that InnoDB refreshes only when
// nobody (no other test either) read it in the last 100 ms.
func waitForPurgeLockWait(t *testing.T, db *sqlx.DB, d inbox.Dialect, table string) {
	t.Helper()
	ctx := context.Background()
	deadline := time.Now().Add(30 * time.Second)
	for {
		n := 0
		if d == inbox.MySQL {
			trxs, err := innodbTransactions(ctx, db)
			if err != nil {
				t.Fatal(err)
			}
			for _, x := range trxs {
				if x.lockWait && strings.Contains(x.text, "DELETE FROM `"+table+"`") {
					n++
				}
			}
		} else if err := db.GetContext(ctx, &n, `SELECT count(*) FROM pg_stat_activity
			WHERE wait_event_type = 'Lock' AND query LIKE '%DELETE FROM %' || $1 || '%'`, table); err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the purge never waited for the other purge's deletes")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// The purge's batches commit asynchronously, for their own transaction
// only: the pooled connection they ran on keeps the server's
// synchronous_commit for the next user (a handler's commit must wait for
// its WAL). One connection, so the next statement runs where the purge did.
func TestPurgeLeavesSynchronousCommitAsItWas(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if tdb.Dialect != inbox.PostgreSQL {
			t.Skip("a PostgreSQL setting")
		}
		db.SetMaxOpenConns(1)
		f := newFixture(t, db)
		f.newInbox(inbox.Config{})
		insertRows(t, db, tdb.Dialect, f.inbox, "billing", "old", 250, 2*time.Hour)
		var before string
		if err := db.Get(&before, "SHOW synchronous_commit"); err != nil {
			t.Fatal(err)
		}
		n, err := inbox.Purge(context.Background(), inbox.PurgeConfig{DB: db, Table: f.inbox, OlderThan: time.Hour, BatchSize: 100})
		if err != nil || n != 250 {
			t.Fatalf("purge: deleted %d, err %v; want 250, nil", n, err)
		}
		var after string
		if err := db.Get(&after, "SHOW synchronous_commit"); err != nil {
			t.Fatal(err)
		}
		if after != before {
			t.Errorf("synchronous_commit after the purge = %q, want %q as before", after, before)
		}
	})
}
