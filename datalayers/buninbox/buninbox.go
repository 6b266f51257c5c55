// Package buninbox gives a bun handle (github.com/uptrace/bun) on the inbox
// transaction of the message being handled, so that a handler's bun queries
// commit or roll back with the inbox row.
//
// In a handler, take it with Tx and the application's *bun.DB, which
// supplies the dialect, the query hooks and the registered models:
//
//	idb, err := buninbox.Tx(msg.Context(), bunDB)
//	if err != nil {
//		return err // no inbox transaction: wraps inbox.ErrNoTx
//	}
//	_, err = idb.NewInsert().Model(&invoice).Exec(msg.Context())
//	return err
//
// Never run the handler's queries on bunDB itself: they run on the pool,
// commit on their own, are kept when the handler fails and happen again on
// the redelivery. See docs/datalayers.md.
//
// bun.Tx cannot be made over a transaction bun did not begin (its fields
// are unexported), so Tx returns a bun.IDB of this package's own, built
// from bun's public API only: each query builder is bun's, made on bunDB
// and bound to the inbox's *sql.Tx with its Conn method. Nested
// transactions (BeginTx, RunInTx), which would need a bun.Tx, are refused
// with ErrNestedTx.
package buninbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/uptrace/bun"
	"github.com/uptrace/bun/schema"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// ErrNestedTx is returned by BeginTx and RunInTx of the handle Tx returns:
// a nested bun transaction needs a bun.Tx, which bun makes only for
// transactions it began itself. Run the statements on the handle directly
// (they are already in the inbox transaction); for a part that must be able
// to fail alone, use a SAVEPOINT through ExecContext.
var ErrNestedTx = errors.New("buninbox: a nested bun transaction (BeginTx, RunInTx) cannot be made on the inbox transaction: " +
	"run the statements on the handle itself, they are already in the inbox transaction")

// Tx returns a bun.IDB on the inbox transaction in ctx (the message context,
// msg.Context()) for db, the application's *bun.DB on the same database as
// the inbox: its dialect formats the queries, its query hooks see them, its
// registered models apply. The handle is only valid while the handler runs,
// and the handler must not end the transaction (see inbox.TxFromContext).
//
// The query builders (NewSelect, NewInsert, NewUpdate, NewDelete, NewRaw,
// NewMerge, NewValues and the DDL ones) run on the transaction with db's
// query hooks, as bun.Tx's do. ExecContext, QueryContext and
// QueryRowContext format their arguments as bun.DB's do and run on the
// transaction, but without query hooks: bun exports no way to call them.
// BeginTx and RunInTx return ErrNestedTx.
//
// When ctx carries no inbox transaction it returns an error that wraps
// inbox.ErrNoTx and says what is missing: no inbox middleware around the
// handler or ctx is not msg.Context() (inbox.MissingTxError's text), or the
// message was claimed by a pgxinbox.Inbox, whose pgx.Tx bun cannot use.
// Once the inbox has ended the transaction (from an inbox.AfterCommit
// function, or a goroutine that outlived the handler), it refuses with an
// error that wraps both inbox.ErrNoTx and sql.ErrTxDone; a handle taken
// before then fails each statement with sql.ErrTxDone.
//
// Tx is safe for concurrent use; the handle is not, like the *sql.Tx under
// it: run its calls, the handler's other statements on the transaction and
// its outbox Publish calls from one goroutine at a time. database/sql
// serialises each call, not a query and the reading of its rows, and bun's
// inserts on PostgreSQL are queries (RETURNING): another goroutine's
// statement in between fails on pgx's stdlib with "conn busy" or panics in
// the goroutine reading the rows (a panic that Watermill's Recoverer does
// not catch: the process exits), and breaks a go-sql-driver/mysql
// connection ("busy buffer").
func Tx(ctx context.Context, db *bun.DB) (bun.IDB, error) {
	tx, ok := inbox.TxFromContext(ctx)
	if !ok {
		if _, isPgx := pgxinbox.TxFromContext(ctx); isPgx {
			return nil, fmt.Errorf("buninbox: %w: the message was claimed by a pgxinbox.Inbox, whose pgx.Tx bun cannot use: "+
				"make the Inbox with inbox.New(inbox.Config{DB: pgxinbox.DB(pool)}) for a database/sql transaction", inbox.ErrNoTx)
		}
		return nil, fmt.Errorf("buninbox: %w", inbox.MissingTxError(ctx))
	}
	if db == nil {
		return nil, errors.New("buninbox: Tx needs the application's *bun.DB, got nil")
	}
	// AfterCommit refuses once the middleware has ended the transaction;
	// before that, the function it registers does nothing after the commit.
	if !inbox.AfterCommit(ctx, func() {}) {
		return nil, fmt.Errorf("buninbox: %w: the message's inbox transaction has ended (Tx was called after the handler"+
			" returned: from an inbox.AfterCommit function, or a goroutine that outlived the handler): %w", inbox.ErrNoTx, sql.ErrTxDone)
	}
	return idb{db: db, tx: tx.Tx}, nil
}

// idb is the bun.IDB that Tx returns: bun's query builders on db, bound to
// the inbox transaction tx.
type idb struct {
	db *bun.DB
	tx *sql.Tx
}

var _ bun.IDB = idb{}

func (h idb) Dialect() schema.Dialect { return h.db.Dialect() }

func (h idb) ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error) {
	return h.tx.ExecContext(ctx, h.db.QueryGen().FormatQuery(query, args...))
}

func (h idb) QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error) {
	return h.tx.QueryContext(ctx, h.db.QueryGen().FormatQuery(query, args...))
}

func (h idb) QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row {
	return h.tx.QueryRowContext(ctx, h.db.QueryGen().FormatQuery(query, args...))
}

func (h idb) NewValues(model any) *bun.ValuesQuery { return h.db.NewValues(model).Conn(h.tx) }
func (h idb) NewSelect() *bun.SelectQuery          { return h.db.NewSelect().Conn(h.tx) }
func (h idb) NewInsert() *bun.InsertQuery          { return h.db.NewInsert().Conn(h.tx) }
func (h idb) NewUpdate() *bun.UpdateQuery          { return h.db.NewUpdate().Conn(h.tx) }
func (h idb) NewDelete() *bun.DeleteQuery          { return h.db.NewDelete().Conn(h.tx) }
func (h idb) NewMerge() *bun.MergeQuery            { return h.db.NewMerge().Conn(h.tx) }
func (h idb) NewRaw(query string, args ...any) *bun.RawQuery {
	return h.db.NewRaw(query, args...).Conn(h.tx)
}
func (h idb) NewCreateTable() *bun.CreateTableQuery     { return h.db.NewCreateTable().Conn(h.tx) }
func (h idb) NewDropTable() *bun.DropTableQuery         { return h.db.NewDropTable().Conn(h.tx) }
func (h idb) NewCreateIndex() *bun.CreateIndexQuery     { return h.db.NewCreateIndex().Conn(h.tx) }
func (h idb) NewDropIndex() *bun.DropIndexQuery         { return h.db.NewDropIndex().Conn(h.tx) }
func (h idb) NewTruncateTable() *bun.TruncateTableQuery { return h.db.NewTruncateTable().Conn(h.tx) }
func (h idb) NewAddColumn() *bun.AddColumnQuery         { return h.db.NewAddColumn().Conn(h.tx) }
func (h idb) NewDropColumn() *bun.DropColumnQuery       { return h.db.NewDropColumn().Conn(h.tx) }

func (h idb) BeginTx(context.Context, *sql.TxOptions) (bun.Tx, error) { return bun.Tx{}, ErrNestedTx }

func (h idb) RunInTx(context.Context, *sql.TxOptions, func(ctx context.Context, tx bun.Tx) error) error {
	return ErrNestedTx
}
