// Package sqlcinbox binds queries that sqlc generated to the inbox
// transaction of the message being handled, so that a handler's writes
// through them commit or roll back with the inbox row.
//
// sqlc needs no binding code: its generated New(db DBTX) takes the inbox's
// transaction as it is, the *sql.Tx (inside the *sqlx.Tx) of package inbox
// for code generated with sql_package database/sql, or the pgx.Tx of package
// pgxinbox for sql_package pgx/v5:
//
//	tx, ok := inbox.TxFromContext(msg.Context())
//	if !ok {
//		return inbox.MissingTxError(msg.Context())
//	}
//	q := invoicesdb.New(tx)
//
// Queries does the same in one call, for either inbox, and returns the error
// that says what is missing when there is no transaction of the kind the
// generated code takes:
//
//	q, err := sqlcinbox.Queries(msg.Context(), invoicesdb.New)
//	if err != nil {
//		return err
//	}
//	err = q.CreateInvoice(msg.Context(), invoicesdb.CreateInvoiceParams{…})
//
// Never build the queries on the application's pool (invoicesdb.New(db)) in
// a handler: those writes commit on their own, are kept when the handler
// fails and happen again on the redelivery. See docs/datalayers.md.
package sqlcinbox

import (
	"context"
	"database/sql"
	"fmt"
	"reflect"

	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// Queries returns newQueries(tx), where newQueries is the New function of a
// package sqlc generated and tx the inbox transaction in ctx (the message
// context, msg.Context()): the *sql.Tx of an inbox.Inbox, or the pgx.Tx of
// a pgxinbox.Inbox. The queries are only valid while the handler runs, and
// the handler must not end the transaction (see inbox.TxFromContext).
//
// When ctx carries no inbox transaction it returns the error of
// inbox.MissingTxError, which wraps inbox.ErrNoTx and says what is missing
// (no inbox middleware around the handler, or ctx is not msg.Context()).
// When the transaction is not of the kind the generated DBTX takes (code
// generated with sql_package pgx/v5 under an inbox.Inbox, or with
// database/sql under a pgxinbox.Inbox), the error also wraps inbox.ErrNoTx
// and names both. Once the inbox has ended the transaction (from an
// inbox.AfterCommit function, or a goroutine that outlived the handler),
// the error wraps inbox.ErrNoTx and what the transaction's statements
// would fail with: sql.ErrTxDone, or pgx.ErrTxClosed. In each case
// newQueries is not called. It is safe for concurrent use; the queries are
// not, like the transaction under them: run them, the handler's other
// statements on the transaction and its outbox Publish calls from one
// goroutine at a time (see inbox.TxFromContext).
func Queries[DBTX, Q any](ctx context.Context, newQueries func(DBTX) Q) (Q, error) {
	var zero Q
	var tx any
	var kind, fix string
	var done error // what the transaction's statements fail with once it has ended
	if sqlTx, ok := inbox.TxFromContext(ctx); ok {
		tx, kind, fix, done = sqlTx.Tx, "*sql.Tx", "generate the queries with sql_package database/sql, or make the Inbox with pgxinbox.New", sql.ErrTxDone
	} else if pgxTx, ok := pgxinbox.TxFromContext(ctx); ok {
		tx, kind, fix, done = pgxTx, "pgx.Tx", "generate the queries with sql_package pgx/v5, or make the Inbox with inbox.New", pgx.ErrTxClosed
	} else {
		return zero, fmt.Errorf("sqlcinbox: %w", inbox.MissingTxError(ctx))
	}
	// AfterCommit refuses once the middleware has ended the transaction;
	// before that, the function it registers does nothing after the commit.
	if !inbox.AfterCommit(ctx, func() {}) {
		return zero, fmt.Errorf("sqlcinbox: %w: the message's inbox transaction has ended (Queries was called after the handler"+
			" returned: from an inbox.AfterCommit function, or a goroutine that outlived the handler): %w", inbox.ErrNoTx, done)
	}
	db, ok := tx.(DBTX)
	if !ok {
		return zero, fmt.Errorf("sqlcinbox: %w: the inbox transaction is a %s, which the generated %s does not take: %s",
			inbox.ErrNoTx, kind, reflect.TypeFor[DBTX](), fix)
	}
	return newQueries(db), nil
}
