package inbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox/internal/backend"
)

// A backend other than database/sql (package pgxinbox) reaches the one flow
// through internal/backend: it makes the Inbox with newNativeInbox, and
// nativeBackend adapts it to txBackend.
func init() {
	backend.NewInbox = newNativeInbox
	backend.WritesInTx = func(p message.Publisher) {
		if w, ok := p.(*outboxWriter); ok {
			w.inTx = true
		}
	}
	backend.ReadsInTx = func(p message.Publisher, queryRow func(ctx context.Context, query string, args []any, dest ...any) error) {
		if w, ok := p.(*outboxWriter); ok {
			w.lookUp = queryRow // run by bindTx, before the handler
		}
	}
	backend.MadeFor = func(p message.Publisher, handle any) {
		if w, ok := p.(*outboxWriter); ok {
			writerMadeFor(handle, w)
		}
	}
	backend.HandleFromContext = func(ctx context.Context) (any, bool) {
		s := stateFromContext(ctx)
		if s == nil || s.handle == nil {
			return nil, false
		}
		return s.handle, true
	}
}

// newNativeInbox is New for an inbox whose messages' transactions go
// through a backend made by opts.New; cfg.DB serves everything else (the
// table check, InitializeSchema, Verify, the key lock's table name) and must
// reach the same database (pgxinbox passes its pool through pgx's
// database/sql adapter). cfg.Outbox must be nil: the backend has its own.
func newNativeInbox(cfg Config, opts backend.Options) (*Inbox, error) {
	if cfg.Outbox != nil {
		return nil, fmt.Errorf("%w: Config.Outbox takes a *sqlx.Tx; this backend has its own outbox factory", ErrInvalidConfig)
	}
	ib, err := New(cfg)
	if err != nil {
		return nil, err
	}
	begin, ok := ib.dialect.nativeBegin(ib.txOptions)
	if !ok {
		return nil, fmt.Errorf("%w: dialect %s is not supported by this backend", ErrInvalidConfig, ib.dialect)
	}
	st := backend.Statements{Begin: begin, Claim: ib.claimSQL, ClaimFingerprint: ib.claimFingerprintSQL,
		StoredFingerprint: ib.storedFingerprint}
	if ib.locksKeys {
		st.KeyLock = ib.keyLockSQL
	}
	if ib.checksHeld {
		st.Held = ib.heldSQL
	}
	b, err := opts.New(st)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	ib.backend = nativeBackend{ib: ib, b: b}
	ib.hasOutbox = opts.Outbox
	if opts.PoolExhausted != nil {
		ib.poolExhausted = opts.PoolExhausted
	}
	ib.prepare = false // the backend decides how its statements are sent
	return ib, nil
}

// nativeBackend runs a delivery's transaction through a backend.Backend.
type nativeBackend struct {
	ib *Inbox
	b  backend.Backend
}

func (n nativeBackend) beginClaim(d *delivery) (claimedTx, bool, error) {
	ib := n.ib
	lock, err := ib.beforeBegin(d)
	if err != nil {
		return nil, false, err
	}
	c := &d.nativeClaim
	d.fingerprint = ib.deliveryFingerprint(d)
	*c = backend.Claim{TxCtx: d.txCtx, Consumer: d.consumer, ID: d.id, Fingerprint: d.fingerprint}
	if ib.locksKeys {
		// The backend sends the key lock and the claim in one batch
		// with BEGIN, so it has no use for lock.lockedClaim.
		c.LockKey = keyLockHash(lock.table, d.consumer, d.id)
	}
	d.txStart = time.Now() // Event.Duration: from here, the wait for a connection included
	tx, rows, err := n.b.BeginClaim(c)
	var t *nativeTx
	if tx != nil {
		t = &d.nativeTx
		*t = nativeTx{tx: tx}
		ib.hooks.begun()
	}
	if err != nil {
		var step *backend.StepError
		errors.As(err, &step)
		switch {
		case step != nil && step.Step == backend.StepKeyLock:
			err = d.failedBegin(fmt.Errorf("inbox: lock key %q/%q: %w", d.consumer, d.id, err))
		case step != nil && step.Step == backend.StepClaim && isReadOnlyRefusal(err):
			err = d.readOnlyClaim(err)
		case step != nil && step.Step == backend.StepClaim && isMissingPartition(err, d.ib.table.name):
			err = d.missingPartitionClaim(err)
		case step != nil && step.Step == backend.StepClaim && isPrivilegeRefusal(err):
			err = d.refusedPrivilegeClaim(err)
		case isUndefinedTable(err):
			// At any step: pgx prepares a batch's statements before it
			// sends any, so on a connection that had not prepared the
			// claim yet its missing table comes back as BEGIN's error.
			err = d.missingTableClaim(err)
		case step != nil && step.Step == backend.StepClaim:
			err = fmt.Errorf("inbox: claim %q/%q in table %s: %w", d.consumer, d.id, ib.table, poolerHint(err))
		default:
			err = d.failedBegin(fmt.Errorf("inbox: begin transaction for %q/%q: %w", d.consumer, d.id, withCause(d.txCtx, poolerHint(err))))
		}
		if t == nil {
			return nil, false, err // not a nil *nativeTx in a non-nil claimedTx
		}
		return t, false, err
	}
	ib.claimSucceeded()
	claimed, ok := ib.dialect.claimed(rows)
	if !ok {
		return t, false, fmt.Errorf("%w: %d (claim %q/%q)", ErrUnexpectedRowsAffected, rows, d.consumer, d.id)
	}
	return t, claimed, nil
}

// nativeTx is a delivery's transaction through a backend.Backend.
type nativeTx struct{ tx backend.Tx }

func (t *nativeTx) newState(_ *Inbox, s *txState) error {
	s.handle = t.tx.Handle()
	return s.setPublisher(s.handle, t.tx.Publisher)
}

func (t *nativeTx) stillClaimed(ctx context.Context, consumer, id string) (bool, error) {
	return t.tx.StillClaimed(ctx, consumer, id)
}

func (t *nativeTx) storedFingerprint(ctx context.Context, consumer, id string) ([]byte, error) {
	return t.tx.StoredFingerprint(ctx, consumer, id)
}

func (t *nativeTx) ended() bool { return t.tx.Ended() }

// abortedBeforeCommit reports whether the backend's pre-commit check found
// the transaction failed (pgxinbox: PostgreSQL's 'E').
func (t *nativeTx) abortedBeforeCommit() bool {
	f, ok := t.tx.(interface{ Failed() bool })
	return ok && f.Failed()
}
func (t *nativeTx) commit() error { return t.tx.Commit() }

func (t *nativeTx) commitWith(query string, args []any) (stmtErr, commitErr error) {
	return t.tx.CommitWith(query, args)
}
func (t *nativeTx) rollback() error { return t.tx.Rollback() }

// Compile-time checks: both backends satisfy the flow's interfaces.
var (
	_ txBackend = nativeBackend{}
	_ txBackend = sqlBackend{}
	_ claimedTx = (*nativeTx)(nil)
	_ claimedTx = (*sqlTx)(nil)

	_ lastStatementCommitter = (*nativeTx)(nil)
)
