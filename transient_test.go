package inbox_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/go-sql-driver/mysql"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// TestIsTransient classifies real errors produced by the real servers, so a
// driver that changes its error types breaks this test rather than a user's
// poison queue.
func TestIsTransient(t *testing.T) {
	t.Parallel()
	t.Run("plain", func(t *testing.T) {
		t.Parallel()
		for _, tc := range []struct {
			err  error
			want bool
		}{
			{nil, false},
			{errors.New("boom"), false},
			{inbox.ErrInvalidMessageID, false},
			{fmt.Errorf("inbox: claim: %w", context.DeadlineExceeded), true},
			{errors.Join(errors.New("x"), context.Canceled), true},
			{fmt.Errorf("inbox: commit a/b: %w", inbox.ErrTxRolledBack), true},
		} {
			if got := inbox.IsTransient(tc.err); got != tc.want {
				t.Errorf("IsTransient(%v) = %v, want %v", tc.err, got, tc.want)
			}
		}
	})
	t.Run("postgres", func(t *testing.T) {
		t.Parallel()
		db := testdb.OpenPostgres(t, "")
		table := "transient_" + testdb.RandomSuffix()
		exec(t, db, `CREATE TABLE `+table+` (id int PRIMARY KEY, v int)`)
		testdb.DropLater(t, db, table)
		exec(t, db, `INSERT INTO `+table+` VALUES (1, 0), (2, 0)`)

		wantTransient(t, "serialization failure (40001)", serializationFailure(t, db, table), true)
		wantTransient(t, "deadlock (40P01)", deadlock(t, db,
			`UPDATE `+table+` SET v = v + 1 WHERE id = 1`, `UPDATE `+table+` SET v = v + 1 WHERE id = 2`,
			`UPDATE `+table+` SET v = v + 1 WHERE id = 2`, `UPDATE `+table+` SET v = v + 1 WHERE id = 1`), true)

		ctx := context.Background()
		conn, err := db.Connx(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		if _, err := conn.ExecContext(ctx, `SET statement_timeout = '50ms'`); err != nil {
			t.Fatal(err)
		}
		_, err = conn.ExecContext(ctx, `SELECT pg_sleep(2)`)
		wantTransient(t, "statement timeout (57014)", err, true)
		if _, err := conn.ExecContext(ctx, `RESET statement_timeout`); err != nil {
			t.Fatal(err)
		}

		_, err = db.Exec(`INSERT INTO ` + table + ` VALUES (1, 0)`)
		wantTransient(t, "unique violation (23505)", err, false)
		_, err = db.Exec(`SELEC 1`)
		wantTransient(t, "syntax error", err, false)

		// A transaction whose backend was terminated: the next statement
		// gets 57P01 and pgx closes the connection; a COMMIT after that
		// fails in pgx before anything is sent ("conn closed").
		tx, err := db.BeginTxx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		var pid int
		if err := tx.Get(&pid, `SELECT pg_backend_pid()`); err != nil {
			t.Fatal(err)
		}
		var killed bool
		if err := db.Get(&killed, `SELECT pg_terminate_backend($1)`, pid); err != nil || !killed {
			t.Fatalf("pg_terminate_backend(%d) = %v, %v", pid, killed, err)
		}
		waitFor(t, func() bool { // until the backend is gone
			var n int
			if err := db.Get(&n, `SELECT count(*) FROM pg_stat_activity WHERE pid = $1`, pid); err != nil {
				t.Fatal(err)
			}
			return n == 0
		})
		_, err = tx.Exec(`SELECT 1`)
		wantTransient(t, "terminated backend (57P01)", err, true)
		wantTransient(t, "commit on the closed connection (conn closed)", tx.Commit(), true)
	})
	t.Run("mysql", func(t *testing.T) {
		t.Parallel()
		db := testdb.OpenMySQL(t, "")
		table := "transient_" + testdb.RandomSuffix()
		exec(t, db, `CREATE TABLE `+table+` (id int PRIMARY KEY, v int) ENGINE=InnoDB`)
		testdb.DropLater(t, db, table)
		exec(t, db, `INSERT INTO `+table+` VALUES (1, 0), (2, 0)`)

		wantTransient(t, "deadlock (1213)", deadlock(t, db,
			`UPDATE `+table+` SET v = v + 1 WHERE id = 1`, `UPDATE `+table+` SET v = v + 1 WHERE id = 2`,
			`UPDATE `+table+` SET v = v + 1 WHERE id = 2`, `UPDATE `+table+` SET v = v + 1 WHERE id = 1`), true)

		// Lock wait timeout (1205): hold a row lock, wait for it for 1 s.
		ctx := context.Background()
		holder, err := db.BeginTxx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer holder.Rollback()
		if _, err := holder.Exec(`UPDATE ` + table + ` SET v = v + 1 WHERE id = 1`); err != nil {
			t.Fatal(err)
		}
		waiter, err := db.BeginTxx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer waiter.Rollback()
		if _, err := waiter.Exec(`SET SESSION innodb_lock_wait_timeout = 1`); err != nil {
			t.Fatal(err)
		}
		_, err = waiter.Exec(`UPDATE ` + table + ` SET v = v + 1 WHERE id = 1`)
		wantTransient(t, "lock wait timeout (1205)", err, true)
		_ = waiter.Rollback()
		_ = holder.Rollback()

		_, err = db.Exec(`INSERT INTO ` + table + ` VALUES (1, 0)`)
		wantTransient(t, "duplicate key (1062)", err, false)

		// MariaDB's write-write conflict at REPEATABLE READ (1020), with
		// innodb_snapshot_isolation=ON, the default from MariaDB 11.6.
		var snapshotIsolation int
		if err := db.Get(&snapshotIsolation, `SELECT COUNT(*) FROM information_schema.SYSTEM_VARIABLES
			WHERE VARIABLE_NAME = 'INNODB_SNAPSHOT_ISOLATION'`); err != nil || snapshotIsolation == 0 {
			t.Logf("no innodb_snapshot_isolation (%v): 1020 not produced", err)
			return
		}
		si := testdb.OpenMySQL(t, "innodb_snapshot_isolation=ON")
		wantTransient(t, "record changed since last read (1020)", serializationFailure(t, si, table), true)
	})
	t.Run("mysql codes", func(t *testing.T) {
		t.Parallel()
		// MySQL Group Replication rolls back, at COMMIT, a transaction that
		// conflicts with one certified on another member; not producible
		// here, so the driver's error value is built as the driver builds it.
		wantTransient(t, "group replication conflict (3101)", &mysql.MySQLError{Number: 3101,
			SQLState: [5]byte{'4', '0', '0', '0', '0'}, Message: "Plugin instructed the server to rollback the current transaction."}, true)
	})
	t.Run("sqlite", func(t *testing.T) {
		t.Parallel()
		path := filepath.Join(t.TempDir(), "busy.db")
		db := testdb.OpenSQLite(t, path)
		exec(t, db, `CREATE TABLE t (id INTEGER PRIMARY KEY)`)
		// A second pool without busy_timeout gets SQLITE_BUSY at once
		// while the first holds the write lock.
		other, err := sqlx.Open("sqlite", "file:"+path+"?_txlock=immediate")
		if err != nil {
			t.Fatal(err)
		}
		defer other.Close()
		tx, err := db.Beginx()
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		_, err = other.Beginx()
		wantTransient(t, "SQLITE_BUSY", err, true)
		_ = tx.Rollback()

		exec(t, db, `INSERT INTO t VALUES (1)`)
		_, err = db.Exec(`INSERT INTO t VALUES (1)`)
		wantTransient(t, "SQLITE_CONSTRAINT", err, false)
	})
}

func wantTransient(t *testing.T, what string, err error, want bool) {
	t.Helper()
	if err == nil {
		t.Errorf("%s: no error was produced", what)
		return
	}
	if got := inbox.IsTransient(err); got != want {
		t.Errorf("%s: IsTransient(%T %v) = %v, want %v", what, err, err, got, want)
	}
	// Wrapped as the middleware wraps it, the answer is the same.
	if got := inbox.IsTransient(fmt.Errorf("inbox: commit a/b: %w", err)); got != want {
		t.Errorf("%s (wrapped): IsTransient = %v, want %v", what, got, want)
	}
}

var sqlTxRepeatableRead = sql.TxOptions{Isolation: sql.LevelRepeatableRead}

// serializationFailure makes PostgreSQL report 40001: two REPEATABLE READ
// transactions update the same row; the second fails once the first commits.
func serializationFailure(t *testing.T, db *sqlx.DB, table string) error {
	t.Helper()
	ctx := context.Background()
	first, err := db.BeginTxx(ctx, &sqlTxRepeatableRead)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Rollback()
	second, err := db.BeginTxx(ctx, &sqlTxRepeatableRead)
	if err != nil {
		t.Fatal(err)
	}
	defer second.Rollback()
	var v int
	if err := second.Get(&v, `SELECT v FROM `+table+` WHERE id = 1`); err != nil { // takes the snapshot
		t.Fatal(err)
	}
	if _, err := first.Exec(`UPDATE ` + table + ` SET v = v + 1 WHERE id = 1`); err != nil {
		t.Fatal(err)
	}
	if err := first.Commit(); err != nil {
		t.Fatal(err)
	}
	_, err = second.Exec(`UPDATE ` + table + ` SET v = v + 1 WHERE id = 1`)
	return err
}

// deadlock runs a1 then b1 in two transactions, then a2 and b2 at once,
// which lock in opposite orders; the database aborts one with a deadlock
// error, which is returned.
func deadlock(t *testing.T, db *sqlx.DB, a1, b1, a2, b2 string) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	a, err := db.BeginTxx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Rollback()
	b, err := db.BeginTxx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Rollback()
	if _, err := a.Exec(a1); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Exec(b1); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make([]error, 2)
	wg.Add(2)
	go func() {
		defer wg.Done()
		_, errs[0] = a.Exec(a2)
		if errs[0] != nil {
			_ = a.Rollback()
		}
	}()
	go func() {
		defer wg.Done()
		_, errs[1] = b.Exec(b2)
		if errs[1] != nil {
			_ = b.Rollback()
		}
	}()
	wg.Wait()
	return errors.Join(errs...)
}

// A BEGIN that fails without a MySQL error number because every connection
// fails to set up (here TLS, which the test server does not offer) is a
// misconfiguration: not transient, so a poison queue built on IsTransient
// takes the message instead of nacking it forever. (A BEGIN whose
// connection was lost is retried once by the middleware; the retry's error
// classifies itself: TestLostConnection_ServerRestartLosesNoMessage.)
func TestBeginMisconfigurationIsNotTransient(t *testing.T) {
	t.Parallel()
	probe := testdb.OpenMySQL(t, "")
	var ssl string
	if err := probe.Get(&ssl, "SELECT @@have_ssl"); err != nil || ssl == "YES" {
		t.Skipf("needs a MySQL server without TLS (have_ssl = %q, %v)", ssl, err)
	}
	f := newFixture(t, probe)
	f.newInbox(inbox.Config{Consumer: "billing"}) // creates the table
	handle := func(ib *inbox.Inbox) (int, error) {
		calls := 0
		_, err := ib.Middleware(func(*message.Message) ([]*message.Message, error) { calls++; return nil, nil })(message.NewMessage(watermill.NewUUID(), nil))
		return calls, err
	}

	// Misconfigured from the start: the table check before the first claim
	// reports it.
	db, err := sqlx.Open("mysql", testdb.WithParam(testdb.MySQLDSN(), "tls=true"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	ib, err := inbox.New(inbox.Config{DB: db, Table: f.inbox, Consumer: "billing"})
	if err != nil {
		t.Fatal(err)
	}
	calls, err := handle(ib)
	if err == nil || inbox.IsTransient(err) || calls != 0 {
		t.Errorf("misconfigured from the start: %d handler calls, error %v (transient %v); want 0 calls and an error that is not transient",
			calls, err, inbox.IsTransient(err))
	}

	// Misconfigured after the table was verified (a certificate rotated, a
	// new TLS setting): the BEGIN fails, is retried once, and a ping that
	// fails the same way makes it not transient.
	plainCfg, err := mysql.ParseDSN(testdb.MySQLDSN())
	if err != nil {
		t.Fatal(err)
	}
	tlsCfg := plainCfg.Clone()
	tlsCfg.TLSConfig = "true" // applied by the ParseDSN of its FormatDSN below
	sw := &switchingConnector{}
	if sw.plain, err = mysql.NewConnector(plainCfg); err != nil {
		t.Fatal(err)
	}
	if sw.tls, err = mysql.NewConnector(mustParseDSN(t, tlsCfg.FormatDSN())); err != nil {
		t.Fatal(err)
	}
	switching := sqlx.NewDb(sql.OpenDB(sw), "mysql")
	defer switching.Close()
	switching.SetMaxIdleConns(0) // every statement opens a connection of its own
	ib, err = inbox.New(inbox.Config{DB: switching, Table: f.inbox, Consumer: "billing"})
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.Verify(context.Background()); err != nil {
		t.Fatal(err)
	}
	sw.useTLS.Store(true)
	calls, err = handle(ib)
	if err == nil || !strings.Contains(err.Error(), "inbox: begin transaction") {
		t.Fatalf("got %v, want the BEGIN's error", err)
	}
	if inbox.IsTransient(err) {
		t.Errorf("IsTransient(%v) = true: a misconfiguration would be nacked forever", err)
	}
	if calls != 0 {
		t.Errorf("handler calls = %d, want 0", calls)
	}
}

// switchingConnector opens plain connections until useTLS is set, then
// connections that require TLS.
type switchingConnector struct {
	plain, tls driver.Connector
	useTLS     atomic.Bool
}

func (c *switchingConnector) Connect(ctx context.Context) (driver.Conn, error) {
	if c.useTLS.Load() {
		return c.tls.Connect(ctx)
	}
	return c.plain.Connect(ctx)
}
func (c *switchingConnector) Driver() driver.Driver { return c.plain.Driver() }

func mustParseDSN(t *testing.T, dsn string) *mysql.Config {
	t.Helper()
	cfg, err := mysql.ParseDSN(dsn)
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}
