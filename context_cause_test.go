package inbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
)

var errHandlerDeadline = errors.New("handler took longer than 100ms")

// timeoutWithCause is middleware.Timeout written with Go 1.21's
// context.WithTimeoutCause, so that logs say which deadline fired.
func timeoutWithCause(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx, cancel := context.WithTimeoutCause(msg.Context(), 100*time.Millisecond, errHandlerDeadline)
		defer cancel()
		msg.SetContext(ctx)
		return h(msg)
	}
}

// TestDeadlineWithACauseIsTransient: the message's deadline, set outside
// the inbox with a cause, ends before the handler returns; the handler
// returns nil (it did not watch the context). The inbox nacks, correctly,
// but its error carries only context.Cause, not context.DeadlineExceeded: a
// deadline (transient for every other path: a statement under the same
// context fails with DeadlineExceeded) becomes a permanent error that
// !IsTransient poisons. Same deadline without a cause: transient.
func TestDeadlineWithACauseIsTransient(t *testing.T) {
	db := sqliteDB(t)
	f := newFixture(t, db)
	ib := f.newInbox(inbox.Config{})
	rec := &recorder{}
	var calls int
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(rec.Middleware, timeoutWithCause, ib.Middleware)
		r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
			calls++
			if err := f.writeBusinessRow(msg); err != nil {
				return err
			}
			if calls == 1 {
				time.Sleep(300 * time.Millisecond) // slow, e.g. a remote call without the context
			}
			return nil
		})
	})
	msg := message.NewMessage(watermill.NewUUID(), nil)
	if in.deliver(t, msg) {
		t.Fatal("acked after the deadline ended the transaction")
	}
	err := rec.last()
	t.Logf("first delivery: %v (IsTransient=%v, Is DeadlineExceeded=%v)", err, inbox.IsTransient(err), errors.Is(err, context.DeadlineExceeded))
	if !inbox.IsTransient(err) {
		t.Errorf("a deadline is nacked with a non-transient error (poisoned by !IsTransient): %v", err)
	}
	if !in.deliver(t, msg) {
		t.Fatal("redelivery nacked")
	}
	if f.businessRows() != 1 || f.inboxRows() != 1 || calls != 2 {
		t.Errorf("business rows %d, inbox rows %d, calls %d; want 1, 1, 2", f.businessRows(), f.inboxRows(), calls)
	}
}

var errInvalidByAnOuterMiddleware = errors.New("the message failed validation: it can never succeed")

// cancelOnInvalid is a middleware outside the inbox that cancels the
// message's context with a permanent cause (an asynchronous check of the
// message found it invalid while the handler ran).
func cancelOnInvalid(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx, cancel := context.WithCancelCause(msg.Context())
		defer cancel(nil)
		msg.SetContext(ctx)
		time.AfterFunc(50*time.Millisecond, func() { cancel(errInvalidByAnOuterMiddleware) })
		return h(msg)
	}
}

// A message context cancelled with a cause of its own (context.WithCancelCause
// in a middleware outside the inbox) ends the transaction with that cause
// alone, not context.Canceled beside it: a cause given on purpose may say
// the message is to be given up, and with Canceled IsTransient said true and
// a PoisonQueue filtered with !IsTransient redelivered it for ever. (A
// deadline with a cause wraps DeadlineExceeded too:
// TestDeadlineWithACauseIsTransient.)
func TestContextCancelledWithACauseOfItsOwnKeepsItsCause(t *testing.T) {
	db := sqliteDB(t)
	f := newFixture(t, db)
	ib := f.newInbox(inbox.Config{})
	rec := &recorder{}
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(rec.Middleware, cancelOnInvalid, ib.Middleware)
		r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
			time.Sleep(200 * time.Millisecond) // does not watch the context
			return nil
		})
	})
	msg := message.NewMessage(watermill.NewUUID(), nil)
	if in.deliver(t, msg) {
		t.Fatal("acked after the context was cancelled")
	}
	err := rec.last()
	t.Logf("error: %v (Is cause %v, Is Canceled %v, IsTransient %v)", err, errors.Is(err, errInvalidByAnOuterMiddleware), errors.Is(err, context.Canceled), inbox.IsTransient(err))
	if inbox.IsTransient(err) {
		t.Errorf("a context cancelled with a permanent cause is transient: redelivered for ever under PoisonQueue(!IsTransient): %v", err)
	}
}

// The same cancellation with a cause of its own as
// TestContextCancelledWithACauseOfItsOwnKeepsItsCause, the handler then
// running a statement without the context (tx.Exec) and returning its
// sql.ErrTxDone: the error carries the cause, not context.Canceled (with
// which IsTransient said true, and a PoisonQueue filtered with !IsTransient
// redelivered the message for ever).
func TestContextCancelledWithACauseOfItsOwnKeepsItsCauseWhenTheHandlerFindsTheTxDone(t *testing.T) {
	db := sqliteDB(t)
	f := newFixture(t, db)
	ib := f.newInbox(inbox.Config{})
	rec := &recorder{}
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(rec.Middleware, cancelOnInvalid, ib.Middleware)
		r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
			time.Sleep(200 * time.Millisecond) // does not watch the context
			tx, _ := inbox.TxFromContext(msg.Context())
			_, err := tx.Exec(tx.Rebind("INSERT INTO "+f.business+" (id, consumer) VALUES (?, ?)"), "billing:"+msg.UUID, "billing")
			return err
		})
	})
	msg := message.NewMessage(watermill.NewUUID(), nil)
	if in.deliver(t, msg) {
		t.Fatal("acked after the context was cancelled")
	}
	err := rec.last()
	t.Logf("error: %v (Is cause %v, IsTransient %v)", err, errors.Is(err, errInvalidByAnOuterMiddleware), inbox.IsTransient(err))
	if inbox.IsTransient(err) || !errors.Is(err, errInvalidByAnOuterMiddleware) {
		t.Errorf("a context cancelled with a permanent cause: transient %v, carries the cause %v (want false, true): %v",
			inbox.IsTransient(err), errors.Is(err, errInvalidByAnOuterMiddleware), err)
	}
}

// cancelledBeforeInbox: a middleware outside the inbox that found the
// message invalid before passing it on cancels its context with a
// permanent cause (e.g. an async validation that finished first).
func cancelledBeforeInbox(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx, cancel := context.WithCancelCause(msg.Context())
		cancel(errInvalidByAnOuterMiddleware)
		msg.SetContext(ctx)
		return h(msg)
	}
}

// A message context cancelled with a cause of its own before the inbox
// begins: BEGIN fails on the ended transaction context, with the cause and
// not context.Canceled beside it (IsTransient said true, and the message
// was redelivered for ever under PoisonQueue(!IsTransient)).
func TestContextCancelledWithACauseOfItsOwnBeforeTheInboxBeganKeepsItsCause(t *testing.T) {
	db := sqliteDB(t)
	f := newFixture(t, db)
	ib := f.newInbox(inbox.Config{})
	rec := &recorder{}
	in := newFeed()
	calls := 0
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(rec.Middleware, cancelledBeforeInbox, ib.Middleware)
		r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error { calls++; return nil })
	})
	msg := message.NewMessage(watermill.NewUUID(), nil)
	if in.deliver(t, msg) {
		t.Fatal("acked after the context was cancelled")
	}
	err := rec.last()
	t.Logf("calls %d, error: %v", calls, err)
	if inbox.IsTransient(err) {
		t.Errorf("a context cancelled with a permanent cause before the inbox began is transient (redelivered for ever under PoisonQueue(!IsTransient)): %v", err)
	}
}
