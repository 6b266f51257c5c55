// Package entinbox binds ent (entgo.io/ent) to the inbox transaction of the
// message being handled, so that what a handler writes through an ent
// client commits or rolls back together with the inbox row.
//
// In a handler behind the inbox middleware (package
// github.com/watermill-inbox/inbox; the flow is described in its doc.go),
// with the application's generated package ent:
//
//	// Once, beside the generated package: how to build its client on a driver.
//	func newClient(drv dialect.Driver) *ent.Client { return ent.NewClient(ent.Driver(drv)) }
//
//	func IssueInvoice(msg *message.Message) error {
//		client, err := entinbox.Client(msg.Context(), dialect.Postgres, newClient)
//		if err != nil {
//			return err // no inbox transaction: wraps inbox.ErrNoTx
//		}
//		return client.Invoice.Create().SetOrderID(msg.Metadata.Get("order_id")).Exec(msg.Context())
//	}
//
// It is a module of its own, so that the inbox's core module does not pull
// in ent. PostgreSQL, MySQL/MariaDB and SQLite (modernc.org/sqlite) are
// tested.
package entinbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"weak"

	"entgo.io/ent/dialect"
	entsql "entgo.io/ent/dialect/sql"

	"github.com/watermill-inbox/inbox"
)

// Driver returns an ent driver whose every statement runs in the inbox
// transaction of the message being handled: pass msg.Context() as ctx and
// the ent dialect of the inbox's database (dialect.Postgres, dialect.MySQL
// or dialect.SQLite from entgo.io/ent/dialect). Build the generated client
// on it for this message:
//
//	client := ent.NewClient(ent.Driver(drv))
//
// Creates, updates, deletes, queries, edges and hooks of that client then
// run in the inbox transaction, and commit or roll back with the inbox row,
// as do raw statements through the client's ExecContext and QueryContext
// (ent's sql/execquery feature), under the same rules below.
// Making the client per message is cheap (no connection, no schema work);
// pass msg.Context() to its calls.
//
// The driver never ends the inbox transaction. A transaction started on it
// is a savepoint in the inbox transaction: client.Tx (and client.BeginTx
// without options) runs SAVEPOINT; the ent Tx's Commit releases it, and its
// Rollback rolls back to it, undoing what was written through that Tx.
// While it is open, the client itself and every other client on the same
// message's transaction refuse statements and transactions (ErrTxOpen): its
// Rollback would undo them too, which on a pool would have been apart from
// it. The raw transaction (inbox.TxFromContext) and inbox.OutboxFromContext
// are not guarded: what they write while the Tx is open is undone by its
// Rollback as well, so write through the Tx then.
// Whatever the savepoints hold commits or rolls back with the inbox row in
// the end. ent's own builders start such a transaction for statements that
// span several statements (UpdateOne, Update, a Create with edges stored in
// other tables), so that a failure undoes all of them: that costs two round
// trips (SAVEPOINT, RELEASE) more than on the pool. A Tx's OnCommit hooks
// run at its Commit, the savepoint's release, before the inbox commits:
// for effects after the commit use inbox.AfterCommit. BeginTx with an
// isolation level or read-only mode fails: a savepoint has neither (the
// inbox's Config.TxOptions sets them for the whole transaction). Close
// (client.Close) does nothing, leaving the transaction and the pool to the
// inbox. Do not run migrations through it (on MySQL/MariaDB, DDL commits the
// inbox transaction).
//
// Do not use the application's own client (on the pool) in a handler: its
// writes commit at once on another connection, stay when the handler fails,
// and happen again on the redelivery (on SQLite they wait for the inbox
// transaction's write lock until busy_timeout); and a client.Tx of its own
// commits apart from the inbox row just the same.
//
// When ctx carries no inbox transaction (no inbox middleware around the
// handler, a context other than msg.Context(), or a message claimed by
// pgxinbox), Driver returns nil and inbox.MissingTxError(ctx), which wraps
// inbox.ErrNoTx and says which case it is. Another dialect name is an error.
//
// The driver is valid until the handler returns, like the transaction.
// Once the inbox has ended the transaction (from an inbox.AfterCommit
// function, or a goroutine that outlived the handler), Driver refuses with
// an error that wraps both inbox.ErrNoTx and sql.ErrTxDone; a driver taken
// before then fails each statement with sql.ErrTxDone.
//
// Like the *sql.Tx under it, the driver and its clients are not safe for
// concurrent use: run their calls, the handler's other statements on the
// transaction and its outbox Publish calls from one goroutine at a time.
// database/sql serialises each call, not a query and the reading of its
// rows, and ent's creates on PostgreSQL are queries (RETURNING): another
// goroutine's statement in between fails on pgx's stdlib with "conn busy"
// or panics in the goroutine reading the rows (a panic that Watermill's
// Recoverer does not catch: the process exits), and breaks a
// go-sql-driver/mysql connection ("busy buffer"). A savepoint spans the
// whole transaction besides: while a transaction of a client is open
// (client.Tx, or the one ent's builders open for UpdateOne, Update and a
// Create with edges), the statements of every client of the message fail
// with ErrTxOpen.
func Driver(ctx context.Context, dialectName string) (dialect.Driver, error) {
	switch dialectName {
	case dialect.Postgres, dialect.MySQL, dialect.SQLite:
	default:
		return nil, fmt.Errorf("entinbox: dialect %q: want dialect.Postgres, dialect.MySQL or dialect.SQLite", dialectName)
	}
	tx, ok := inbox.TxFromContext(ctx)
	if !ok {
		return nil, inbox.MissingTxError(ctx)
	}
	// AfterCommit refuses once the middleware has ended the transaction;
	// before that, the function it registers does nothing after the commit.
	if !inbox.AfterCommit(ctx, func() {}) {
		return nil, fmt.Errorf("entinbox: %w: the message's inbox transaction has ended (Driver was called after the handler"+
			" returned: from an inbox.AfterCommit function, or a goroutine that outlived the handler): %w", inbox.ErrNoTx, sql.ErrTxDone)
	}
	return &txDriver{Conn: entsql.Conn{ExecQuerier: tx.Tx}, tx: tx.Tx, dialect: dialectName, guard: guardOf(tx.Tx)}, nil
}

// txGuard is what every driver on one inbox transaction shares: a savepoint
// spans the whole transaction, so while one driver's transaction is open
// the statements of every other client of the message are refused too. A
// guard per driver let a second client (a repository that takes its own
// with Client(ctx, …)) write while another's Tx was open, and that Tx's
// Rollback undid the write, which had returned nil: the message was acked
// without it.
type txGuard struct {
	// mu is held shared by the clients' statements while they run, and
	// exclusively while a transaction starts or ends, so that no statement
	// runs across a savepoint's start or end.
	mu sync.RWMutex
	// open is whether a transaction (a savepoint) started on a driver of
	// the inbox transaction is not yet committed or rolled back. Under mu.
	open bool
}

// txGuards holds each inbox transaction's guard, by a weak pointer to its
// *sql.Tx: an entry goes once the transaction is garbage (runtime.AddCleanup),
// so the map holds no transaction alive and does not grow per message.
var txGuards sync.Map // weak.Pointer[sql.Tx] -> *txGuard

// guardOf returns the guard of the inbox transaction tx.
func guardOf(tx *sql.Tx) *txGuard {
	key := weak.Make(tx)
	if g, ok := txGuards.Load(key); ok {
		return g.(*txGuard)
	}
	g, loaded := txGuards.LoadOrStore(key, &txGuard{})
	if !loaded {
		runtime.AddCleanup(tx, func(k weak.Pointer[sql.Tx]) { txGuards.Delete(k) }, key)
	}
	return g.(*txGuard)
}

// Client returns the application's generated ent client on the inbox
// transaction of the message being handled, in one call: Driver(ctx,
// dialectName), then newClient on it. newClient builds the generated client
// on a driver; ent generates a client type per application, so the
// application writes it once:
//
//	func newClient(drv dialect.Driver) *ent.Client { return ent.NewClient(ent.Driver(drv)) }
//
// Everything Driver says holds for the client. Without an inbox
// transaction in ctx it returns the zero client and Driver's error (which
// wraps inbox.ErrNoTx), and newClient is not called.
func Client[C any](ctx context.Context, dialectName string, newClient func(dialect.Driver) C) (C, error) {
	drv, err := Driver(ctx, dialectName)
	if err != nil {
		var zero C
		return zero, err
	}
	return newClient(drv), nil
}

// ErrTxOpen is wrapped by the error of a statement or transaction started on
// a client of the message (a driver of Driver on its inbox transaction)
// while a transaction started on that client or another is still open: that transaction is a savepoint, and its Rollback would undo
// the statement too, which on a pool would have been apart from it and
// kept. Run the statement through the Tx (tx.Client()), or after its Commit
// or Rollback. ent's builders start such a transaction themselves for
// statements that span several (UpdateOne, Update, a Create with edges), so
// calls of one client from goroutines at once can meet it too.
var ErrTxOpen = errors.New("entinbox: a transaction of this client is open")

// txDriver is an ent driver on the inbox transaction. entsql.NewDriver
// over the same Conn would run statements there too, but its Tx asserts
// that its connection is a *sql.DB and panics, and its Close would close
// whatever it holds.
type txDriver struct {
	entsql.Conn // Exec and Query, on tx
	tx          *sql.Tx
	dialect     string
	guard       *txGuard // the inbox transaction's, shared with its other drivers
}

// Exec runs a statement of the client in the inbox transaction, unless a
// transaction of the client is open (ErrTxOpen).
func (d *txDriver) Exec(ctx context.Context, query string, args, v any) error {
	d.guard.mu.RLock()
	defer d.guard.mu.RUnlock()
	if d.guard.open {
		return errTxOpen()
	}
	return d.Conn.Exec(ctx, query, args, v)
}

// Query runs a query of the client in the inbox transaction, unless a
// transaction of the client is open (ErrTxOpen).
func (d *txDriver) Query(ctx context.Context, query string, args, v any) error {
	d.guard.mu.RLock()
	defer d.guard.mu.RUnlock()
	if d.guard.open {
		return errTxOpen()
	}
	return d.Conn.Query(ctx, query, args, v)
}

// ExecContext runs a raw statement of the client (ent's sql/execquery
// feature: client.ExecContext) in the inbox transaction, unless a
// transaction of the client is open (ErrTxOpen). entsql.Conn's own, which
// txDriver would otherwise promote, runs past that check.
func (d *txDriver) ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error) {
	d.guard.mu.RLock()
	defer d.guard.mu.RUnlock()
	if d.guard.open {
		return nil, errTxOpen()
	}
	return d.tx.ExecContext(ctx, query, args...)
}

// QueryContext runs a raw query of the client (client.QueryContext) in the
// inbox transaction, unless a transaction of the client is open
// (ErrTxOpen).
func (d *txDriver) QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error) {
	d.guard.mu.RLock()
	defer d.guard.mu.RUnlock()
	if d.guard.open {
		return nil, errTxOpen()
	}
	return d.tx.QueryContext(ctx, query, args...)
}

// errTxOpen is the error of a statement or transaction of the client while
// one of its transactions is open.
func errTxOpen() error {
	return fmt.Errorf("%w: its Rollback would undo this statement as well, which on a pool would be apart from it;"+
		" run it through the transaction's client (tx.Client()) or after its Commit or Rollback", ErrTxOpen)
}

// Dialect returns the dialect name given to Driver.
func (d *txDriver) Dialect() string { return d.dialect }

// savepoints numbers the savepoints of every driver in the process: MySQL
// replaces a savepoint of the same name instead of nesting it, so two
// drivers on one message's transaction must never share a name.
var savepoints atomic.Uint64

// Tx starts a savepoint in the inbox transaction. ctx is used until the
// returned Tx is committed (released) or rolled back.
//
// A Tx the handler neither commits nor rolls back stays part of the inbox
// transaction: its writes commit with the inbox row, also when ctx has
// ended (database/sql would roll back a transaction of the pool then); end
// every Tx.
func (d *txDriver) Tx(ctx context.Context) (dialect.Tx, error) {
	d.guard.mu.Lock()
	defer d.guard.mu.Unlock()
	if d.guard.open {
		return nil, errTxOpen()
	}
	sp := &savepoint{Conn: d.Conn, tx: d.tx, ctx: ctx, name: fmt.Sprintf("entinbox_%d", savepoints.Add(1)), drv: d}
	if _, err := d.tx.ExecContext(ctx, "SAVEPOINT "+sp.name); err != nil {
		return nil, fmt.Errorf("entinbox: savepoint: %w", err)
	}
	d.guard.open = true
	return sp, nil
}

// BeginTx starts a savepoint as Tx does when opts is nil or zero, and fails
// otherwise. The generated client's BeginTx asserts that its driver has this
// method.
func (d *txDriver) BeginTx(ctx context.Context, opts *sql.TxOptions) (dialect.Tx, error) {
	if opts != nil && *opts != (sql.TxOptions{}) {
		return nil, fmt.Errorf("entinbox: BeginTx with options %+v: a transaction inside the inbox transaction is a savepoint, "+
			"which has no isolation level or read-only mode (set them for the inbox transaction with its Config.TxOptions)", *opts)
	}
	return d.Tx(ctx)
}

// Close does nothing: the inbox middleware ends the transaction and the
// application closes the pool.
func (d *txDriver) Close() error { return nil }

// savepoint is a transaction that ent started on a txDriver.
type savepoint struct {
	entsql.Conn // Exec and Query, on tx
	tx          *sql.Tx
	ctx         context.Context
	name        string

	drv *txDriver // the driver it was started on

	// mu is held while the savepoint's statements run, and while it ends.
	mu   sync.Mutex
	done bool
}

// Exec runs a statement of the Tx, or returns sql.ErrTxDone after its
// Commit or Rollback, as database/sql's Tx does: it ran, and committed with
// the inbox row.
func (s *savepoint) Exec(ctx context.Context, query string, args, v any) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.done {
		return sql.ErrTxDone
	}
	return s.Conn.Exec(ctx, query, args, v)
}

// Query runs a query of the Tx, or returns sql.ErrTxDone after its Commit
// or Rollback.
func (s *savepoint) Query(ctx context.Context, query string, args, v any) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.done {
		return sql.ErrTxDone
	}
	return s.Conn.Query(ctx, query, args, v)
}

// ExecContext runs a raw statement of the Tx (ent's sql/execquery
// feature: tx.ExecContext), or returns sql.ErrTxDone after its Commit or
// Rollback. entsql.Conn's own, which savepoint would otherwise promote,
// runs past that check, in the inbox transaction.
func (s *savepoint) ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.done {
		return nil, sql.ErrTxDone
	}
	return s.tx.ExecContext(ctx, query, args...)
}

// QueryContext runs a raw query of the Tx (tx.QueryContext), or returns
// sql.ErrTxDone after its Commit or Rollback.
func (s *savepoint) QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.done {
		return nil, sql.ErrTxDone
	}
	return s.tx.QueryContext(ctx, query, args...)
}

// Commit releases the savepoint: what was written since it stays in the
// inbox transaction. After Commit or Rollback it returns sql.ErrTxDone and
// runs nothing (a failed statement would abort the whole transaction on
// PostgreSQL).
//
// When ctx has ended, it rolls back to the savepoint instead and returns
// ctx's error, as database/sql rolls back a transaction whose context
// ended (a failed RELEASE kept the writes, to commit with the inbox row).
func (s *savepoint) Commit() error {
	if !s.end() {
		return sql.ErrTxDone
	}
	defer s.finish()
	if err := s.ctx.Err(); err != nil {
		if rerr := s.rollbackTo(); rerr != nil {
			return fmt.Errorf("entinbox: %w (and %w)", err, rerr)
		}
		return err
	}
	if _, err := s.tx.ExecContext(context.WithoutCancel(s.ctx), "RELEASE SAVEPOINT "+s.name); err != nil {
		return fmt.Errorf("entinbox: release savepoint: %w", err)
	}
	return nil
}

// Rollback rolls back to the savepoint and releases it: what was written
// since it is undone, and the inbox transaction goes on. After Commit or
// Rollback it returns sql.ErrTxDone and runs nothing.
//
// It runs even when ctx has ended (its statements are not cancelled with
// it): a rollback cancelled with ctx kept the writes, which then committed
// with the inbox row.
func (s *savepoint) Rollback() error {
	if !s.end() {
		return sql.ErrTxDone
	}
	defer s.finish()
	return s.rollbackTo()
}

// rollbackTo rolls back to the savepoint and releases it, whether or not
// ctx has ended.
func (s *savepoint) rollbackTo() error {
	ctx := context.WithoutCancel(s.ctx)
	if _, err := s.tx.ExecContext(ctx, "ROLLBACK TO SAVEPOINT "+s.name); err != nil {
		return fmt.Errorf("entinbox: rollback to savepoint: %w", err)
	}
	if _, err := s.tx.ExecContext(ctx, "RELEASE SAVEPOINT "+s.name); err != nil {
		return fmt.Errorf("entinbox: release savepoint after rollback: %w", err)
	}
	return nil
}

// end marks the savepoint ended and reports whether it was still open; it
// waits for a statement of the Tx that is running.
func (s *savepoint) end() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	open := !s.done
	s.done = true
	return open
}

// finish lets the client run statements and transactions again, once the
// savepoint's end has run: before it, a client statement could run between
// the end and its ROLLBACK TO, and be undone.
func (s *savepoint) finish() {
	s.drv.guard.mu.Lock()
	s.drv.guard.open = false
	s.drv.guard.mu.Unlock()
}

var (
	_ dialect.Driver = (*txDriver)(nil)
	_ dialect.Tx     = (*savepoint)(nil)
)
