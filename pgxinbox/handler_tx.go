package pgxinbox

import (
	"context"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// handlerTx is the pgx.Tx a handler gets from TxFromContext: the message's
// transaction, refusing every statement with pgx.ErrTxClosed once the inbox
// has committed or rolled it back and given its connection back to the
// pool. pgx's own Tx knows only its own Commit and Rollback: after a COMMIT
// sent in a batch with the returned messages' INSERT (CommitWith) it took
// the transaction for open, and a handler's late statement (an AfterCommit
// function's, a goroutine's) ran on the connection the pool had taken back,
// in autocommit or inside the next message's transaction. Its nested
// transactions (Begin: savepoints) refuse too. Conn and LargeObjects reach
// pgx's connection and Tx directly, unguarded.
type handlerTx struct {
	pgx.Tx
	ended *atomic.Bool // set by pgxTx.release
}

func (h handlerTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if h.ended.Load() {
		return nil, pgx.ErrTxClosed
	}
	tx, err := h.Tx.Begin(ctx)
	if err != nil {
		return nil, err
	}
	return handlerTx{Tx: tx, ended: h.ended}, nil
}

func (h handlerTx) Commit(ctx context.Context) error {
	if h.ended.Load() {
		return pgx.ErrTxClosed
	}
	return h.Tx.Commit(ctx)
}

func (h handlerTx) Rollback(ctx context.Context) error {
	if h.ended.Load() {
		return pgx.ErrTxClosed
	}
	return h.Tx.Rollback(ctx)
}

func (h handlerTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	if h.ended.Load() {
		return 0, pgx.ErrTxClosed
	}
	return h.Tx.CopyFrom(ctx, table, columns, src)
}

func (h handlerTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if h.ended.Load() {
		return closedBatch{}
	}
	return h.Tx.SendBatch(ctx, b)
}

func (h handlerTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if h.ended.Load() {
		return nil, pgx.ErrTxClosed
	}
	return h.Tx.Prepare(ctx, name, sql)
}

func (h handlerTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if h.ended.Load() {
		return pgconn.CommandTag{}, pgx.ErrTxClosed
	}
	return h.Tx.Exec(ctx, sql, args...)
}

func (h handlerTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if h.ended.Load() {
		return closedRows{}, pgx.ErrTxClosed
	}
	return h.Tx.Query(ctx, sql, args...)
}

func (h handlerTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if h.ended.Load() {
		return closedRows{}
	}
	return h.Tx.QueryRow(ctx, sql, args...)
}

// closedBatch is the pgx.BatchResults of a batch sent on an ended
// handlerTx: every result is pgx.ErrTxClosed. The interface is embedded
// (nil) only so that methods a later pgx adds to it compile; every method
// of pgx v5.12's is its own.
type closedBatch struct{ pgx.BatchResults }

func (closedBatch) Exec() (pgconn.CommandTag, error) { return pgconn.CommandTag{}, pgx.ErrTxClosed }
func (closedBatch) Query() (pgx.Rows, error)         { return closedRows{}, pgx.ErrTxClosed }
func (closedBatch) QueryRow() pgx.Row                { return closedRows{} }
func (closedBatch) Close() error                     { return pgx.ErrTxClosed }
func (closedBatch) Tx() pgx.Tx                       { return nil }

// closedRows is the pgx.Rows (and pgx.Row) of a query on an ended
// handlerTx: no row, and pgx.ErrTxClosed. As closedBatch, it embeds the
// interface for the methods a later pgx adds (pgx's Row and Rows may gain
// some).
type closedRows struct{ pgx.Rows }

func (closedRows) Close()                                       {}
func (closedRows) Err() error                                   { return pgx.ErrTxClosed }
func (closedRows) CommandTag() pgconn.CommandTag                { return pgconn.CommandTag{} }
func (closedRows) FieldDescriptions() []pgconn.FieldDescription { return nil }
func (closedRows) Next() bool                                   { return false }
func (closedRows) Scan(...any) error                            { return pgx.ErrTxClosed }
func (closedRows) Values() ([]any, error)                       { return nil, pgx.ErrTxClosed }
func (closedRows) RawValues() [][]byte                          { return nil }
func (closedRows) Conn() *pgx.Conn                              { return nil }
func (closedRows) TypeMap() *pgtype.Map                         { return nil }

var (
	_ pgx.Tx           = handlerTx{}
	_ pgx.BatchResults = closedBatch{}
	_ pgx.Rows         = closedRows{}
	_ pgx.Row          = closedRows{}
)
