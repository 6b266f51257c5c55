package inbox

import (
	"context"

	"github.com/jmoiron/sqlx"
)

// withReadTx runs f with a queryer for reads that run outside a message's
// transaction, as d needs them (Dialect.readTx): on PostgreSQL one short
// transaction, rolled back when f returns (behind a transaction-mode pooler
// only a transaction keeps one server connection, and lib/pq sends a
// statement with arguments in two exchanges that the pooler may otherwise
// hand to two server connections); elsewhere db itself (a pool or one
// connection).
func withReadTx(ctx context.Context, db dbConn, d Dialect, f func(q sqlx.QueryerContext) error) error {
	return d.readTx(ctx, db, f)
}
