package inbox_test

import (
	"bytes"
	"context"
	"database/sql"
	"database/sql/driver"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/puddle/v2"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// TestIsTransient classifies real errors produced by the real servers, so a
// driver that changes its error types breaks this test rather than a user's
// poison queue. An error of the message's content is not transient (the
// poison queue takes the message); a lost connection or an interrupted
// statement is (the message is nacked and redelivered).
func TestIsTransient_Plain(t *testing.T) {
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
		// A handler bug stays one whatever joins it.
		{fmt.Errorf("inbox: commit a/b: %w", inbox.ErrTransactionEnded), false},
		{errors.Join(fmt.Errorf("inbox: commit a/b: %w", inbox.ErrTransactionEnded), context.Canceled), false},
		// Shutdown.
		{fmt.Errorf("inbox: begin transaction for a/b: %w", puddle.ErrClosedPool), true},
		{fmt.Errorf("inbox: begin transaction for a/b: %w", sql.ErrConnDone), true},
	} {
		if got := inbox.IsTransient(tc.err); got != tc.want {
			t.Errorf("IsTransient(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
}

// IsTransient on PostgreSQL errors made by the server: a terminated backend, a
// statement timeout, a serialization failure, and what pgx reports after them.
func TestIsTransient_PostgreSQL(t *testing.T) {
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
}

// IsTransient on MySQL/MariaDB errors made by the server: a lock wait timeout
// (1205), a deadlock, a write-write conflict (1020).
func TestIsTransient_MySQL(t *testing.T) {
	t.Parallel()
	db := testdb.OpenMySQL(t, "")
	table := innodbTable(t, db, "transient_", `(1, 0), (2, 0)`)

	wantTransient(t, "deadlock (1213)", deadlock(t, db,
		`UPDATE `+table+` SET v = v + 1 WHERE id = 1`, `UPDATE `+table+` SET v = v + 1 WHERE id = 2`,
		`UPDATE `+table+` SET v = v + 1 WHERE id = 2`, `UPDATE `+table+` SET v = v + 1 WHERE id = 1`), true)

	// Lock wait timeout (1205): hold a row lock, wait for it for 1 s.
	ctx := context.Background()
	holder := holdRowLock(ctx, t, db, table)
	waiter := beginTx(ctx, t, db)
	if _, err := waiter.Exec(`SET SESSION innodb_lock_wait_timeout = 1`); err != nil {
		t.Fatal(err)
	}
	_, err := waiter.Exec(`UPDATE ` + table + ` SET v = v + 1 WHERE id = 1`)
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
}

// IsTransient on MySQL errors this server cannot produce, built as the driver
// builds them (Group Replication's rollback at COMMIT).
func TestIsTransient_MySQLCodes(t *testing.T) {
	t.Parallel()
	// MySQL Group Replication rolls back, at COMMIT, a transaction that
	// conflicts with one certified on another member; not producible
	// here, so the driver's error value is built as the driver builds it.
	wantTransient(t, "group replication conflict (3101)", &mysql.MySQLError{Number: 3101,
		SQLState: [5]byte{'4', '0', '0', '0', '0'}, Message: "Plugin instructed the server to rollback the current transaction."}, true)
	// A server out of disk or memory: its state, not the message's, so a
	// poison filter keeps the topic through the outage.
	for n, msg := range map[uint16]string{1021: "Disk full", 1041: "Out of memory", 1114: "The table 't' is full"} {
		wantTransient(t, msg, &mysql.MySQLError{Number: n, Message: msg}, true)
	}
}

// IsTransient on PostgreSQL's errors of a server out of a resource, which
// this server cannot be made to give: built as pgx builds them. Not
// transient, an outage (a full disk) poisoned every message of a topic.
// 53200 stays the message's: a handler that takes too many locks gets it
// on every try.
func TestIsTransient_PostgreSQLOutOfResources(t *testing.T) {
	t.Parallel()
	for _, code := range []string{"53000", "53100", "58030"} {
		wantTransient(t, "SQLSTATE "+code, &pgconn.PgError{Code: code, Message: "out of a resource"}, true)
	}
	// What a transaction that takes more locks than max_locks_per_transaction
	// allows gets on every try: the message's own doing.
	wantTransient(t, "out of shared memory (53200)", &pgconn.PgError{Code: "53200", Message: "out of shared memory"}, false)
	wantTransient(t, "check_violation", &pgconn.PgError{Code: "23514", ConstraintName: "amount_positive"}, false)
}

// IsTransient on SQLite's busy error, from a second pool without busy_timeout
// while the first holds the write lock.
func TestIsTransient_SQLite(t *testing.T) {
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

	// A database file at its size limit (the disk full, max_page_count).
	full := testdb.OpenSQLite(t, filepath.Join(t.TempDir(), "full.db"))
	full.SetMaxOpenConns(1)
	exec(t, full, `CREATE TABLE big (v BLOB)`)
	var pages int
	if err := full.Get(&pages, `PRAGMA page_count`); err != nil {
		t.Fatal(err)
	}
	exec(t, full, fmt.Sprintf(`PRAGMA max_page_count = %d`, pages+2))
	for range 10 {
		if _, err = full.Exec(`INSERT INTO big VALUES (zeroblob(8192))`); err != nil {
			break
		}
	}
	wantTransient(t, "SQLITE_FULL", err, true)
}

// KILL QUERY (an operator, pt-kill, a proxy's query timeout) interrupts a
// statement with MySQL error 1317 (ER_QUERY_INTERRUPTED). It is MySQL's
// pg_cancel_backend, transient like PostgreSQL's 57014: nothing about the
// message, the redelivery succeeds.
func TestIsTransient_MySQLQueryKilled(t *testing.T) {
	t.Parallel()
	db := testdb.OpenMySQL(t, "")
	table := innodbTable(t, db, "killquery_", `(1, 0)`)
	ctx, cancel := context.WithTimeout(context.Background(), caseTimeout)
	defer cancel()

	holdRowLock(ctx, t, db, table)
	victim := beginTx(ctx, t, db)
	var id int
	if err := victim.Get(&id, `SELECT CONNECTION_ID()`); err != nil {
		t.Fatal(err)
	}
	go func() {
		for ctx.Err() == nil { // until the victim waits for the row lock
			var n int
			_ = db.GetContext(ctx, &n, `SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = ? AND INFO LIKE 'UPDATE%'`, id)
			if n == 1 {
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
		_, _ = db.ExecContext(ctx, `KILL QUERY `+fmt.Sprint(id))
	}()
	_, err := victim.Exec(`UPDATE ` + table + ` SET v = v + 1 WHERE id = 1`)
	wantTransient(t, "KILL QUERY (1317)", err, true)
}

// The MySQL server closes the handler's connection (a restart, a
// failover, KILL, wait_timeout): the handler's next statement and the
// inbox's ROLLBACK fail with go-sql-driver's plain "invalid connection"
// (mysql.ErrInvalidConn). Nothing was committed, so the message is a
// transient nack that the poison queue lets through, and the redelivery
// succeeds.
func TestIsTransient_MySQLConnectionKilledInTheHandler(t *testing.T) {
	t.Parallel()
	db := testdb.OpenMySQL(t, "")
	f := newFixture(t, db)
	ib := f.newInbox(inbox.Config{})
	poison, sink := poisonUnlessTransient(t)
	out := &outcomes{}
	in := newFeed()
	defer in.Close()
	var kill atomic.Bool
	kill.Store(true)
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(poison, out.Middleware, ib.Middleware)
		r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
			if kill.Load() {
				tx, _ := inbox.TxFromContext(msg.Context())
				var id int
				if err := tx.GetContext(msg.Context(), &id, `SELECT CONNECTION_ID()`); err != nil {
					return err
				}
				if _, err := db.ExecContext(msg.Context(), `KILL `+fmt.Sprint(id)); err != nil {
					return err
				}
			}
			return f.writeBusinessRow(msg)
		})
	})
	ctx, cancel := context.WithTimeout(context.Background(), caseTimeout)
	defer cancel()
	msg := message.NewMessage(watermill.NewUUID(), nil)
	acked, err := in.send(ctx, delivery(msg, "first"))
	if err != nil {
		t.Fatal(err)
	}
	first := out.last("first")
	if acked || len(sink.poisoned()) != 0 || !inbox.IsTransient(first) {
		t.Fatalf("connection killed: acked %v, poisoned %d, error %v (IsTransient %v); want a nack, nothing poisoned, a transient error",
			acked, len(sink.poisoned()), first, inbox.IsTransient(first))
	}
	kill.Store(false)
	if acked, err := in.send(ctx, delivery(msg, "redelivery")); err != nil || !acked {
		t.Fatalf("redelivery: acked %v (%v), error %v", acked, err, out.last("redelivery"))
	}
	if f.businessRows() != 1 || f.inboxRows() != 1 {
		t.Errorf("business rows %d, inbox rows %d, want 1 and 1", f.businessRows(), f.inboxRows())
	}
}

// The net package's parse and address errors (url.Parse, net.ParseCIDR,
// net.SplitHostPort) implement net.Error, but they are errors of the
// message's content: a redelivery fails the same way. They are not
// transient, so the poison queue takes such a message instead of a
// redelivery for ever. Real network failures are transient.
func TestIsTransient_ErrorsOfTheMessageContent(t *testing.T) {
	t.Parallel()
	//lint:ignore SA1007 the invalid URL is this case's input: the *url.Error it gives is what IsTransient must refuse
	_, urlErr := url.Parse("http://[::1")
	_, _, cidrErr := net.ParseCIDR("10.0.0.0/99")
	_, _, addrErr := net.SplitHostPort("billing.example")
	_, ipErr := net.ResolveIPAddr("ip", "256.1.1.1:80")
	for _, err := range []error{urlErr, cidrErr, addrErr, ipErr} {
		if err == nil {
			t.Fatal("no error produced")
		}
		if inbox.IsTransient(err) || inbox.IsTransient(fmt.Errorf("handler: %w", err)) {
			t.Errorf("IsTransient(%T %v) = true, want false: the message's content is wrong", err, err)
		}
	}

	// Network failures are still transient.
	_, dialErr := net.DialTimeout("tcp", "127.0.0.1:1", time.Second)
	client := &http.Client{Timeout: time.Nanosecond}
	_, httpErr := client.Get("http://127.0.0.1:1/")
	for _, err := range []error{dialErr, httpErr} {
		if err == nil {
			t.Fatal("no error produced")
		}
		if !inbox.IsTransient(fmt.Errorf("handler: %w", err)) {
			t.Errorf("IsTransient(%T %v) = false, want true", err, err)
		}
	}

	// Through a router with the README's poison queue: the message with the
	// bad URL goes to the poison topic (acked), not back to the broker.
	db := openSQLite(t, "")
	f := newFixture(t, db)
	ib := f.newInbox(inbox.Config{})
	poison, sink := poisonUnlessTransient(t)
	in := newFeed()
	defer in.Close()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(poison, ib.Middleware)
		r.AddConsumerHandler("webhooks", "events", in, func(msg *message.Message) error {
			if _, err := url.Parse(string(msg.Payload)); err != nil {
				return fmt.Errorf("webhook target: %w", err)
			}
			return f.writeBusinessRow(msg)
		})
	})
	ctx, cancel := context.WithTimeout(context.Background(), caseTimeout)
	defer cancel()
	msg := message.NewMessage(watermill.NewUUID(), []byte("http://[::1"))
	acked, err := in.send(ctx, delivery(msg, "first"))
	if err != nil {
		t.Fatal(err)
	}
	if !acked || len(sink.poisoned()) != 1 {
		t.Errorf("acked %v, poisoned %d: want the message in the poison queue, not redelivered forever", acked, len(sink.poisoned()))
	}
}

// io.ErrUnexpectedEOF is what json.Decoder and binary.Read return for a
// truncated payload, an error of the message that no redelivery fixes:
// not transient, even as a bare value. (A connection lost in a message's
// transaction is transient by its failed ROLLBACK, driver.ErrBadConn or
// the driver's own error.)
func TestIsTransient_TruncatedPayload(t *testing.T) {
	t.Parallel()
	var order map[string]any
	jsonErr := json.NewDecoder(bytes.NewReader([]byte(`{"order": 4`))).Decode(&order)
	var amount uint64
	binErr := binary.Read(bytes.NewReader([]byte{0, 1, 2}), binary.BigEndian, &amount)
	for _, err := range []error{jsonErr, binErr} {
		if err == nil {
			t.Fatal("no error produced")
		}
		if inbox.IsTransient(fmt.Errorf("decode order: %w", err)) {
			t.Errorf("IsTransient(%T %v) = true, want false: the payload is truncated", err, err)
		}
	}
}

// A typed nil pointer in the chain (the classic "var pe *pgconn.PgError;
// return pe") is not transient, and IsTransient does not panic on it: it
// runs inside the poison queue's filter, where a panic would turn every
// message into a panic.
func TestIsTransient_TypedNilInTheChain(t *testing.T) {
	t.Parallel()
	for _, err := range []error{
		(*sqlStateError)(nil),
		fmt.Errorf("claim: %w", (*sqlStateError)(nil)),
		errors.Join(errors.New("x"), (*sqlStateError)(nil)),
		(*retryError)(nil),
		fmt.Errorf("commit: %w", (*retryError)(nil)),
	} {
		func() {
			defer func() {
				if r := recover(); r != nil {
					t.Errorf("IsTransient(%#v) panicked: %v", err, r)
				}
			}()
			if inbox.IsTransient(err) {
				t.Errorf("IsTransient(%#v) = true, want false", err)
			}
		}()
	}
	// Non-nil values still count.
	if !inbox.IsTransient(fmt.Errorf("x: %w", &sqlStateError{"40001"})) || !inbox.IsTransient(&retryError{true}) {
		t.Error("non-nil transient errors not recognised")
	}
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

// innodbTable creates an InnoDB table (id int PRIMARY KEY, v int) named
// prefix and a random suffix on db, holding rows (an SQL VALUES list), and
// drops it when the test ends.
func innodbTable(t *testing.T, db *sqlx.DB, prefix, rows string) string {
	t.Helper()
	table := prefix + testdb.RandomSuffix()
	exec(t, db, `CREATE TABLE `+table+` (id int PRIMARY KEY, v int) ENGINE=InnoDB`)
	testdb.DropLater(t, db, table)
	exec(t, db, `INSERT INTO `+table+` VALUES `+rows)
	return table
}

// beginTx begins a transaction on db that is rolled back, if still open,
// when the test ends.
func beginTx(ctx context.Context, t *testing.T, db *sqlx.DB) *sqlx.Tx {
	t.Helper()
	tx, err := db.BeginTxx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback() })
	return tx
}

// holdRowLock begins a transaction on db that locks row 1 of table (an
// UPDATE of its v) until it is rolled back.
func holdRowLock(ctx context.Context, t *testing.T, db *sqlx.DB, table string) *sqlx.Tx {
	t.Helper()
	holder := beginTx(ctx, t, db)
	if _, err := holder.Exec(`UPDATE ` + table + ` SET v = v + 1 WHERE id = 1`); err != nil {
		t.Fatal(err)
	}
	return holder
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
// fails to set up (here TLS, which the test server does not offer) says
// nothing about the message: transient, so that a poison queue built on
// IsTransient keeps the topic (the message was poisoned, and so was every
// message after it until the setting was fixed), and the delivery waits
// before it returns, so that the broker's redeliveries do not spin. The
// same before the table was checked (the check's connection fails) and
// after (a certificate rotated, a new TLS setting: the BEGIN fails, is
// retried once, and its ping fails the same way).
func TestBeginMisconfigurationKeepsTheMessageOnItsTopic(t *testing.T) {
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
	if err == nil || !inbox.IsTransient(err) || calls != 0 {
		t.Errorf("misconfigured from the start: %d handler calls, error %v (transient %v); want 0 calls and a transient error",
			calls, err, inbox.IsTransient(err))
	}

	// Misconfigured after the table was verified (a certificate rotated, a
	// new TLS setting): the BEGIN fails, is retried once, and its ping fails
	// the same way.
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
	if !inbox.IsTransient(err) {
		t.Errorf("IsTransient(%v) = false: a poison queue would take every message until the setting is fixed", err)
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

// sqlStateError is a driver error type with a pointer receiver, as pgx's
// *pgconn.PgError is.
type sqlStateError struct{ code string }

func (e *sqlStateError) Error() string    { return "sqlstate " + e.code }
func (e *sqlStateError) SQLState() string { return e.code }

type retryError struct{ safe bool }

func (e *retryError) Error() string     { return "retry" }
func (e *retryError) SafeToRetry() bool { return e.safe }
