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
