package pgxinbox

import (
	"context"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// handlerTx is the pgx.Tx a handler gets (TxFromContext): pgx's own,
// until the inbox committed it in a batch of its own with the outbox
// writes (pgxTx.Commit), which pgx's Tx does not see. From then on every
// method returns pgx.ErrTxClosed, as pgx's Tx does after its Commit, so
// that a handler's goroutine that outlives the message never runs a
// statement on a connection that serves another message.
type handlerTx struct {
	pgx.Tx
	closed atomic.Bool
}

func (h *handlerTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if h.closed.Load() {
		return nil, pgx.ErrTxClosed
	}
	return h.Tx.Begin(ctx)
}

func (h *handlerTx) Commit(ctx context.Context) error {
	if h.closed.Load() {
		return pgx.ErrTxClosed
	}
	return h.Tx.Commit(ctx)
}

func (h *handlerTx) Rollback(ctx context.Context) error {
	if h.closed.Load() {
		return pgx.ErrTxClosed
	}
	return h.Tx.Rollback(ctx)
}

func (h *handlerTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	if h.closed.Load() {
		return 0, pgx.ErrTxClosed
	}
	return h.Tx.CopyFrom(ctx, table, columns, src)
}

func (h *handlerTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if h.closed.Load() {
		return closedBatch{}
	}
	return h.Tx.SendBatch(ctx, b)
}

func (h *handlerTx) LargeObjects() pgx.LargeObjects {
	// pgx's LargeObjects has no error of its own: its methods run through
	// the Tx, which pgx closed only if the handler did.
	return h.Tx.LargeObjects()
}

func (h *handlerTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if h.closed.Load() {
		return nil, pgx.ErrTxClosed
	}
	return h.Tx.Prepare(ctx, name, sql)
}

func (h *handlerTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if h.closed.Load() {
		return pgconn.CommandTag{}, pgx.ErrTxClosed
	}
	return h.Tx.Exec(ctx, sql, args...)
}

func (h *handlerTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if h.closed.Load() {
		return nil, pgx.ErrTxClosed
	}
	return h.Tx.Query(ctx, sql, args...)
}

func (h *handlerTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if h.closed.Load() {
		return closedRow{}
	}
	return h.Tx.QueryRow(ctx, sql, args...)
}

// closedBatch is the BatchResults of a batch sent on a closed handlerTx.
type closedBatch struct{}

func (closedBatch) Exec() (pgconn.CommandTag, error) { return pgconn.CommandTag{}, pgx.ErrTxClosed }
func (closedBatch) Query() (pgx.Rows, error)         { return nil, pgx.ErrTxClosed }
func (closedBatch) QueryRow() pgx.Row                { return closedRow{} }
func (closedBatch) Close() error                     { return pgx.ErrTxClosed }
func (closedBatch) Tx() pgx.Tx                       { return nil }

// closedRow is the Row of a query on a closed handlerTx.
type closedRow struct{}

func (closedRow) Scan(...any) error { return pgx.ErrTxClosed }
