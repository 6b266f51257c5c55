package inbox

import (
	"context"

	"github.com/jmoiron/sqlx"
)

// txKey is the context key under which the middleware stores the inbox
// transaction. It is unexported so that only this package can set it.
type txKey struct{}

// TxFromContext returns the inbox transaction that the middleware opened for
// the message being handled, and true; or nil and false when ctx does not
// come from a message the inbox claimed.
//
// Call it with msg.Context() inside a handler. Every write the handler makes
// through the returned transaction commits or rolls back together with the
// inbox row. The handler must not end it: no Commit or Rollback call, no
// COMMIT, ROLLBACK or SET autocommit statement, and on MySQL/MariaDB no
// statement that commits implicitly (DDL such as CREATE TABLE or TRUNCATE,
// LOCK TABLES; see MySQL's "Statements That Cause an Implicit Commit"). Such
// a statement commits the inbox row early: if the handler then fails, the
// redelivery is skipped as a duplicate. The middleware commits or rolls back
// after the handler returns. Pass msg.Context() to the statements
// (ExecContext, QueryContext) so that cancellation reaches them.
//
// The transaction is only valid while the handler runs; after the middleware
// returns, the message context no longer carries it.
func TxFromContext(ctx context.Context) (*sqlx.Tx, bool) {
	tx, ok := ctx.Value(txKey{}).(*sqlx.Tx)
	return tx, ok && tx != nil
}

func contextWithTx(ctx context.Context, tx *sqlx.Tx) context.Context {
	return context.WithValue(ctx, txKey{}, tx)
}
