package pgxinbox

import (
	"context"
	"errors"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/watermill-inbox/inbox/internal/backend"
)

// pgxBackend begins each message's transaction with pgx's Batch.BeginTx:
// BEGIN, the partitioned dialect's key lock and the claim go to the server
// in one batch (one round trip in every query exec mode), and the
// transaction that comes back is pgx's own, on a connection the pool keeps
// acquired until it commits or rolls back.
type pgxBackend struct {
	pool            *pgxpool.Pool
	st              backend.Statements
	begin           pgx.TxOptions // BeginQuery: st.Begin
	outbox          func(pgx.Tx) (message.Publisher, error)
	rollbackTimeout time.Duration
}

func (b *pgxBackend) BeginClaim(c *backend.Claim) (backend.Tx, int64, error) {
	// The connection is acquired here and released by Commit or Rollback
	// only: a handler that ends the transaction itself (tx.Commit,
	// tx.Rollback) does not give it back to the pool, so that the
	// pre-commit check and the rollback never touch a connection that
	// already serves another message.
	conn, err := b.pool.Acquire(c.TxCtx)
	if err != nil {
		return nil, 0, &backend.StepError{Step: backend.StepBegin, Err: err}
	}
	// The batch, its queue and the claim's queued query and arguments live
	// in t: one allocation instead of six.
	t := &pgxTx{b: b, conn: conn, ctx: c.TxCtx}
	batch := &t.batch
	batch.QueuedQueries = t.queued[:0]
	batch.BeginTx(b.begin)
	if b.st.KeyLock != "" {
		t.lockArgs[0] = c.LockKey
		t.lock = pgx.QueuedQuery{SQL: b.st.KeyLock, Arguments: t.lockArgs[:]}
		batch.QueuedQueries = append(batch.QueuedQueries, &t.lock)
	}
	t.claimArgs = [3]any{c.Consumer, c.ID, c.Fingerprint}
	if c.Fingerprint != nil {
		t.claim = pgx.QueuedQuery{SQL: b.st.ClaimFingerprint, Arguments: t.claimArgs[:]}
	} else {
		t.claim = pgx.QueuedQuery{SQL: b.st.Claim, Arguments: t.claimArgs[:2]}
	}
	batch.QueuedQueries = append(batch.QueuedQueries, &t.claim)
	br := conn.SendBatch(c.TxCtx, batch)
	// Tx is never nil for a batch that began one; when the batch fails
	// before BEGIN it is closed, and Rollback releases the connection.
	t.tx = br.Tx()
	if _, err := br.Exec(); err != nil {
		br.Close()
		return t, 0, &backend.StepError{Step: backend.StepBegin, Err: err}
	}
	if b.st.KeyLock != "" {
		if _, err := br.Exec(); err != nil {
			br.Close()
			return t, 0, &backend.StepError{Step: backend.StepKeyLock, Err: err}
		}
	}
	tag, err := br.Exec()
	if err == nil {
		err = br.Close()
	} else {
		br.Close()
	}
	if err != nil {
		return t, 0, &backend.StepError{Step: backend.StepClaim, Err: err}
	}
	return t, tag.RowsAffected(), nil
}

// pgxTx is one message's transaction, with the batch that began it.
type pgxTx struct {
	b *pgxBackend
	// conn is the pool connection the transaction runs on, acquired by
	// BeginClaim; nil once Commit or Rollback released it: from then on it
	// may serve another message and must not be touched.
	conn *pgxpool.Conn
	tx   pgx.Tx
	ctx  context.Context // backend.Claim.TxCtx

	batch       pgx.Batch
	queued      [3]*pgx.QueuedQuery
	lock, claim pgx.QueuedQuery
	lockArgs    [1]any
	claimArgs   [3]any
	// ended is set once the connection is released: the handler's
	// pgx.Tx (handlerTx) refuses statements from then on.
	ended atomic.Bool
	// failedSeen: Ended found the transaction failed ('E'), so that the
	// COMMIT's pgx.ErrTxCommitRollback can say why (Failed). Atomic: the
	// handler's goroutines may publish to the outbox, which asks Ended, at
	// once.
	failedSeen atomic.Bool
}

// Handle is the handler's pgx.Tx (TxFromContext): the transaction,
// refusing statements once the inbox has ended it (handlerTx). Every call
// returns an equal value: the key the outbox factory's publishers are
// bound to the delivery by (backend.MadeFor).
func (t *pgxTx) Handle() any { return t.handlerTx() }

func (t *pgxTx) handlerTx() handlerTx { return handlerTx{Tx: t.tx, ended: &t.ended} }

// Publisher calls the outbox factory with the handler's pgx.Tx, so that its
// writes are refused once the transaction has ended, as the handler's are.
func (t *pgxTx) Publisher() (message.Publisher, error) {
	if t.b.outbox == nil {
		return nil, nil
	}
	return t.b.outbox(t.handlerTx())
}

func (t *pgxTx) StillClaimed(ctx context.Context, consumer, id string) (bool, error) {
	if t.b.st.Held == "" {
		return true, nil
	}
	var n int
	err := t.tx.QueryRow(ctx, t.b.st.Held, consumer, id).Scan(&n)
	return n > 0, err
}

// StoredFingerprint reads the stored fingerprint and rolls the transaction
// back in one batch: one round trip, so that a duplicate costs what it did
// before the fingerprints (BEGIN with the claim, then ROLLBACK). The flow
// rolls a duplicate back whatever the read returns; Rollback then finds no
// transaction open and only gives the connection back. The handler never
// had this transaction, so nothing else can use it afterwards.
func (t *pgxTx) StoredFingerprint(ctx context.Context, consumer, id string) ([]byte, error) {
	var batch pgx.Batch
	batch.Queue(t.b.st.StoredFingerprint, consumer, id)
	batch.Queue("rollback")
	br := t.tx.SendBatch(ctx, &batch)
	var fp []byte
	err := br.QueryRow().Scan(&fp)
	if errors.Is(err, pgx.ErrNoRows) {
		err = backend.ErrKeyGone // a purge deleted the row after the claim saw it
	}
	if _, rbErr := br.Exec(); err == nil {
		err = rbErr
	}
	if closeErr := br.Close(); err == nil {
		err = closeErr
	}
	return fp, err
}

// Ended reports whether the server said, in its last ReadyForQuery, that no
// transaction is open on the connection (pgconn's TxStatus 'I'): the
// handler ended it, with tx.Commit, tx.Rollback or a COMMIT or ROLLBACK
// statement. No round trip. A failed transaction ('E') is not ended: its
// COMMIT reports pgx.ErrTxCommitRollback.
func (t *pgxTx) Ended() bool {
	if t.conn == nil {
		return false
	}
	status := t.conn.Conn().PgConn().TxStatus()
	// As of this check: a rollback to a savepoint recovers a failed one.
	t.failedSeen.Store(status == 'E')
	return status == 'I'
}

// Failed reports whether the last Ended found the transaction failed
// (pgconn's TxStatus 'E': a statement failed in it, and COMMIT rolls it
// back).
func (t *pgxTx) Failed() bool { return t.failedSeen.Load() }

// Commit commits under the transaction's context, which the commit bound
// ends, and releases the connection. pgx closes the connection when COMMIT
// fails outside an idle state and reports pgx.ErrTxCommitRollback when
// PostgreSQL turned the COMMIT into a ROLLBACK.
func (t *pgxTx) Commit() error {
	err := t.tx.Commit(t.ctx)
	t.release()
	return err
}

// CommitWith sends query and COMMIT in one batch: one round trip in every
// query exec mode (one Sync in the extended protocol's modes; one
// multi-statement Query in simple_protocol), and the server skips the
// COMMIT when query fails. The connection is released after COMMIT as by
// Commit (the pool destroys one that is still in a transaction); after a
// failed query it stays for Rollback.
func (t *pgxTx) CommitWith(query string, args []any) (stmtErr, commitErr error) {
	var batch pgx.Batch
	batch.Queue(query, args...)
	batch.Queue("commit")
	br := t.tx.SendBatch(t.ctx, &batch)
	_, stmtErr = br.Exec()
	var tag pgconn.CommandTag
	if stmtErr == nil {
		tag, commitErr = br.Exec()
	}
	closeErr := br.Close()
	if stmtErr != nil {
		return stmtErr, nil
	}
	if commitErr == nil {
		commitErr = closeErr
	}
	if commitErr == nil && tag.String() == "ROLLBACK" {
		commitErr = pgx.ErrTxCommitRollback
	}
	t.release()
	return nil, commitErr
}

// Rollback rolls back and releases the connection. It runs under its own
// bound, not the transaction's context, which may have ended (the
// message's deadline): a ROLLBACK that could not be sent would make pgx
// close a healthy connection. A transaction already ended (committed, rolled
// back by the handler, never begun: pgx.ErrTxClosed) is not an error; a
// connection closed before the transaction ended is (errConnLost), so that
// the delivery's error is transient. After Commit or Rollback it does
// nothing: the connection is back in the pool.
func (t *pgxTx) Rollback() error {
	if t.conn == nil {
		return nil
	}
	defer t.release()
	if t.tx != nil && t.conn.Conn().IsClosed() {
		// The connection went before the transaction ended (a pooler
		// killed, a network cut): the server rolls back what was not
		// committed, and the error says the message is not at fault. A
		// handler's statement then failed with a bare io.ErrUnexpectedEOF,
		// which nothing else marks transient, and the message was
		// poisoned unprocessed.
		return errConnLost
	}
	if t.tx == nil || t.conn.Conn().PgConn().TxStatus() == 'I' {
		// Never begun, or no transaction open on the connection any more
		// (StoredFingerprint's batch rolled it back, or the handler ended
		// it): nothing to roll back.
		return nil
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(t.ctx), t.b.rollbackTimeout)
	defer cancel()
	if err := t.tx.Rollback(ctx); err != nil && !errors.Is(err, pgx.ErrTxClosed) {
		return err
	}
	return nil
}

// errConnLost is Rollback's error for a transaction whose connection was
// closed before it ended: the inbox makes a rollback's error transient.
var errConnLost = errors.New("pgxinbox: the connection was closed before the transaction ended (lost: nothing of it committed but a COMMIT already sent)")

// release gives the connection back to the pool, which destroys it if it
// is closed, busy or still in a transaction (a handler's BEGIN statement).
func (t *pgxTx) release() {
	t.ended.Store(true)
	if t.conn != nil {
		t.conn.Release()
		t.conn = nil
	}
}
