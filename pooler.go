package inbox

import (
	"context"
	"fmt"

	"github.com/jmoiron/sqlx"
)

// withReadTx runs f with a queryer for statements that run outside a
// message's transaction. On PostgreSQL that is one short transaction: behind
// a transaction-mode pooler (PgBouncer) only a transaction keeps one server
// connection, and lib/pq sends a statement with arguments in two exchanges
// (parse, then bind and execute) that the pooler may otherwise hand to two
// server connections. Elsewhere it is db itself (a pool or one connection).
func withReadTx(ctx context.Context, db dbConn, d Dialect, f func(q sqlx.QueryerContext) error) error {
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
