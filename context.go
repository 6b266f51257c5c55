package inbox

import (
	"context"
	"fmt"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"
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
// returns, the message context no longer carries it. Like the one
// connection under it, it is not safe for concurrent use: run the handler's
// statements, its ORM calls on the transaction and its outbox Publish calls
// from one goroutine at a time, all done before the handler returns.
// database/sql serialises each call, not a query and the reading of its
// rows (ORM inserts with RETURNING are queries too): another goroutine's
// statement in between fails on pgx's stdlib with "conn busy" or panics in
// the goroutine reading the rows (a panic on a goroutine of the handler's,
// which Watermill's Recoverer does not catch: the process exits), and
// breaks a go-sql-driver/mysql connection ("busy buffer").
//
// With package pgxinbox the transaction is a pgx.Tx: this returns nil and
// false there, and pgxinbox.TxFromContext returns it. When it returns
// false, return MissingTxError(ctx) from the handler: it says which of these
// cases it is.
func TxFromContext(ctx context.Context) (*sqlx.Tx, bool) {
	s := stateFromContext(ctx)
	if s == nil || s.tx == nil {
		return nil, false
	}
	return s.tx, true
}

// MissingTxError returns the error a handler should return when
// TxFromContext(ctx) reports false, and nil when it reports true. The error
// wraps ErrNoTx and says why there is no *sqlx.Tx: the message was claimed
// by a pgxinbox.Inbox, whose transaction pgxinbox.TxFromContext returns; or
// ctx carries no inbox transaction at all, because no Inbox's Middleware
// runs around the handler (add it with router.AddMiddleware, or to the
// handler) or ctx is not msg.Context(). The router nacks the message; the
// error is not transient (IsTransient): every redelivery meets the same
// setup. It is safe for concurrent use.
//
//	tx, ok := inbox.TxFromContext(msg.Context())
//	if !ok {
//		return inbox.MissingTxError(msg.Context())
//	}
func MissingTxError(ctx context.Context) error {
	s := stateFromContext(ctx)
	switch {
	case s != nil && s.tx != nil:
		return nil
	case s != nil && s.handle != nil:
		return fmt.Errorf("%w: the message was claimed by a pgxinbox.Inbox, whose transaction is a pgx.Tx: "+
			"call pgxinbox.TxFromContext, or, for code on database/sql (GORM, ent, bun, sqlc's database/sql queries), make "+
			"the Inbox with inbox.New on the pool's *sql.DB (pgxinbox.DB(pool)) for a *sqlx.Tx", ErrNoTx)
	}
	return fmt.Errorf("%w: no Inbox.Middleware runs around this handler (add it with router.AddMiddleware(ib.Middleware) "+
		"or to the handler), or the context is not msg.Context()", ErrNoTx)
}

// txState is what the middleware keeps in a claimed message's context.
type txState struct {
	tx        *sqlx.Tx          // with the database/sql backend
	handle    any               // with a native backend: its transaction (a pgx.Tx)
	publisher message.Publisher // from the outbox factory; nil without one
	// writers are the outbox writers of this package that the factory made
	// for the transaction: publisher itself, or the ones it wraps (a
	// decorator). The middleware binds them to the delivery.
	writers []txBoundPublisher

	mu          sync.Mutex
	afterCommit []func()
	ended       bool // the transaction has ended: AfterCommit refuses
}

// end marks the transaction ended and returns the after-commit functions.
func (s *txState) end() []func() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.ended = true
	fs := s.afterCommit
	s.afterCommit = nil
	return fs
}

// stateFromContext returns the state of the claimed delivery whose message
// context ctx is, or nil.
func stateFromContext(ctx context.Context) *txState {
	s, _ := ctx.Value(txKey{}).(*txState)
	return s
}

func contextWithTx(ctx context.Context, s *txState) context.Context {
	return context.WithValue(ctx, txKey{}, s)
}

// OutboxFromContext returns the outbox publisher bound to the inbox
// transaction of the message being handled (made by Config.Outbox once per
// message, right after the claim), and true; or nil and false when ctx
// carries no inbox transaction or no Config.Outbox is set. Messages
// published through it are written in the inbox transaction: they are sent
// (by the forwarder or outbox relay) if the transaction commits, and never
// if it rolls back. Like the transaction, it is only valid until the
// handler returns, and not for concurrent use: its Publish calls are
// statements on the transaction, to make one goroutine at a time with the
// handler's others (see TxFromContext).
func OutboxFromContext(ctx context.Context) (message.Publisher, bool) {
	s, ok := ctx.Value(txKey{}).(*txState)
	if !ok || s == nil || s.publisher == nil {
		return nil, false
	}
	return s.publisher, true
}

// AfterCommit registers f to run after the inbox transaction of the message
// being handled (ctx is msg.Context()) has committed, and reports whether it
// was registered: false when ctx carries no inbox transaction, or one that
// has already ended (a context kept past the handler, or a call from an
// after-commit function). Use it for side
// effects that cannot join the transaction and may happen at most once: a
// cache purge, a metric, a notification that is only a hint.
//
// Registered functions run in order, on the handler's goroutine, after a
// successful COMMIT, before Config.OnProcessed and before the router acks;
// never after a rollback, a failed commit or for a duplicate. The trade-off: if the process dies
// between the commit and f, f never runs (the redelivery is skipped as a
// duplicate), and neither does it when the connection is lost after COMMIT
// was sent and the server did commit (a COMMIT in doubt: the middleware
// reports the failure, calls OnFailed, and the redelivery is skipped), so
// anything that must happen goes to the outbox instead (OutboxFromContext),
// before the handler returns: a Publish from f writes nothing and fails with
// an error wrapping sql.ErrTxDone. A panic in f is recovered and logged at Error, the
// remaining functions still run, and the message is still acked: its
// transaction has committed.
func AfterCommit(ctx context.Context, f func()) bool {
	s, ok := ctx.Value(txKey{}).(*txState)
	if !ok || s == nil {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ended {
		return false
	}
	s.afterCommit = append(s.afterCommit, f)
	return true
}

// ContextOutbox is a message.Publisher that publishes each message through
// the outbox of the inbox transaction in the message's own context
// (msg.Context(); see OutboxFromContext). It is the bridge for code that
// publishes through a publisher it was given instead of returning messages
// from the handler, chiefly Watermill's CQRS EventBus, whose
// Publish(ctx, event) sets ctx on the message it publishes:
//
//	eventBus, err := cqrs.NewEventBusWithConfig(inbox.ContextOutbox{}, cqrs.EventBusConfig{…})
//	// in a CQRS event handler: eventBus.Publish(ctx, &InvoiceIssued{…})
//
// The events are then written in the handled message's transaction and sent
// by the forwarder if and only if it commits. A message whose context has no
// such outbox fails with ErrNoOutbox, and that message and the ones after
// it are not published. It works with package inbox and with package
// pgxinbox. The zero value is ready to use and safe for concurrent use;
// Close does nothing.
type ContextOutbox struct{}

// Publish publishes msgs, in order, each through the outbox in its context.
func (ContextOutbox) Publish(topic string, msgs ...*message.Message) error {
	for _, msg := range msgs {
		pub, ok := OutboxFromContext(msg.Context())
		if !ok {
			return fmt.Errorf("%w (message %q to topic %q: publish it with the handled message's context, from its handler)", ErrNoOutbox, msg.UUID, topic)
		}
		if err := pub.Publish(topic, msg); err != nil {
			return err
		}
	}
	return nil
}

// Close does nothing: the outboxes belong to their transactions.
func (ContextOutbox) Close() error { return nil }

var _ message.Publisher = ContextOutbox{}
