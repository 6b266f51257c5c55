package inbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/watermill-inbox/inbox/internal/backend"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
)

// Middleware is a Watermill handler middleware (message.HandlerMiddleware)
// that makes h an idempotent consumer: for each consumer and message id,
// h's writes commit once, in one transaction with the inbox row, and a
// duplicate is acked without calling h. Add it once, to a router with
// router.AddMiddleware(ib.Middleware) or to one handler with
// handler.AddMiddleware(ib.Middleware). The package documentation describes
// the flow step by step (validate, begin, claim, duplicate?, handler,
// outbox, pre-commit check, commit, after-commit) and what a duplicate, a
// handler error, a panic, a failed commit and a deadline do.
//
// Order: put it inside (after) Recoverer, PoisonQueue, Retry and Timeout,
// so that each retry gets a fresh transaction, a poisoned message is not
// marked processed, and a deadline ends a handler stuck on the pool. The
// inbox cannot detect the reverse order.
//
// Errors: a duplicate returns nil, nil. Every error below can be matched
// with errors.Is or errors.As:
//   - h's own error, returned after the rollback: as it is, or wrapped with
//     a hint when it is the symptom of a known mistake (SQLSTATE 25P02, an
//     earlier failed statement, as with Retry inside the inbox; a deadline
//     while every connection of the pool is in use, as with a handler
//     writing through DB instead of the transaction);
//   - ErrNestedInbox (transient, after a wait: a setup mistake),
//     ErrInvalidConsumer (with ErrEmptyConsumer) and ErrInvalidMessageID
//     (with ErrEmptyMessageID or ErrMessageIDTooLong): refused before
//     anything is written; an error from Config.MessageID comes back
//     wrapped;
//   - ErrTableNotFound, ErrIncompatibleTable: the table check before the
//     first claim failed, for the inbox table or one of
//     Config.OutboxTables, or the dialect is for another server
//     (ErrDialectMismatch) (transient, after a wait that grows from 100 ms
//     to 5 s over consecutive such deliveries; add RouterPlugin to the
//     router to fail at startup instead);
//   - ErrTransactionEnded (h committed or rolled back the transaction
//     itself and returned nil: a bug in h; the message is nacked, never
//     acked), ErrTxRolledBack (MySQL/MariaDB had already rolled the
//     transaction back), ErrCommitTimeout (the commit phase outlived
//     Config.CommitTimeout; in doubt), ErrUnexpectedRowsAffected;
//   - the message context's cause (context.DeadlineExceeded,
//     context.Canceled) when it ended before h returned;
//   - database errors, wrapped with the operation and the key, so that
//     errors.As reaches the driver's error type; outbox errors, wrapped;
//     ErrInvalidConfig (transient: the message waits for the fix) for
//     messages h returned without a publish topic while Config.Outbox is
//     set, or with a publish topic and no publisher while it is not.
//
// IsTransient tells the errors worth a redelivery from the others. An error
// means the transaction did not commit or, for a COMMIT in doubt
// (transient), may have: the redelivery settles it.
//
// Concurrency: it is safe for concurrent use, and every handler goroutine
// may run it at once; each message in flight holds one pooled connection of
// Config.DB for its transaction. A delivery of a key that is in flight
// elsewhere waits until that transaction ends. Config.MessageID, Outbox and
// the hooks are called from all these goroutines at once.
//
// Context: h finds the transaction in msg.Context() (TxFromContext), valid
// until h returns. When the middleware returns, msg.Context() is again the
// context the message came in with. Once h returned nil, the message's
// deadline no longer ends the transaction: COMMIT runs under
// Config.CommitTimeout, and a committed message is acked.
func (ib *Inbox) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		d := delivery{ib: ib, msg: msg, handler: h, ctx: msg.Context(), span: noSpan}
		return d.handle()
	}
}

// noSpan is a delivery's span without Config.TracerProvider: every call on
// it does nothing.
var noSpan = trace.SpanFromContext(context.Background())

// delivery is one message's way through the inbox. run reads top to bottom;
// end is its one deferred cleanup (the rollback included); report is the one
// place its outcome goes to the hooks, the span and the log.
type delivery struct {
	ib      *Inbox
	msg     *message.Message
	handler message.HandlerFunc
	ctx     context.Context // the message's context as it came in; restored by end
	sctx    context.Context // ctx with the inbox span: the statements and the handler run under it
	span    trace.Span      // noSpan without tracing
	// txStart is when BEGIN was sent (beginClaim, after Config.Fingerprint; zero: no transaction
	// began, the message refused before it), txEnd when the COMMIT or
	// ROLLBACK returned: Event.Duration.
	txStart, txEnd time.Time

	consumer, id string // the inbox key, once validated

	// The transaction lives on txCtx: sctx's values, and sctx's end until
	// the handler has returned (a deadline then rolls the transaction back
	// and ends a handler stuck on the pool), but not once the handler
	// returned nil: from there only Config.CommitTimeout ends it, so that a
	// deadline firing during COMMIT cannot make a committed message look
	// failed.
	txCtx         context.Context
	cancelTx      context.CancelCauseFunc
	followMessage func() bool // stops txCtx from following sctx; false if sctx had already ended
	// poolFullAtEnd records, when sctx ends before the handler returned,
	// whether every connection of the pool was in use then, before the
	// transaction's end releases its own (handlerErrorHint).
	poolFullAtEnd atomic.Bool
	commitBound   *time.Timer

	tx claimedTx // nil before BEGIN
	// The values behind tx (with the database/sql backend) and state, kept
	// here so that they cost no allocation of their own.
	sqlTx       sqlTx
	nativeClaim backend.Claim
	nativeTx    nativeTx
	stateValue  txState
	state       *txState // what the handler's context carries; nil until claimed
	duplicate   bool
	reused      bool // processed before with other content (checkReusedID)
	// lastWrite is the INSERT of the handler's returned messages when the
	// transaction sends it with its COMMIT (stageLast, commitWith).
	lastWrite struct {
		committer lastStatementCommitter
		writer    txBoundPublisher
		topic     string
		messages  int
		query     string
		args      []any
	}
	// claimHeldByOutbox: the returned messages' claimed INSERTs, the last
	// statements before the pre-commit check, found the claim held
	// (outboxWriter.publishLast), so the check need not read it again.
	claimHeldByOutbox bool
	fingerprint       []byte        // the content's, stored by the claim; nil with the fingerprints off
	claimFailed       bool          // BEGIN or the claim failed after the fingerprint was taken (recheckFingerprintColumn)
	oddFingerprint    bool          // the duplicate's stored fingerprint is not 16 bytes (settleOddFingerprint)
	waitAfterEnd      *atomic.Int32 // the database refused the claim as read-only: wait (waitBackoff on it) once rolled back
	// userCode names the user code running, for the report of a panic in
	// it: "Config.MessageID", "Config.Fingerprint", "Config.Outbox"; "" is
	// the handler.
	userCode string
}

// handlerKey names the delivery's handler (the router's handler name, and
// the consumer), for what is counted per handler: one Inbox added with
// router.AddMiddleware serves every handler of the router.
func (d *delivery) handlerKey() string {
	return message.HandlerNameFromCtx(d.ctx) + "\x00" + d.consumer
}

// panicked names what panicked in a delivery that did not return: the
// handler unless other user code was running (delivery.userCode).
func (d *delivery) panicked() string {
	if d.userCode != "" {
		return d.userCode
	}
	return "handler"
}

// handle runs the delivery and reports its outcome, whether run returned or
// user code (the Outbox factory, the handler, the outbox publisher)
// panicked: a panic is not recovered here, so that it goes on, with the
// handler's stack intact, to Recoverer or the router, which nack.
func (d *delivery) handle() (produced []*message.Message, err error) {
	returned := false
	defer func() {
		rbErr := d.end()
		if !returned {
			d.rememberChangedFingerprint()
			if rbErr != nil {
				d.ib.logger.get().Error("Inbox rollback failed after a panic in the "+d.panicked(), rbErr, d.fields())
			}
			// Named, so that OnFailed and the span point at the code that
			// panicked: a panic in Config.Fingerprint was reported as the
			// handler's, which was never called.
			d.report(fmt.Errorf("inbox: %s panicked on %q/%q", d.panicked(), d.consumer, d.id), true)
			if d.sctx != nil && d.sctx.Err() != nil {
				// A panic with sql.ErrTxDone after the message context
				// ended (sqlx's MustExec, which takes no context, on the
				// transaction database/sql rolled back then) is what
				// returning that error is (see run): the context's end is
				// added to the panic's value, so that IsTransient sees
				// it through Recoverer's RecoveredPanicError (the message
				// in flight at a deploy was poisoned). Any other panic
				// goes on as it is.
				if r := recover(); r != nil {
					if v, ok := r.(error); ok && errors.Is(v, sql.ErrTxDone) && !errors.Is(v, context.Cause(d.sctx)) {
						panic(fmt.Errorf("%w (the message context ended before the handler returned, and database/sql rolled the transaction back: %w)",
							v, d.contextEnd()))
					}
					panic(r)
				}
			}
			return
		}
		if rbErr != nil {
			// The key may be processed, but a failed rollback leaves the
			// connection in doubt: nack; the redelivery settles it.
			produced, err = nil, errors.Join(err, fmt.Errorf("inbox: rollback %q/%q: %w", d.consumer, d.id, &rollbackError{rbErr}))
		} else if d.claimFailed {
			// After the rollback: the check reads the catalog on a
			// connection of its own.
			err = d.ib.recheckFingerprintColumn(d, err)
		} else if d.oddFingerprint {
			err = d.ib.settleOddFingerprint(d) // the same
		}
		if err != nil {
			d.rememberChangedFingerprint()
		}
		if d.waitAfterEnd != nil {
			ctx := d.sctx
			if ctx == nil { // refused before its span began (validate)
				ctx = d.ctx
			}
			d.ib.waitBackoff(ctx, d.waitAfterEnd)
		}
		d.report(err, false)
	}()
	produced, err = d.run()
	returned = true
	return produced, err
}

// run is the flow of one message: validate → begin → claim → duplicate? →
// handler → outbox → pre-commit check → commit → after-commit. An error
// returned before the commit leaves the transaction to end's rollback.
func (d *delivery) run() ([]*message.Message, error) {
	if err := d.validate(); err != nil {
		return nil, err
	}
	d.startSpan()
	d.begin()
	tx, claimed, err := d.ib.backend.beginClaim(d)
	if tx != nil {
		d.tx = tx // open: end rolls it back unless it commits
	}
	if err != nil {
		d.claimFailed = d.fingerprint != nil
		if hasSQLState(err, "26000", "42P05") {
			err = d.staleStatement(err)
		}
		return nil, err
	}
	if !claimed {
		if err := d.checkReusedID(); err != nil {
			return nil, err
		}
		d.span.AddEvent("inbox.duplicate")
		d.duplicate = true
		return nil, nil // already processed: end rolls back, the router acks
	}
	d.span.AddEvent("inbox.claimed")

	produced, err := d.runHandler()
	if err != nil {
		// The handler's error, so that errors.Is/As match it, with a hint
		// when it is the symptom of a known mistake.
		err = d.handlerErrorHint(err)
		if errors.Is(err, ErrNoTx) {
			// The handler found no transaction of the kind it asks for
			// (MissingTxError): a setup mistake, transient; wait, so
			// that the broker's redeliveries do not spin.
			d.waitAfterEnd = &d.ib.refusedClaims
		}
		if d.sctx.Err() != nil && errors.Is(err, sql.ErrTxDone) && !errors.Is(err, context.Cause(d.sctx)) {
			// The message context ended before the handler returned (the
			// router's Close, a deadline), database/sql rolled the
			// transaction back then, and the handler's error is that
			// rollback's symptom: a statement it ran without the context
			// found the transaction done. The context's end is wrapped
			// too, so that IsTransient, and with it the poison filter,
			// sees it: a shutdown had such a message poisoned. Any other
			// error stays the handler's own (a permanent refusal returned
			// after a Timeout middleware's deadline is still poisoned).
			err = fmt.Errorf("%w (the message context ended before the handler returned, and database/sql rolled the transaction back: %w)", err, d.contextEnd())
		}
		// A handler that watches its context and returns why it ended
		// (context.Cause(ctx), wrapped or not) returns a cause of its own
		// alone when the context has one (errgroup.WithContext at a
		// shutdown, context.WithTimeoutCause): the context's end is added,
		// so that IsTransient sees it (such messages were poisoned).
		err = withContextEnd(d.sctx, err)
		return nil, err
	}
	if err := d.detach(); err != nil {
		return nil, err
	}
	if produced, err = d.publishToOutbox(produced); err != nil {
		return nil, err
	}
	d.endWrites()
	for _, w := range d.state.writers {
		if err := w.refusedWrite(); err != nil {
			// An output the handler published was refused for the
			// outbox table and the handler went on: committing would
			// lose it.
			return nil, err
		}
	}
	if err := d.checkStillClaimed(); err != nil {
		return nil, err
	}
	err = d.commit()
	d.txEnd = time.Now()
	if err != nil {
		return nil, err
	}
	for _, w := range d.state.writers {
		w.committed() // wakes this process's outbox relay
	}
	if d.ib.anyRefusedOutputs.Load() {
		if n, ok := d.ib.refusedOutputs.Load(d.handlerKey()); ok && n.(*atomic.Int32).Load() != 0 {
			n.(*atomic.Int32).Store(0)
		}
	}
	if d.fingerprint != nil {
		d.ib.recentFingerprints.remember(d.consumer, d.id, d.fingerprint)
	}
	d.runAfterCommit()
	return produced, nil
}

// endWrites has the delivery's outbox writers refuse every Publish from now
// on: the transaction is about to end. A Publish in progress on another
// goroutine finishes first, so that its outcome counts before the
// pre-commit check and the COMMIT.
func (d *delivery) endWrites() {
	if d.state == nil {
		return
	}
	for _, w := range d.state.writers {
		w.endWrites()
	}
}

// validate refuses a nested inbox and an invalid consumer or message id
// before anything is written.
func (d *delivery) validate() error {
	ib, msg := d.ib, d.msg
	if stateFromContext(d.ctx) != nil {
		// The inner claim would wait forever on the outer transaction's
		// uncommitted row of the same key. A setup mistake: transient,
		// after a wait, as a table error (a poison filter drained the
		// topic with it).
		d.waitAfterEnd = &ib.refusedClaims
		return &misconfiguredError{fmt.Errorf("%w (message %q): add it once, to the router or to the handler; Inbox.Middlewares already"+
			" holds ib.Middleware, so add either the one or the other", ErrNestedInbox, msg.UUID)}
	}
	d.consumer = ib.consumer
	if d.consumer == "" {
		d.consumer = message.HandlerNameFromCtx(d.ctx)
		if err := checkKey(d.consumer, ErrInvalidConsumer, ErrEmptyConsumer, nil); err != nil {
			return fmt.Errorf("%w (message %q: set Config.Consumer or run the middleware in a router)", err, msg.UUID)
		}
	}
	d.userCode = "Config.MessageID"
	id, err := ib.messageID(msg)
	d.userCode = ""
	if err != nil {
		return &wrapped{msg: fmt.Sprintf("inbox: message id of message %q", msg.UUID), err: err}
	}
	if err := checkKey(id, ErrInvalidMessageID, ErrEmptyMessageID, ErrMessageIDTooLong); err != nil {
		return fmt.Errorf("%w (message %q, consumer %q)", err, msg.UUID, d.consumer)
	}
	d.id = id
	return nil
}

// startSpan starts the inbox span, with Config.TracerProvider: every
// statement, and the handler, run under it, so that database and handler
// spans nest inside.
func (d *delivery) startSpan() {
	d.sctx = d.ctx
	if d.ib.tracer == nil {
		return
	}
	d.sctx, d.span = d.ib.tracer.Start(d.ctx, "inbox", trace.WithSpanKind(trace.SpanKindInternal), trace.WithAttributes(
		attribute.String("inbox.consumer", d.consumer),
		attribute.String("inbox.message_id", d.id),
		attribute.String("messaging.message.id", d.msg.UUID),
		attribute.String("db.system", d.ib.dialect.String()),
	))
}

// begin sets up the transaction's context (see delivery.txCtx).
func (d *delivery) begin() {
	d.txCtx, d.cancelTx = context.WithCancelCause(context.WithoutCancel(d.sctx))
	end := func() {
		d.poolFullAtEnd.Store(d.ib.poolExhausted())
		d.cancelTx(context.Cause(d.sctx))
	}
	if d.sctx.Err() != nil {
		// Ended already: AfterFunc would end txCtx from a goroutine of its
		// own, which BEGIN and the claim could outrun (a message whose
		// context had ended was then claimed and handled).
		end()
	}
	d.followMessage = context.AfterFunc(d.sctx, end)
}

// runHandler calls the Outbox factory and then the handler, with the
// transaction in the message's context.
func (d *delivery) runHandler() ([]*message.Message, error) {
	d.userCode = "Config.Outbox"
	err := d.tx.newState(d.ib, &d.stateValue)
	d.userCode = ""
	if err != nil {
		return nil, fmt.Errorf("inbox: outbox publisher for %q/%q: %w", d.consumer, d.id, err)
	}
	d.state = &d.stateValue
	if d.state.publisher != nil && len(d.state.writers) == 0 {
		// Another package's outbox publisher (watermill-sql's): it writes
		// whatever the transaction's state, so the inbox checks it first.
		d.state.publisher = &claimCheckedPublisher{next: d.state.publisher, check: d.checkBeforeForeignPublish}
	}
	if len(d.state.writers) > 0 {
		// Checked by the writers of the dialects whose inserts can read it
		// (outboxSQL.claimedInsert), and read by any after the handler
		// ended the transaction (outboxWriter.claimCommitted).
		claim := &outboxClaim{table: d.ib.quotedTable, consumer: d.consumer, id: d.id}
		var inboxDB *sql.DB // nil with a native backend (pgxinbox's pool)
		if d.ib.db != nil {
			inboxDB = d.ib.db.DB
		}
		unchecked := false
		for _, w := range d.state.writers {
			w.bindTx(d.txCtx, d.tx.ended, inboxDB, d.ib.preparesOn(), claim, d.ib.logger)
			unchecked = unchecked || !w.checksClaim()
		}
		if unchecked {
			// A writer through PublisherOn (an exec the application wraps)
			// cannot check the claim in its INSERT: after a deadlock the
			// handler ignored (MySQL/MariaDB) or SQLite's own rollback it
			// wrote in autocommit, as another package's publisher did.
			d.state.publisher = &claimCheckedPublisher{next: d.state.publisher, check: d.checkBeforeForeignPublish}
		}
	}
	d.msg.SetContext(contextWithTx(d.sctx, d.state))
	return d.handler(d.msg)
}

// detach ends the message context's hold on the transaction once the
// handler returned nil, and starts the commit bound.
// contextEnd returns why the message context ended: its error
// (context.Canceled or DeadlineExceeded) and its cause, when it has one of
// its own. Both, so that IsTransient sees the end: a deadline set with a
// cause (context.WithTimeoutCause in a middleware outside the inbox) was
// its cause alone, not transient, and the message was poisoned for a
// deadline; and a cancellation with a cause is most often a shutdown
// (errgroup.WithContext cancels with the error of the service that failed
// first), whose messages were poisoned too. To give a message up, return
// an error; a cancellation is not one.
func (d *delivery) contextEnd() error { return withCause(d.sctx, d.sctx.Err()) }

func (d *delivery) detach() error {
	// Stopped in time or not, a context that has ended by now ended before
	// the handler returned, or as it did: the context package closes a
	// context's Done channel before it cancels the contexts that follow it,
	// so a handler that returned on <-Done can get here first and stop the
	// follower, which then never ends the transaction's context.
	if !d.followMessage() || d.sctx.Err() != nil {
		// The transaction is rolled back: database/sql did it when its
		// context ended; otherwise end does.
		return fmt.Errorf("inbox: commit %q/%q: the message context ended before the handler returned: %w",
			d.consumer, d.id, d.contextEnd())
	}
	d.commitBound = time.AfterFunc(d.ib.commitTimeout, func() { d.cancelTx(ErrCommitTimeout) })
	return nil
}

// routerNilPublisher is the publisher name Watermill's router puts in a
// message's context (message.PublisherNameFromCtx) for a handler added with
// a nil publisher: the "%T" of nil.
const routerNilPublisher = "<nil>"

// publishToOutbox publishes the handler's returned messages through the
// outbox of its transaction, to the handler's publish topic, with
// Config.Outbox; without it they go back to the router, unless the handler
// has a publish topic and no publisher there (a misconfiguration:
// transient, ErrInvalidConfig).
func (d *delivery) publishToOutbox(produced []*message.Message) ([]*message.Message, error) {
	if len(produced) == 0 {
		return produced, nil
	}
	if !d.ib.hasOutbox {
		if ctx := d.msg.Context(); message.PublisherNameFromCtx(ctx) == routerNilPublisher && message.PublishTopicFromCtx(ctx) != "" {
			// A publish topic and no publisher (AddHandler(…, "invoices",
			// nil, h), as for the outbox): the router would refuse them
			// after the commit (ErrOutputInNoPublisherHandler), and the
			// redelivery is a duplicate: they were lost for good. Refused
			// before it, with the transaction rolled back. Without a publish
			// topic, a middleware outside may route them itself.
			d.waitAfterEnd = d.ib.refusedOutputsOf(d.handlerKey())
			return nil, &misconfiguredError{fmt.Errorf("%w: inbox: %q/%q: the handler returned %s, but the inbox has no"+
				" Config.Outbox to write them to and the handler no publisher (router.AddHandler with nil): set Config.Outbox"+
				" (ob.Publisher; pgxinbox: OutboxPublisher(ob)), or give the handler a publisher",
				ErrInvalidConfig, d.consumer, d.id, messageCount(len(produced)))}
		}
		return produced, nil
	}
	// Watermill's middleware.CorrelationID gives the messages a handler
	// returns the consumed message's correlation ID. Added to the router
	// before the inbox (outside it: the order of a router that had it
	// first), it now sees none of them, written to the outbox here, and
	// they reached the broker without it. The inbox gives it to those that
	// have none (one inside the inbox has set it already).
	if id := middleware.MessageCorrelationID(d.msg); id != "" {
		for _, m := range produced {
			if m == nil || middleware.MessageCorrelationID(m) != "" {
				continue
			}
			if m.Metadata == nil { // a message made as a struct literal: Set would panic
				m.Metadata = message.Metadata{}
			}
			middleware.SetCorrelationID(id, m)
		}
	}
	topic := message.PublishTopicFromCtx(d.msg.Context())
	if topic == "" {
		// A configuration mistake, as the case above, not the message's:
		// it was not transient, and a poison queue filter drained the
		// whole topic into the poison queue. It waits for the fix instead.
		d.waitAfterEnd = d.ib.refusedOutputsOf(d.handlerKey())
		return nil, &misconfiguredError{fmt.Errorf("%w: inbox: %q/%q: the handler returned %s but has no publish"+
			" topic to write them to in the outbox: add the handler with router.AddHandler and a publish topic",
			ErrInvalidConfig, d.consumer, d.id, messageCount(len(produced)))}
	}
	p, bound := d.state.publisher.(txBoundPublisher)
	if !bound {
		// Another publisher, or this package's writer behind a decorator
		// (bound all the same: its checks hold, and the pre-commit check
		// reads the claim).
		return nil, d.outboxPublishError(topic, d.state.publisher.Publish(topic, produced...))
	}
	if c, batches := d.tx.(lastStatementCommitter); batches {
		query, args, staged, err := p.stageLast(topic, produced)
		if err != nil {
			return nil, d.outboxPublishError(topic, err)
		}
		if staged {
			d.lastWrite.committer, d.lastWrite.writer, d.lastWrite.topic, d.lastWrite.messages = c, p, topic, len(produced)
			d.lastWrite.query, d.lastWrite.args = query, args
			return nil, nil // written with the COMMIT (commit)
		}
	}
	var err error
	if d.claimHeldByOutbox, err = p.publishLast(topic, produced); err != nil {
		return nil, d.outboxPublishError(topic, err)
	}
	return nil, nil // sent by the outbox, not by the router
}

// claimCheckedPublisher is an outbox publisher of another package (a
// watermill-sql publisher on the delivery's transaction, from
// Config.Outbox), behind the inbox's check that the transaction is still
// open and holds the claim (delivery.checkStillClaimed) before each
// Publish: such a publisher writes whatever the transaction's state, so
// after a handler's ROLLBACK (or, on MySQL/MariaDB, a deadlock whose error
// the handler ignored) it wrote the outputs in autocommit, and the relay
// sent them for a delivery that was nacked, and again under new UUIDs for
// its redeliveries. This package's writers check in their own statements.
// The check is the pre-commit check: free where the driver reports the
// transaction status, one read of the claim on MySQL/MariaDB. Safe for
// concurrent use as next is.
//
// The check and the publish run under one lock, so that the check a
// publish passed is the last one before it. (The check's read runs on the
// driver connection inside Conn.Raw: see checkBeforeForeignPublish.)
type claimCheckedPublisher struct {
	next  message.Publisher
	check func() error
	mu    sync.Mutex
}

// Publish publishes msgs through next once the check passed, or returns the
// check's error (wrapping ErrTxRolledBack or ErrTransactionEnded) and
// writes nothing.
func (p *claimCheckedPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.check(); err != nil {
		return fmt.Errorf("inbox: outbox publish to %q refused: %w", topic, err)
	}
	return p.next.Publish(topic, msgs...)
}

// checkBeforeForeignPublish is the check of claimCheckedPublisher: the
// pre-commit check (checkStillClaimed), with its read of the claim's row
// (MySQL/MariaDB) made on the driver connection under database/sql's lock
// of it for the whole read (sqlTx.claimHeldOnConn), and on SQLite, where
// that check has nothing to go by (modernc.org/sqlite reports no
// transaction status), the same read: the row is gone with a rollback (the
// handler's, or one SQLite made itself). This package's outbox reads the
// claim in its own INSERT; another package's cannot. Through database/sql,
// a read leaves its rows to be read after the call, and another goroutine's
// statement on the transaction in between (the handler's own Exec beside
// its publish) broke the go-sql-driver/mysql connection.
func (d *delivery) checkBeforeForeignPublish() error {
	t, ok := d.tx.(*sqlTx)
	if !ok || d.ib.foreignCheckSQL == "" {
		return d.checkStillClaimed() // reads nothing, or by an Exec (endedByClaimRead)
	}
	ended := d.txCtx.Err() == nil && d.tx.ended()
	held, err := t.claimHeldOnConn(d.txCtx, d.ib.foreignCheckSQL, d.consumer, d.id)
	switch {
	case err != nil && !ended:
		return fmt.Errorf("inbox: %q/%q: check the claim: %w", d.consumer, d.id, d.commitTimedOut(err))
	case err == nil && !held && d.txCtx.Err() == nil && t.doneByDatabaseSQL(d.txCtx):
		// The handler's tx.Rollback: the read on the connection, which
		// outlives the Tx, found the claim gone, as after a deadlock.
		return fmt.Errorf("inbox: %q/%q: %w", d.consumer, d.id, ErrTransactionEnded)
	case err == nil && !held:
		return fmt.Errorf("inbox: %q/%q: %w: the transaction no longer holds the claim (the database rolled it back after"+
			" an error the handler ignored, or the handler ended it)", d.consumer, d.id, claimGoneError(d.ib.dialect))
	case ended:
		return fmt.Errorf("inbox: %q/%q: %w", d.consumer, d.id, ErrTransactionEnded)
	}
	return nil
}

// Close closes next.
func (p *claimCheckedPublisher) Close() error { return p.next.Close() }

// outboxPublishError is err, from writing the returned messages to the
// outbox, with the delivery and topic; nil for nil.
func (d *delivery) outboxPublishError(topic string, err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("inbox: %q/%q: outbox publish to %q: %w", d.consumer, d.id, topic, d.commitTimedOut(d.failedTxError(err)))
}

// checkStillClaimed checks that the transaction is still open and holds the
// claim: the handler may have ended it (ended: the driver's transaction
// status, no round trip), and on MySQL/MariaDB the dialect's pre-commit
// check finds a deadlock or conflict whose error the handler ignored, which
// has already rolled everything back. COMMIT would succeed with nothing to
// commit in each case.
func (d *delivery) checkStillClaimed() error {
	// A transaction that ended with its context (the commit bound: then
	// database/sql rolls it back) is reported by commitTimedOut below.
	ended := d.txCtx.Err() == nil && d.tx.ended()
	held, err := d.claimHeldByOutbox, error(nil)
	if !held {
		held, err = d.tx.stillClaimed(d.txCtx, d.consumer, d.id)
	}
	switch {
	case err != nil && !ended:
		return fmt.Errorf("inbox: commit %q/%q: check the claim: %w", d.consumer, d.id, d.commitTimedOut(err))
	case err == nil && !held:
		// The inbox row is gone: rolled back by the database or, which
		// MySQL reports alike, by the handler's ROLLBACK statement.
		return fmt.Errorf("inbox: commit %q/%q: %w", d.consumer, d.id, ErrTxRolledBack)
	case ended:
		return fmt.Errorf("inbox: commit %q/%q: %w", d.consumer, d.id, ErrTransactionEnded)
	}
	return nil
}

// commit commits the transaction. A COMMIT whose connection was lost after
// it was sent is in doubt (lostConnError).
func (d *delivery) commit() error {
	var err error
	if w := &d.lastWrite; w.committer != nil {
		var stmtErr error
		if stmtErr, err = w.committer.commitWith(w.query, w.args); stmtErr != nil {
			if d.ib.maybeLostConn(d.txCtx, stmtErr) {
				// Sent with the COMMIT: in doubt as the COMMIT is.
				stmtErr = &lostConnError{stmtErr}
			} else if tableErr := w.writer.stagedInsertError(w.topic, w.messages, stmtErr); tableErr != nil {
				stmtErr = tableErr
			}
			return d.outboxPublishError(w.topic, stmtErr)
		}
	} else {
		err = d.tx.commit()
	}
	if err != nil && commitFoundNoTx(err) {
		err = d.endedOrRolledBack(err)
	}
	if err != nil {
		if d.ib.maybeLostConn(d.txCtx, err) {
			// The COMMIT was sent, or it would have failed with
			// driver.ErrBadConn: it is in doubt.
			err = &lostConnError{err}
		} else {
			err = d.failedTxError(err)
		}
		return fmt.Errorf("inbox: commit %q/%q: %w", d.consumer, d.id, d.commitTimedOut(err))
	}
	d.span.AddEvent("inbox.committed")
	return nil
}

// endedOrRolledBack tells, for a COMMIT that found no transaction (SQLite:
// err wraps ErrTransactionEnded), the handler's COMMIT from a rollback by
// reading the claim: committed, it is the handler's end (err); gone, SQLite
// rolled the transaction back by itself (a full disk, an interrupted
// statement, a constraint declared ON CONFLICT ROLLBACK, after an error the
// handler ignored) or the handler's ROLLBACK did, which looks the same:
// ErrTxRolledBack, transient, as on MySQL/MariaDB. It was
// ErrTransactionEnded, and a message a retry would process went to the
// poison queue. A claim that cannot be read is ErrTxRolledBack too. (A
// claim another delivery of the message committed meanwhile is taken for
// the handler's: that delivery processed the message.)
func (d *delivery) endedOrRolledBack(err error) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(d.txCtx), 5*time.Second)
	defer cancel()
	var n int64
	db := d.ib.db
	rerr := db.QueryRowxContext(ctx, db.Rebind(claimCountSQL(d.ib.quotedTable)), d.consumer, d.id).Scan(&n)
	if rerr == nil && n > 0 {
		return err
	}
	driverErr := err // sqlTx.commit's: ErrTransactionEnded and the driver's
	if m, ok := err.(interface{ Unwrap() []error }); ok {
		for _, e := range m.Unwrap() {
			if e != ErrTransactionEnded {
				driverErr = e
			}
		}
	}
	if rerr != nil {
		// Unknown: transient, since nothing is lost either way (a claim
		// the handler committed makes the redelivery a duplicate; there
		// were no outputs to refuse), where a rollback SQLite made itself
		// taken for the handler's end went to the poison queue.
		return fmt.Errorf("%w: COMMIT found the transaction ended, and the claim could not be read (%v) to tell the"+
			" handler's COMMIT from a rollback: %w", ErrTxRolledBack, rerr, driverErr)
	}
	return fmt.Errorf("%w: COMMIT found the transaction ended and its claim gone (the database rolled it back after an"+
		" error the handler ignored, or the handler's ROLLBACK): %w", ErrTxRolledBack, driverErr)
}

// runAfterCommit runs the functions registered with AfterCommit. The
// transaction has committed, so a panic is logged, not propagated: the
// message must be acked.
func (d *delivery) runAfterCommit() {
	for _, f := range d.state.end() {
		func() {
			defer func() {
				if r := recover(); r != nil {
					d.ib.logger.get().Error("Inbox after-commit function panicked", fmt.Errorf("panic: %v", r), d.fields())
				}
			}()
			f()
		}()
	}
}

// end is the delivery's one cleanup, however run ended: it rolls back the
// transaction (harmless after COMMIT: a transaction already ended is not an
// error), releases the transaction's context and the commit bound, marks
// the handler's state ended (AfterCommit refuses from then on) and gives
// the message its own context back. It returns the rollback's error.
func (d *delivery) end() error {
	var err error
	d.endWrites()
	if d.tx != nil {
		err = d.tx.rollback()
	}
	if !d.txStart.IsZero() && d.txEnd.IsZero() {
		d.txEnd = time.Now()
	}
	if d.commitBound != nil {
		d.commitBound.Stop()
	}
	if d.cancelTx != nil {
		d.followMessage()
		d.cancelTx(nil)
	}
	if d.state != nil {
		d.state.end()
	}
	d.msg.SetContext(d.ctx)
	return err
}

// report sends the delivery's outcome to the span, the log and the hooks:
// failed (err is what the router gets, or the panic), skipped as a
// duplicate, or processed.
func (d *delivery) report(err error, panicked bool) {
	ib := d.ib
	if d.reused && ib.onReusedID != nil {
		d.callHook("OnReusedID", ib.onReusedID, d.event(err))
	}
	switch {
	case err != nil:
		if panicked {
			d.span.SetStatus(codes.Error, d.panicked()+" panicked")
		} else {
			d.span.RecordError(err)
			d.span.SetStatus(codes.Error, err.Error())
		}
		if ib.onFailed != nil {
			d.callHook("OnFailed", ib.onFailed, d.event(err))
		}
	case d.duplicate:
		if !ib.logger.nop() {
			ib.logger.get().Debug("Inbox: duplicate message skipped", d.fields())
		}
		if ib.onDuplicate != nil {
			d.callHook("OnDuplicate", ib.onDuplicate, d.event(nil))
		}
	default:
		if ib.onProcessed != nil {
			d.callHook("OnProcessed", ib.onProcessed, d.event(nil))
		}
	}
	d.span.End()
}

// callHook calls hook (Config.OnProcessed and the others, named name) with
// e. A panic in it is logged, not propagated: the outcome it reports is
// final (a message whose transaction committed must be acked, and a
// panic through Watermill's Recoverer nacked it, or sent it to a poison
// queue), and the delivery's other reports still run.
func (d *delivery) callHook(name string, hook func(Event), e Event) {
	defer func() {
		if r := recover(); r != nil {
			d.ib.logger.get().Error("Inbox "+name+" hook panicked", fmt.Errorf("panic: %v", r), d.fields())
		}
	}()
	hook(e)
}

func (d *delivery) event(err error) Event {
	var took time.Duration
	switch {
	case d.txStart.IsZero(): // no transaction began
	case d.txEnd.IsZero():
		took = time.Since(d.txStart)
	default:
		took = max(d.txEnd.Sub(d.txStart), 1)
	}
	return Event{Message: d.msg, Consumer: d.consumer, MessageID: d.id, Duration: took, Err: err, ReusedIDsDetected: d.ib.fingerprintsOn()}
}

func (d *delivery) fields() watermill.LogFields {
	return watermill.LogFields{
		"message_uuid": d.msg.UUID,
		"handler_name": message.HandlerNameFromCtx(d.msg.Context()),
		"consumer":     d.consumer,
		"message_id":   d.id,
	}
}

// commitTimedOut returns err wrapped with ErrCommitTimeout when the commit
// bound ended the transaction's context, and err unchanged otherwise.
func (d *delivery) commitTimedOut(err error) error {
	if errors.Is(context.Cause(d.txCtx), ErrCommitTimeout) {
		return fmt.Errorf("%w after %v (the COMMIT is in doubt): %w", ErrCommitTimeout, d.ib.commitTimeout, err)
	}
	return err
}

// messageCount says n messages in words: "1 message", "3 messages".
func messageCount(n int) string {
	if n == 1 {
		return "1 message"
	}
	return strconv.Itoa(n) + " messages"
}
