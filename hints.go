package inbox

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/jmoiron/sqlx"
)

// Hints: where a user's mistake surfaces as a bare database or context error,
// the inbox names the mistake and its fix next to that error, which stays in
// the chain (errors.Is and errors.As still reach it).

// handlerErrorHint returns the handler's error with a hint wrapped around it
// when the error is the known symptom of a mistake:
//
//   - SQLSTATE 25P02 (in_failed_sql_transaction): an earlier statement of
//     this transaction failed, and PostgreSQL ignores the statements after
//     it. A handler that went on after a failed statement, or Retry running
//     inside the inbox, so that every attempt shares one transaction.
//   - context.DeadlineExceeded while every connection of the pool is in use:
//     the handler most likely waited for a connection of the pool (a write
//     through DB instead of the transaction) that the messages in flight,
//     this one included, all hold.
//
// Any other error comes back as it is.
func (d *delivery) handlerErrorHint(err error) error {
	switch {
	case hasSQLState(err, "25P02"):
		return fmt.Errorf("%w (SQLSTATE 25P02: an earlier statement failed in this transaction, and PostgreSQL ignores "+
			"every later one: the handler went on after a failed statement, or Retry (or another middleware that calls "+
			"the handler again) runs inside the inbox, so that every attempt shares one transaction; put Retry outside "+
			"the inbox, as Inbox.Middlewares orders them)", err)
	case hasSQLState(err, "26000", "42P05"):
		// pgx's default statement cache behind a transaction-mode pooler
		// fails the handler's own statements so, not only the inbox's: a
		// poisoned message's reason said nothing of the fix.
		return poolerHint(err)
	case errors.Is(err, context.DeadlineExceeded) && d.poolWasFull():
		return fmt.Errorf("%w (every connection of the pool was in use when the deadline passed: the handler is probably "+
			"writing through the pool (db) instead of the transaction from TxFromContext, and waited for a connection "+
			"that the messages in flight hold; write through the transaction)", err)
	}
	return err
}

// failedTxHint is the hint for a transaction that a statement of the
// handler failed in, while the handler returned nil: PostgreSQL aborts the
// transaction at the failed statement, refuses every later one (SQLSTATE
// 25P02) and turns the COMMIT into ROLLBACK, and the error the inbox then
// met (the COMMIT's "commit unexpectedly resulted in rollback", an outbox
// write's 25P02) did not name the cause.
const failedTxHint = "a statement of the handler failed and the handler returned nil without its error, and PostgreSQL " +
	"aborts the transaction at a failed statement: nothing was written, and the message is redelivered; return the " +
	"statement's error, or run a statement that may fail inside a SAVEPOINT and roll back to it"

// failedTxError returns err, from the COMMIT or an outbox write after the
// handler returned nil, with failedTxHint when the transaction had failed:
// the pre-commit check saw PostgreSQL's failed status ('E'), or the write
// got 25P02. Any other error comes back as it is.
func (d *delivery) failedTxError(err error) error {
	if err == nil {
		return nil
	}
	if a, ok := d.tx.(interface{ abortedBeforeCommit() bool }); (ok && a.abortedBeforeCommit()) || hasSQLState(err, "25P02") {
		return fmt.Errorf("%w (the transaction had failed before the COMMIT: %s)", err, failedTxHint)
	}
	return err
}

// poolWasFull reports whether every connection of the pool was in use when
// the message's context ended (or, if that has not been recorded yet, is
// now: the transaction still holds its connection then). Checked in this
// order, it cannot miss the moment: the record is written before the
// transaction's connection is released.
func (d *delivery) poolWasFull() bool {
	return d.ib.poolExhausted() || d.poolFullAtEnd.Load()
}

// sqlPoolExhausted reports whether every connection that db may open is in
// use (database/sql's DB.Stats); false for a pool without a limit.
func sqlPoolExhausted(db *sqlx.DB) bool {
	s := db.Stats()
	return s.MaxOpenConnections > 0 && s.InUse >= s.MaxOpenConnections
}

// misconfiguredError is the error of a delivery that met a missing or
// incompatible table (inbox or outbox) at message time: nothing about the
// message is wrong, and a redelivery succeeds once the table is fixed, so
// IsTransient reports true for it, and the poison filter
// !inbox.IsTransient(err) keeps such messages on their topic instead of
// draining it. The delivery waited before returning it (tableBackoff).
type misconfiguredError struct{ err error }

func (e *misconfiguredError) Error() string { return e.err.Error() }
func (e *misconfiguredError) Unwrap() error { return e.err }

// Bounds of the wait before a delivery that met a missing or incompatible
// table returns: it doubles with each consecutive such delivery, from
// tableRetryMin up to tableRetryMax, and starts again once the table check
// passes. It turns a broker's immediate redelivery of every nacked message
// (GoChannel, RabbitMQ) into a few checks a second instead of thousands.
const (
	tableRetryMin = 100 * time.Millisecond
	tableRetryMax = 5 * time.Second
)

// waitAfterTableError waits, before a delivery returns a table error, for
// the inbox's current backoff (see tableRetryMin) or until ctx ends.
func (ib *Inbox) waitAfterTableError(ctx context.Context) { ib.waitBackoff(ctx, &ib.tableFailures) }

// waitBackoff waits for the backoff of the n-th consecutive failure that
// failures counts (tableRetryMin doubling up to tableRetryMax), or until ctx
// ends.
func (ib *Inbox) waitBackoff(ctx context.Context, failures *atomic.Int32) {
	n := failures.Add(1)
	wait := tableRetryMax
	if n <= 7 {
		wait = min(tableRetryMin<<(n-1), tableRetryMax)
	}
	ib.hooks.tableBackoff(wait)
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}

// verifyOutboxTables checks that each of Config.OutboxTables exists,
// through q; an error wraps ErrTableNotFound and names the table and the
// fix.
func verifyOutboxTables(ctx context.Context, q sqlx.QueryerContext, d Dialect, tables []qualifiedName) error {
	for _, t := range tables {
		// checkTable reads the table's catalog entry first and reports a
		// missing table with ErrTableNotFound; the problems it finds in
		// the shape are an inbox table's, irrelevant to an outbox table.
		_, err := d.checkTable(ctx, q, t)
		switch {
		case errors.Is(err, ErrTableNotFound):
			return fmt.Errorf("%w: outbox table %q (Config.OutboxTables) does not exist: create it before the router "+
				"runs (inbox.Outbox's: InitializeSchema, inbox.OutboxSchemaSQL or \"inbox schema -outbox-table\"; "+
				"watermill-sql's publisher cannot create its own inside the message's transaction; see docs/outbox.md)",
				ErrTableNotFound, t.String())
		case err != nil:
			return fmt.Errorf("inbox: verify outbox table %q: %w", t.String(), err)
		}
	}
	return nil
}
