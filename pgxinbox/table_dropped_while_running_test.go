package pgxinbox_test

import (
	"context"
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// An inbox table dropped after the first check passed (a migration, a
// restore) fails the claim with an error that wraps ErrTableNotFound and is
// transient: Inbox.Middlewares' poison queue keeps the message on its
// topic. It was the claim's error, not transient, and every message was
// poisoned and acked.
func TestTableDroppedAfterTheStartupCheckIsNotPoisoned(t *testing.T) {
	f := newFixture(t, openPool(t, "", "table_dropped", nil))
	ib := f.newInbox(pgxinbox.Config{})
	sink := &poisonSink{}
	mws, err := ib.Middlewares(inbox.MiddlewaresConfig{PoisonQueue: sink, Retry: middleware.Retry{MaxRetries: -1}})
	if err != nil {
		t.Fatal(err)
	}
	rec := &recorder{}
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(rec.Middleware)
		r.AddMiddleware(mws...)
		r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error { return f.writeEffect(msg) })
	})
	if !in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
		t.Fatalf("first message nacked with the table in place: %v", rec.last())
	}
	if _, err := f.pool.Exec(context.Background(), "DROP TABLE "+f.table); err != nil {
		t.Fatal(err)
	}
	if in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
		t.Fatal("acked a message whose inbox table is gone")
	}
	if err := rec.last(); !inbox.IsTransient(err) || !errors.Is(err, inbox.ErrTableNotFound) || len(sink.poisoned()) > 0 {
		t.Fatalf("nacked with %v (IsTransient %v, ErrTableNotFound %v), poisoned %d; want a transient nack wrapping"+
			" ErrTableNotFound, nothing poisoned", err, inbox.IsTransient(err), errors.Is(err, inbox.ErrTableNotFound), len(sink.poisoned()))
	}
}
