package conformance

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/watermill-inbox/inbox"
)

// The cases on how the inbox sits in a Watermill router: the consumer key,
// the message context, and the middlewares around it (Semantics 6, 8, 10
// and 13).

// Semantics 8: two handlers ("billing" and "shipping", the default
// consumers) behind one inbox receive the same message id, twice each:
// each processes it once, under its own key.
func twoConsumers(t *testing.T, b Backend) {
	f := newFixture(t, b)
	mw := f.newMiddleware(Options{})
	f.run("billing", mw)
	billing := f.feed
	f.run("shipping", mw)
	shipping := f.feed
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order":8}`))
	for range 2 {
		if !billing.Deliver(t, msg) || !shipping.Deliver(t, msg) {
			t.Fatal("a delivery was nacked")
		}
	}
	f.expect(msg.UUID, 2, 2, 2)
	for _, consumer := range []string{"billing", "shipping"} {
		if n := f.count(f.inbox, "consumer = ? AND message_id = ?", consumer, msg.UUID); n != 1 {
			t.Errorf("%d inbox rows of consumer %s, want 1", n, consumer)
		}
	}
	f.hooks.expect(t, 2, 2, 0, 0)
	f.expectNoConnHeld()
}

// Semantics 6: every statement runs on the message's context: a message
// whose context has ended fails its claim with the context's error, the
// handler is not called and nothing is written.
func claimOnMessageContext(t *testing.T, b Backend) {
	f := newFixture(t, b)
	mw := f.newMiddleware(Options{Consumer: "billing"})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order":9}`))
	msg.SetContext(ctx)
	_, err := mw(func(*message.Message) ([]*message.Message, error) {
		t.Error("handler called on an ended context")
		return nil, nil
	})(msg)
	if !errors.Is(err, context.Canceled) {
		t.Errorf("error %v, want context.Canceled", err)
	}
	f.expect(msg.UUID, 0, 0, 0)
	f.expectNoConnHeld()
}

// contextCheck is a middleware outside the inbox that counts the
// deliveries after which the message's context is not the one it came in
// with, or still carries the inbox transaction.
type contextCheck struct {
	b                 Backend
	changed, txRemain atomic.Int32
}

func (c *contextCheck) middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		before := msg.Context()
		msgs, err := h(msg)
		if msg.Context() != before {
			c.changed.Add(1)
		}
		if c.b.InTx(msg.Context()) {
			c.txRemain.Add(1)
		}
		return msgs, err
	}
}

func (c *contextCheck) expectRestored(t *testing.T) {
	t.Helper()
	if c.changed.Load() != 0 || c.txRemain.Load() != 0 {
		t.Errorf("after the inbox returned, the message context was another %d times and still carried the transaction %d times; want 0 and 0",
			c.changed.Load(), c.txRemain.Load())
	}
}

// Semantics 6: once the middleware returned (failed, processed, duplicate),
// the message's context is the one it came in with, without the
// transaction: a Retry outside sees no finished transaction.
func contextRestored(t *testing.T, b Backend) {
	f := newFixture(t, b)
	check := &contextCheck{b: b}
	f.start(Options{}, check.middleware)
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order":10}`))
	f.handlerFails.Store(true)
	f.deliver(msg)
	f.handlerFails.Store(false)
	f.deliver(msg)
	f.deliver(msg)
	f.expect(msg.UUID, 2, 1, 1)
	f.hooks.expect(t, 1, 1, 1, 0)
	check.expectRestored(t)
}

// Semantics 13: Retry outside the inbox runs each attempt in a transaction
// of its own: the failed attempts' writes roll back, the last one commits,
// the context between attempts carries no finished transaction, and a
// redelivery is a duplicate.
func retryOutside(t *testing.T, b Backend) {
	f := newFixture(t, b)
	check := &contextCheck{b: b}
	var attempts atomic.Int32
	failTwice := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			f.handlerFails.Store(attempts.Add(1) < 3)
			return h(msg)
		}
	}
	f.start(Options{}, middleware.Retry{MaxRetries: 3, InitialInterval: time.Millisecond}.Middleware, check.middleware, failTwice)
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order":12}`))
	if !f.deliver(msg) {
		t.Fatalf("nacked after a successful retry: %v", f.outcomes.Last())
	}
	f.expect(msg.UUID, 3, 1, 1)
	check.expectRestored(t)
	if !f.deliver(msg) {
		t.Fatalf("redelivery nacked: %v", f.outcomes.Last())
	}
	f.expect(msg.UUID, 3, 1, 1)
	f.hooks.expect(t, 1, 1, 2, 0)
	f.expectNoConnHeld()
}

// Semantics 13: PoisonQueue outside the inbox: a message the handler
// cannot process goes to the poison topic (acked), its writes and claim
// roll back, so that its replay from the poison topic (the poisoned copy,
// with the poison queue's metadata) is processed.
func poisonOutside(t *testing.T, b Backend) {
	f := newFixture(t, b)
	pubsub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { pubsub.Close() })
	poison, err := middleware.PoisonQueue(pubsub, "orders_poison")
	if err != nil {
		t.Fatal(err)
	}
	f.start(Options{}, poison)
	f.handlerFails.Store(true)
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order":13}`))
	if !f.deliver(msg) {
		t.Fatalf("the poisoned message was not acked: %v", f.outcomes.Last())
	}
	poisoned, err := pubsub.Subscribe(context.Background(), "orders_poison")
	if err != nil {
		t.Fatal(err)
	}
	var replay *message.Message
	select {
	case replay = <-poisoned:
		replay.Ack()
		if replay.UUID != msg.UUID {
			t.Errorf("poison topic got %s, want %s", replay.UUID, msg.UUID)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("nothing on the poison topic")
	}
	f.expect(msg.UUID, 1, 0, 0)
	f.handlerFails.Store(false)
	if !f.deliver(replay) { // the copy from the poison topic, with its poison metadata
		t.Fatalf("the replay was nacked: %v", f.outcomes.Last())
	}
	f.expect(msg.UUID, 2, 1, 1)
	f.expectNoConnHeld()
}

// An inbox inside another (the same middleware on the router and on the
// handler): the inner one refuses at once with ErrNestedInbox instead of
// waiting forever on the outer transaction's row; nothing is written and
// no connection stays checked out.
func nestedInbox(t *testing.T, b Backend) {
	f := newFixture(t, b)
	mw := f.newMiddleware(Options{})
	f.run("billing", mw, mw)
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order":14}`))
	if f.deliver(msg) {
		t.Fatal("acked a message handled by nested inboxes")
	}
	if err := f.outcomes.Last(); !errors.Is(err, inbox.ErrNestedInbox) {
		t.Errorf("router got %v, want ErrNestedInbox", err)
	}
	f.expect(msg.UUID, 0, 0, 0)
	f.expectNoConnHeld()
}

// Semantics 10: a table name outside the allowed identifiers is refused by
// the constructor with ErrInvalidTableName (and ErrInvalidConfig), before
// any statement.
func invalidTableName(t *testing.T, b Backend) {
	for _, name := range []string{"inbox; DROP TABLE orders", `"inbox"`, "1inbox", "a.b.c"} {
		_, err := b.New(t, name, Options{})
		if !errors.Is(err, inbox.ErrInvalidTableName) || !errors.Is(err, inbox.ErrInvalidConfig) {
			t.Errorf("table %q: error %v, want ErrInvalidTableName and ErrInvalidConfig", name, err)
		}
	}
}
