package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A database that refuses writes (a replica the DSN points to by mistake, a
// primary demoted during a failover, default_transaction_read_only, a
// read-only SQLite file) nacks each message as transient, its handler not
// called, after a wait (100 ms doubling over consecutive ones): a poison filter built on IsTransient keeps the
// topic, and the message is processed once the database takes writes
// again. The refusal was not transient, so the messages went to the poison
// queue, the topic drained while the database was read-only.
func TestClaimThatTheDatabaseRefusesAsReadOnlyIsTransient(t *testing.T) {
	t.Parallel()
	for _, c := range readOnlyDatabases(t) {
		t.Run(c.name, func(t *testing.T) {
			plain := c.plain(t)
			f := newFixture(t, plain)
			f.newInbox(inbox.Config{}) // the table, made where writes are taken
			ib, err := inbox.New(inbox.Config{DB: c.readOnly(t), Table: f.inbox})
			if err != nil {
				t.Fatal(err)
			}
			var mu sync.Mutex
			var waits []time.Duration
			inbox.SetTableBackoffHook(ib, func(wait time.Duration) {
				mu.Lock()
				defer mu.Unlock()
				waits = append(waits, wait)
			})
			var calls int
			rec := &recorder{}
			in := newFeed()
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(rec.Middleware, ib.Middleware)
				r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
					calls++
					return nil
				})
			})
			for range 3 {
				if in.deliver(t, message.NewMessage(watermill.NewUUID(), []byte("payload"))) {
					t.Fatal("a message was acked by an inbox whose database refuses writes")
				}
			}
			mu.Lock()
			if fmt.Sprint(waits) != "[100ms 200ms 400ms]" {
				t.Errorf("waits before the nacks: %v, want 100ms doubling", waits)
			}
			mu.Unlock()
			err = rec.last()
			if !inbox.IsTransient(err) || !errors.Is(err, inbox.ErrDatabaseReadOnly) {
				t.Errorf("nacked with %v, want a transient error wrapping ErrDatabaseReadOnly", err)
			}
			if calls != 0 || count(t, plain, f.inbox, "") != 0 {
				t.Errorf("handler calls %d, inbox rows written; want none", calls)
			}
		})
	}
}

// Verify (and so RouterPlugin) reports a database that refuses writes, with
// an error wrapping ErrDatabaseReadOnly, instead of passing and leaving a
// router whose every claim is refused; a database that takes writes passes,
// and the check writes nothing.
func TestVerifyReportsADatabaseThatRefusesWrites(t *testing.T) {
	t.Parallel()
	for _, c := range readOnlyDatabases(t) {
		t.Run(c.name, func(t *testing.T) {
			plain := c.plain(t)
			f := newFixture(t, plain)
			writable := f.newInbox(inbox.Config{})
			if err := writable.Verify(context.Background()); err != nil {
				t.Fatalf("Verify of a database that takes writes: %v", err)
			}
			ib, err := inbox.New(inbox.Config{DB: c.readOnly(t), Table: f.inbox})
			if err != nil {
				t.Fatal(err)
			}
			err = ib.Verify(context.Background())
			if !errors.Is(err, inbox.ErrDatabaseReadOnly) || errors.Is(err, inbox.ErrTableNotFound) {
				t.Errorf("Verify of a read-only database: %v, want an error wrapping ErrDatabaseReadOnly", err)
			}
			if n := count(t, plain, f.inbox, ""); n != 0 {
				t.Errorf("%d inbox rows after the checks, want none", n)
			}
		})
	}
}

// RouterPlugin waits for a database that refuses writes (a failover in
// progress) to take them, and the router then starts, instead of failing at
// the first refusal.
func TestRouterPluginWaitsForTheDatabaseToTakeWrites(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "inbox.db")
	f := newFixture(t, testdb.OpenSQLite(t, path))
	f.newInbox(inbox.Config{})
	db := openReadOnlySQLite(t, path)
	db.SetMaxOpenConns(1) // the PRAGMA below reaches the inbox's session
	logger := newCaptureLogger()
	ib, err := inbox.New(inbox.Config{DB: db, Table: f.inbox, Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- ib.RouterPlugin(nil) }()
	waitFor(t, func() bool { return logger.has("refuses writes") })
	select {
	case err := <-done:
		t.Fatalf("RouterPlugin returned %v while the database refused writes, want it to wait", err)
	default:
	}
	if _, err := db.Exec("PRAGMA query_only = 0"); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("RouterPlugin once the database takes writes: %v, want nil", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("RouterPlugin still waits 10 s after the database takes writes")
	}
}

// Verify (so RouterPlugin and `inbox schema -verify`) passes on a SQLite
// database whose write lock another process holds: its check that the
// database takes writes cannot take the lock, and a busy database is not a
// read-only one. It failed the router's start with SQLITE_BUSY.
func TestVerifyPassesWhileAnotherProcessHoldsTheWriteLock(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "inbox.db")
	f := newFixture(t, testdb.OpenSQLite(t, path))
	f.newInbox(inbox.Config{})
	writer := testdb.OpenSQLite(t, path) // another process's pool
	tx, err := writer.Beginx()           // BEGIN IMMEDIATE: the write lock
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	db, err := sqlx.Open("sqlite", "file:"+path+"?_txlock=immediate") // no busy_timeout: BUSY at once
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	ib, err := inbox.New(inbox.Config{DB: db, Table: f.inbox})
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.Verify(context.Background()); err != nil {
		t.Errorf("Verify while another process writes: %v, want nil", err)
	}
}

// A read-only PostgreSQL session whose write check meets a lock first (a
// CREATE INDEX's SHARE lock on the inbox table, and the role's lock_timeout:
// PostgreSQL takes the table's lock before it checks for a read-only
// transaction) is still reported read-only: the lock made Verify pass, and
// the router started on a replica. A session that takes writes passes,
// whether its role's lock_timeout, its statement_timeout or the check's own
// lock_timeout ends the wait (a statement_timeout failed Verify, and no
// timeout at all waited for VerifyTimeout and failed it).
func TestVerifyReportsAReadOnlySessionBehindALock(t *testing.T) {
	t.Parallel()
	plain := testdb.OpenPostgres(t, "")
	f := newFixture(t, plain)
	f.newInbox(inbox.Config{})
	holder, err := plain.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { holder.Rollback() }) // after the cases below
	if _, err := holder.Exec("LOCK TABLE " + f.inbox + " IN SHARE MODE"); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		param string
		want  error
	}{
		{"default_transaction_read_only=on&lock_timeout=200", inbox.ErrDatabaseReadOnly},
		{"lock_timeout=200", nil}, // takes writes, once the lock is gone
		{"default_transaction_read_only=on&statement_timeout=1500", inbox.ErrDatabaseReadOnly},
		{"statement_timeout=1500", nil},                                 // under the check's own 2 s lock_timeout
		{"default_transaction_read_only=on", inbox.ErrDatabaseReadOnly}, // the check's own lock_timeout
		{"", nil},
	} {
		t.Run(c.param, func(t *testing.T) {
			t.Parallel()
			ib, err := inbox.New(inbox.Config{DB: testdb.OpenPostgres(t, c.param), Table: f.inbox})
			if err != nil {
				t.Fatal(err)
			}
			if err := ib.Verify(context.Background()); !errors.Is(err, c.want) || (c.want == nil && err != nil) {
				t.Errorf("table locked: Verify = %v, want %v", err, c.want)
			}
		})
	}
}
