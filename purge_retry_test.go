package inbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A purge batch that InnoDB picks as a deadlock victim is retried, not
// reported as a failed purge. The deadlock is made on purpose: another
// transaction that has already written a lot (so that InnoDB prefers to roll
// back the purge) holds an expired row the batch needs, waits until the
// batch is blocked on it, and then asks for a row the batch already deleted.
func TestPurgeRetriesDeadlock(t *testing.T) {
	db := testdb.OpenMySQL(t, "")
	ctx := context.Background()
	f := newFixture(t, db)
	f.newInbox(inbox.Config{})
	insertRows(t, db, inbox.MySQL, f.inbox, "billing", "old", 10, 2*time.Hour) // old-0 .. old-9
	weight := "weight_" + randomSuffix()
	exec(t, db, "CREATE TABLE "+weight+" (id INT NOT NULL PRIMARY KEY)")
	dropLater(t, db, weight)

	other, err := db.BeginTxx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Rollback() //nolint:errcheck // no-op after Commit
	var values []string
	for i := range 2000 {
		values = append(values, fmt.Sprintf("(%d)", i))
	}
	if _, err := other.ExecContext(ctx, "INSERT INTO "+weight+" VALUES "+strings.Join(values, ", ")); err != nil {
		t.Fatal(err)
	}
	lockRow := func(id string) error {
		var got string
		return other.GetContext(ctx, &got, "SELECT message_id FROM "+f.inbox+" WHERE consumer = 'billing' AND message_id = ? FOR UPDATE", id)
	}
	if err := lockRow("old-5"); err != nil {
		t.Fatal(err)
	}

	type result struct {
		n   int64
		err error
	}
	// The purge runs on a pool that records its statements' errors.
	rec := &purgeRecorder{table: f.inbox}
	purgeDB := openRecording(t, db.Driver(), testdb.MySQLDSN(), "mysql", rec)
	done := make(chan result, 1)
	go func() {
		n, err := inbox.Purge(ctx, inbox.PurgeConfig{DB: purgeDB, Table: f.inbox, OlderThan: time.Hour})
		done <- result{n, err}
	}()
	// The batch deletes by primary key in key order: old-0 .. old-4 are
	// its, and it waits for old-5. (The processlist, not
	// information_schema.innodb_lock_waits: InnoDB leaves that view empty
	// when other sessions hold many locks.)
	waitFor(t, func() bool {
		select {
		case r := <-done:
			t.Fatalf("the purge ended (%d, %v) before it waited for the locked row", r.n, r.err)
		default:
		}
		return count(t, db, "information_schema.processlist", "info LIKE ?", "DELETE FROM `"+f.inbox+"`%") > 0
	})
	otherErr := lockRow("old-2") // closes the cycle; InnoDB rolls one side back
	if otherErr != nil {
		// InnoDB rolled back this transaction instead of the purge's: the
		// scenario did not happen as planned, so it proves nothing.
		t.Skipf("InnoDB chose the other transaction as the deadlock victim (%v); the purge was not tested", otherErr)
	}
	if err := other.Commit(); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if r.err != nil || r.n != 10 {
		t.Fatalf("purge: deleted %d, err %v; want the deadlocked batch retried and 10 deleted", r.n, r.err)
	}
	if n := f.inboxRows(); n != 0 {
		t.Errorf("rows left = %d, want 0", n)
	}
	if len(rec.failures) == 0 {
		t.Skip("no deadlock happened (the purge had not locked old-2 yet); the retry was not tested")
	}
	for _, err := range rec.failures {
		if !inbox.PurgeRetryable(err) {
			t.Errorf("the batch failed with %v, want a deadlock", err)
		}
	}
	t.Logf("batch failed with %v and was retried", rec.failures)
}

// purgeRetryable tells the errors a batch may simply run again after (a
// deadlock, a lock wait timeout, a serialization failure, a busy SQLite
// database) from every other error, by the code the driver reports. Each
// error here is a real one, produced by its database.
func TestPurgeRetryableClassifiesRealErrors(t *testing.T) {
	t.Run("postgres", func(t *testing.T) {
		t.Parallel()
		db := testdb.OpenPostgres(t, "")
		table := "retry_" + randomSuffix()
		exec(t, db, "CREATE TABLE "+table+" (id INT PRIMARY KEY, v INT)")
		dropLater(t, db, table)
		exec(t, db, "INSERT INTO "+table+" VALUES (1, 0), (2, 0)")
		deadlock := pgDeadlock(t, db, table)
		serialization := pgSerializationFailure(t, db, table)
		_, dupKey := db.Exec("INSERT INTO " + table + " VALUES (1, 0)")
		_, missing := db.Exec("DELETE FROM missing_" + table)
		checkRetryable(t, map[string]error{"deadlock (40P01)": deadlock, "serialization failure (40001)": serialization},
			map[string]error{"unique violation": dupKey, "undefined table": missing})
	})
	t.Run("mysql", func(t *testing.T) {
		t.Parallel()
		db := testdb.OpenMySQL(t, "")
		table := "retry_" + randomSuffix()
		exec(t, db, "CREATE TABLE "+table+" (id INT PRIMARY KEY, v INT) ENGINE=InnoDB")
		dropLater(t, db, table)
		exec(t, db, "INSERT INTO "+table+" VALUES (1, 0), (2, 0)")
		deadlock := mysqlDeadlock(t, db, table)
		timeout := mysqlLockWaitTimeout(t, db, table)
		_, dupKey := db.Exec("INSERT INTO " + table + " VALUES (1, 0)")
		_, missing := db.Exec("DELETE FROM missing_" + table)
		checkRetryable(t, map[string]error{"deadlock (1213)": deadlock, "lock wait timeout (1205)": timeout},
			map[string]error{"duplicate key": dupKey, "missing table": missing})
	})
	t.Run("sqlite", func(t *testing.T) {
		t.Parallel()
		path := filepath.Join(t.TempDir(), "busy.db")
		db := openSQLite(t, path)
		exec(t, db, "CREATE TABLE t (id INTEGER PRIMARY KEY)")
		holder, err := db.Beginx() // _txlock=immediate: holds the write lock
		if err != nil {
			t.Fatal(err)
		}
		defer holder.Rollback() //nolint:errcheck // test cleanup
		impatient, err := sqlx.Open("sqlite", "file:"+path+"?_journal_mode=WAL&_busy_timeout=0")
		if err != nil {
			t.Fatal(err)
		}
		defer impatient.Close()
		_, busy := impatient.Exec("INSERT INTO t VALUES (1)")
		_, missing := impatient.Exec("DELETE FROM missing")
		checkRetryable(t, map[string]error{"SQLITE_BUSY": busy}, map[string]error{"no such table": missing})
	})
	t.Run("other", func(t *testing.T) {
		checkRetryable(t, nil, map[string]error{
			"nil": nil, "context canceled": context.Canceled, "deadline": context.DeadlineExceeded,
			"sql.ErrConnDone": sql.ErrConnDone, "plain": errors.New("deadlock"),
		})
	})
}

func checkRetryable(t *testing.T, retry, fail map[string]error) {
	t.Helper()
	for name, err := range retry {
		if err == nil {
			t.Errorf("%s: the database produced no error", name)
			continue
		}
		wrapped := fmt.Errorf("inbox: purge x: delete batch: %w", errors.Join(errors.New("other"), err))
		if !inbox.PurgeRetryable(err) || !inbox.PurgeRetryable(wrapped) {
			t.Errorf("%s (%T: %v): not retryable, want retryable (also wrapped)", name, err, err)
		}
	}
	for name, err := range fail {
		if name != "nil" && err == nil {
			t.Errorf("%s: the database produced no error", name)
			continue
		}
		if inbox.PurgeRetryable(err) {
			t.Errorf("%s (%T: %v): retryable, want not", name, err, err)
		}
	}
}

// crossLock runs two transactions that lock rows 1 and 2 in opposite orders
// and returns the error of the one the database rolled back.
func crossLock(t *testing.T, db *sqlx.DB, opts *sql.TxOptions, lock func(tx *sqlx.Tx, id int) error) error {
	t.Helper()
	ctx := context.Background()
	a, err := db.BeginTxx(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Rollback() //nolint:errcheck // test cleanup
	b, err := db.BeginTxx(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Rollback() //nolint:errcheck // test cleanup
	if err := lock(a, 1); err != nil {
		t.Fatal(err)
	}
	if err := lock(b, 2); err != nil {
		t.Fatal(err)
	}
	errs := make(chan error, 2)
	go func() {
		err := lock(a, 2)
		if err != nil {
			a.Rollback() //nolint:errcheck // release b
		}
		errs <- err
	}()
	err = lock(b, 1)
	if err != nil {
		b.Rollback() //nolint:errcheck // release a
	}
	errs <- err
	for range 2 {
		if err := <-errs; err != nil {
			return err
		}
	}
	return nil
}

func pgDeadlock(t *testing.T, db *sqlx.DB, table string) error {
	return crossLock(t, db, nil, func(tx *sqlx.Tx, id int) error {
		_, err := tx.Exec("UPDATE "+table+" SET v = v + 1 WHERE id = $1", id)
		return err
	})
}

// pgSerializationFailure updates a row at REPEATABLE READ after another
// transaction changed it since the snapshot.
func pgSerializationFailure(t *testing.T, db *sqlx.DB, table string) error {
	t.Helper()
	tx, err := db.BeginTxx(context.Background(), &sql.TxOptions{Isolation: sql.LevelRepeatableRead})
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback() //nolint:errcheck // test cleanup
	var v int
	if err := tx.Get(&v, "SELECT v FROM "+table+" WHERE id = 1"); err != nil { // takes the snapshot
		t.Fatal(err)
	}
	exec(t, db, "UPDATE "+table+" SET v = v + 1 WHERE id = 1")
	_, err = tx.Exec("UPDATE " + table + " SET v = v + 1 WHERE id = 1")
	return err
}

func mysqlDeadlock(t *testing.T, db *sqlx.DB, table string) error {
	return crossLock(t, db, nil, func(tx *sqlx.Tx, id int) error {
		_, err := tx.Exec("UPDATE "+table+" SET v = v + 1 WHERE id = ?", id)
		return err
	})
}

func mysqlLockWaitTimeout(t *testing.T, db *sqlx.DB, table string) error {
	t.Helper()
	ctx := context.Background()
	holder, err := db.BeginTxx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback() //nolint:errcheck // test cleanup
	if _, err := holder.Exec("UPDATE "+table+" SET v = v + 1 WHERE id = ?", 2); err != nil {
		t.Fatal(err)
	}
	conn, err := db.Connx(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.ExecContext(ctx, "SET SESSION innodb_lock_wait_timeout = 1"); err != nil {
		t.Fatal(err)
	}
	defer conn.ExecContext(ctx, "SET SESSION innodb_lock_wait_timeout = DEFAULT") //nolint:errcheck // best effort
	_, err = conn.ExecContext(ctx, "UPDATE "+table+" SET v = v + 1 WHERE id = ?", 2)
	return err
}
