// Package backend is the seam between package inbox's per-message flow and a
// transaction backend other than database/sql: package pgxinbox plugs pgx's
// native API in here, so that the one flow (middleware.go) runs over it and
// users of MySQL or SQLite never compile pgx. It is internal: what crosses it
// changes with the flow.
package backend

import (
	"context"
	"errors"

	"github.com/ThreeDotsLabs/watermill/message"
)

// ErrKeyGone is what a backend's stored-fingerprint read returns when the
// key's row is no longer in the table: a purge deleted it after the claim
// found it processed (the claim does not lock a row it leaves alone).
var ErrKeyGone = errors.New("the key's row left the table after the claim found it")

// Statements are an inbox's SQL texts, built once by package inbox from its
// dialect and table. Placeholders are PostgreSQL's ($1, $2).
type Statements struct {
	// Begin starts the message's transaction, with the configured
	// isolation level.
	Begin string
	// KeyLock, when not empty, runs after Begin and before Claim with the
	// key's lock hash ($1, int64): the partitioned dialect's advisory lock.
	KeyLock string
	// Claim inserts the key if absent ($1 consumer, $2 message id); its rows
	// affected tell a claim (1) from a duplicate (0).
	Claim string
	// ClaimFingerprint is Claim that also stores the content's fingerprint
	// ($3, bytea), run when Claim.Fingerprint is set.
	ClaimFingerprint string
	// StoredFingerprint reads the fingerprint stored with a key ($1, $2),
	// NULL for a row written without one; no row when the key's row is
	// gone (the backend then returns ErrKeyGone).
	StoredFingerprint string
	// Held, when not empty, is the pre-commit check ($1, $2): a count of the
	// claim's row.
	Held string
}

// Claim is one delivery's request to begin its transaction and claim its
// key.
type Claim struct {
	// TxCtx is the transaction's context: BEGIN, the claim, the pre-commit
	// check and COMMIT run under it. It follows the message's context until
	// the handler returned nil, and then only the commit bound.
	TxCtx context.Context
	// Consumer and ID are the validated inbox key.
	Consumer, ID string
	// LockKey is the argument of Statements.KeyLock.
	LockKey int64
	// Fingerprint, when not nil, is the content's fingerprint: the claim
	// runs Statements.ClaimFingerprint with it.
	Fingerprint []byte
}

// Backend begins transactions and claims keys in them.
type Backend interface {
	// BeginClaim begins c's transaction and runs Statements.KeyLock (when
	// set) and Statements.Claim in it, in as few round trips as the backend
	// can, and returns the claim's rows affected. A non-nil Tx, also with an
	// error, is open: the flow rolls it back. An error says which step
	// failed with *StepError.
	BeginClaim(c *Claim) (Tx, int64, error)
}

// Tx is a claimed delivery's open transaction, as the flow drives it.
type Tx interface {
	// Handle is what the handler's context carries (pgxinbox.TxFromContext
	// returns it).
	Handle() any
	// Publisher returns the outbox publisher bound to the transaction, or
	// nil without an outbox factory.
	Publisher() (message.Publisher, error)
	// StillClaimed runs Statements.Held (true when it is empty).
	StillClaimed(ctx context.Context, consumer, id string) (bool, error)
	// StoredFingerprint runs Statements.StoredFingerprint: nil for NULL
	// and for no row. The flow calls it on a duplicate only, and rolls the
	// transaction back right after, whatever it returns: a backend may
	// send the ROLLBACK with the read (Rollback then only gives the
	// connection back).
	StoredFingerprint(ctx context.Context, consumer, id string) ([]byte, error)
	// Ended reports, without a round trip, whether the transaction has
	// already ended on the server before Commit (the handler committed or
	// rolled it back itself); false when unknown.
	Ended() bool
	// Commit commits under Claim.TxCtx.
	Commit() error
	// CommitWith runs query with args, the transaction's last statement,
	// and COMMIT in one round trip, under Claim.TxCtx. stmtErr is query's
	// error: COMMIT did not run and the transaction is still open (the flow
	// rolls it back); otherwise commitErr is COMMIT's, as Commit returns
	// it, and the connection is given back.
	CommitWith(query string, args []any) (stmtErr, commitErr error)
	// Rollback rolls back; after Commit or Rollback, and on a connection
	// the server has already closed (which ends the transaction), it does
	// nothing and returns nil. Commit and Rollback give the connection back;
	// no other method may touch it after that.
	Rollback() error
}

// Step names the statement of BeginClaim that failed.
type Step int

const (
	StepBegin   Step = iota // acquiring a connection or BEGIN
	StepKeyLock             // Statements.KeyLock
	StepClaim               // Statements.Claim
)

// StepError is a BeginClaim error with the step that failed; it wraps the
// driver's error.
type StepError struct {
	Step Step
	Err  error
}

func (e *StepError) Error() string { return e.Err.Error() }
func (e *StepError) Unwrap() error { return e.Err }

// Options are what a backend's package passes to package inbox's
// constructor with the core configuration.
type Options struct {
	// New makes the backend from the inbox's statements; its error is a
	// configuration error.
	New func(Statements) (Backend, error)
	// Outbox reports that the backend's Tx.Publisher returns an outbox
	// publisher: the handler's returned messages go there, as with
	// inbox.Config.Outbox.
	Outbox bool
	// PoolExhausted, when set, reports whether every connection of the
	// backend's pool is in use (for the hint on a handler's deadline);
	// without it the inbox reads its Config.DB's statistics.
	PoolExhausted func() bool
}

// NewInbox is package inbox's constructor for an inbox over a Backend, set
// by that package's init: a func(inbox.Config, Options) (*inbox.Inbox,
// error), held as any because this package cannot name package inbox's
// types.
var NewInbox any

// WritesInTx marks p, an outbox publisher of package inbox
// (Outbox.PublisherOn), as one that writes through the very transaction it
// was made for, so that the flow may send the handler's returned messages
// with COMMIT (Tx.CommitWith); set by package inbox's init.
var WritesInTx func(p message.Publisher)

// ReadsInTx gives p, an outbox publisher of package inbox
// (Outbox.PublisherOn), queryRow, which runs query with args in the
// transaction p was made for and scans its one row into dest: the inbox
// looks the outbox table's schema up through it before the handler runs;
// set by package inbox's init.
var ReadsInTx func(p message.Publisher, queryRow func(ctx context.Context, query string, args []any, dest ...any) error)

// MadeFor tells package inbox that p, an outbox publisher of its
// (Outbox.PublisherOn), was made for the transaction whose Tx.Handle is
// handle: a factory that wraps p in a decorator returns a publisher the
// inbox cannot see through, and the inbox still binds p to the delivery;
// set by package inbox's init.
var MadeFor func(p message.Publisher, handle any)

// HandleFromContext returns the Tx.Handle of the claimed delivery whose
// message context ctx is, and true; set by package inbox's init.
var HandleFromContext func(ctx context.Context) (any, bool)
