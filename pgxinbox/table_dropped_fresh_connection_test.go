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

// An inbox table dropped after the first check passed fails the claim with
// a transient error wrapping ErrTableNotFound also on a connection the pool
// opened after the drop (a restart of the pool's connections, a new one
// under load), where pgx prepares the claim afresh and the server refuses
// the prepare rather than the execution: the poison queue keeps the message
// on its topic.
func TestTableDroppedAfterTheStartupCheckIsNotPoisonedOnAFreshConnection(t *testing.T) {
	pool := openPool(t, "", "table_dropped_fresh", nil)
	f := newFixture(t, pool)
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
	if _, err := pool.Exec(context.Background(), "DROP TABLE "+f.table); err != nil {
		t.Fatal(err)
	}
	pool.Reset() // the next delivery on a new connection
	acked := in.deliver(t, message.NewMessage(watermill.NewUUID(), nil))
	for _, m := range sink.poisoned() {
		t.Logf("poisoned for: %s", m.Metadata.Get(middleware.ReasonForPoisonedKey))
	}
	if err := rec.last(); acked || !inbox.IsTransient(err) || !errors.Is(err, inbox.ErrTableNotFound) || len(sink.poisoned()) > 0 {
		t.Fatalf("acked %v, with %v (IsTransient %v, ErrTableNotFound %v), poisoned %d; want a transient nack wrapping"+
			" ErrTableNotFound, nothing poisoned", acked, err, inbox.IsTransient(err), errors.Is(err, inbox.ErrTableNotFound), len(sink.poisoned()))
	}
}
