// Package gorminbox binds GORM (gorm.io/gorm) to the inbox transaction of
// the message being handled, so that what a handler writes through GORM
// commits or rolls back together with the inbox row.
//
// In a handler behind the inbox middleware (package
// github.com/watermill-inbox/inbox; the flow is described in its doc.go):
//
//	func (h *Handlers) IssueInvoice(msg *message.Message) error {
//		db, err := gorminbox.DB(msg.Context(), h.db) // h.db: the application's *gorm.DB
//		if err != nil {
//			return err // no inbox transaction: wraps inbox.ErrNoTx
//		}
//		return db.Create(&Invoice{OrderID: msg.Metadata.Get("order_id")}).Error
//	}
//
// It is a module of its own, so that the inbox's core module does not pull
// in GORM. PostgreSQL (gorm.io/driver/postgres), MySQL/MariaDB
// (gorm.io/driver/mysql) and SQLite (gorm.io/driver/sqlite, opened on the
// inbox's modernc.org/sqlite pool: see DB) are tested.
package gorminbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"gorm.io/gorm"

	"github.com/watermill-inbox/inbox"
)

// ErrTxOwnedByInbox is the error of Commit and Rollback called on a session
// that DB returned: the inbox middleware ends the inbox transaction after
// the handler returns (commit on nil, rollback on an error), and a handler
// that ended it itself would commit the inbox row apart from the rest of
// its work. Nothing is committed or rolled back; GORM keeps the error on
// that session, whose later statements fail with it: take a new session
// from DB to go on. A redelivery meets the same handler: fix the handler.
var ErrTxOwnedByInbox = errors.New("gorminbox: the session runs in the inbox transaction, " +
	"which the inbox middleware commits or rolls back: return nil from the handler to commit or an error to roll back " +
	"(db.Transaction inside the handler uses a savepoint)")

// DB returns a GORM session whose every statement runs in the inbox
// transaction of the message being handled: pass msg.Context() as ctx and
// the application's *gorm.DB as db. The session keeps db's dialector, config,
// logger, callbacks and plugins, runs with ctx as its context, and starts
// with no conditions (it is made with gorm.Session{NewDB: true}); db itself
// is left as it was. A PrepareStmt statement cache of db is not used on the
// session: its statements are prepared by the driver, as on any *sql.Tx.
//
// On the session, GORM behaves as it does inside db.Transaction:
//   - Create, Save, Update, Delete, raw Exec and queries run in the inbox
//     transaction, and so do hooks (BeforeCreate, AfterCreate, … receive
//     the session) and the associations written with their parent.
//   - Transaction(fc) is nested: it runs fc after a SAVEPOINT and, when fc
//     returns an error or panics, rolls back to that savepoint only, as
//     GORM documents for nested transactions; the rest of the handler's
//     writes stay and commit with the inbox row. Also when db has
//     DisableNestedTransaction (the session turns it off). Its
//     *sql.TxOptions are ignored, as GORM ignores them for any nested
//     transaction: set them with the inbox's Config.TxOptions.
//   - Commit and Rollback refuse with ErrTxOwnedByInbox (the middleware ends
//     the transaction); Begin fails with gorm.ErrInvalidTransaction, and the
//     session's DB() and Connection with gorm.ErrInvalidDB, so that no
//     handler code reaches the pool through the session. Except on a session
//     made from it with PrepareStmt (db.Session(&gorm.Session{PrepareStmt:
//     true})): its statements still run in the inbox transaction, but GORM's
//     PreparedStmtTX, which wraps the transaction, returns the application's
//     pool from DB(), and Connection runs on that pool, outside the inbox
//     transaction. Do not call them on such a session.
//
// db must be opened on the same database as the inbox's Config.DB; open it
// over that very *sql.DB (postgres.New(postgres.Config{Conn: sqlDB}),
// mysql.New(mysql.Config{Conn: sqlDB}), sqlite.New(sqlite.Config{Conn:
// sqlDB}) from gorm.io/driver/sqlite), so that one pool serves both. On
// SQLite that pool is modernc.org/sqlite's ("sqlite"): gorm.io/driver/sqlite
// builds its SQL for SQLite whatever driver runs it, and with Conn set it
// opens nothing (it still links mattn/go-sqlite3, which it imports;
// TranslateError does not recognise modernc's errors). Do not write through
// db itself in a handler: those writes commit at once on another connection,
// stay when the handler fails, and happen again on the redelivery (on SQLite
// they wait for the inbox transaction's write lock until busy_timeout).
//
// When ctx carries no inbox transaction (no inbox middleware around the
// handler, a context other than msg.Context(), or a message claimed by
// pgxinbox), DB returns nil and inbox.MissingTxError(ctx), which wraps
// inbox.ErrNoTx and says which case it is. A nil db is an error too.
//
// The session is valid until the handler returns, like the transaction.
// Once the inbox has ended the transaction (from an inbox.AfterCommit
// function, or a goroutine that outlived the handler), DB refuses with an
// error that wraps both inbox.ErrNoTx and sql.ErrTxDone; a session taken
// before then fails each statement with sql.ErrTxDone.
//
// Like the *sql.Tx under it, the session is not safe for concurrent use:
// run its calls, the handler's other statements on the transaction and
// its outbox Publish calls from one goroutine at a time. database/sql
// serialises each call, not a query and the reading of its rows, and
// GORM's inserts on PostgreSQL are queries (RETURNING): another
// goroutine's statement in between fails on pgx's stdlib with "conn busy"
// or panics in the goroutine reading the rows (a panic that Watermill's
// Recoverer does not catch: the process exits), and breaks a
// go-sql-driver/mysql connection ("busy buffer"). Transaction makes it
// worse: its savepoint spans the whole inbox transaction, so when fc fails
// it undoes whatever else was written into the transaction meanwhile.
func DB(ctx context.Context, db *gorm.DB) (*gorm.DB, error) {
	if db == nil {
		return nil, errors.New("gorminbox: nil *gorm.DB: pass the application's *gorm.DB")
	}
	tx, ok := inbox.TxFromContext(ctx)
	if !ok {
		return nil, inbox.MissingTxError(ctx)
	}
	// AfterCommit refuses once the middleware has ended the transaction;
	// before that, the function it registers does nothing after the commit.
	if !inbox.AfterCommit(ctx, func() {}) {
		return nil, fmt.Errorf("gorminbox: %w: the message's inbox transaction has ended (DB was called after the handler"+
			" returned: from an inbox.AfterCommit function, or a goroutine that outlived the handler): %w", inbox.ErrNoTx, sql.ErrTxDone)
	}
	// As gorm's own Begin does: a session with a Statement of its own, whose
	// ConnPool is the transaction. NewDB keeps it there for every chain.
	session := db.Session(&gorm.Session{NewDB: true, Context: ctx})
	session.Statement.ConnPool = &inboxTx{Tx: tx.Tx}
	// Nested Transaction calls are savepoints even when db has
	// DisableNestedTransaction (the session's Config is its own copy): with
	// it, GORM ran fc with no savepoint, and fc's writes committed with
	// the message although fc failed, where outside the inbox the same
	// Transaction is a transaction of its own and undoes them.
	session.Config.DisableNestedTransaction = false
	return session, nil
}

// inboxTx is the inbox transaction as GORM's connection pool. It is a
// gorm.TxCommitter, so GORM treats the session as one inside a transaction
// (nested Transaction calls become savepoints, default transactions are not
// begun), and has every other method of *sql.Tx (a gorm.Tx). Its Commit and
// Rollback refuse: the inbox middleware ends the transaction.
// It is a pointer because GORM's Commit calls reflect.Value.IsNil on it.
type inboxTx struct {
	*sql.Tx
}

// Commit refuses with ErrTxOwnedByInbox.
func (*inboxTx) Commit() error { return ErrTxOwnedByInbox }

// Rollback refuses with ErrTxOwnedByInbox.
func (*inboxTx) Rollback() error { return ErrTxOwnedByInbox }

var (
	_ gorm.Tx          = (*inboxTx)(nil)
	_ gorm.TxCommitter = (*inboxTx)(nil)
	_ gorm.ConnPool    = (*inboxTx)(nil)
)
