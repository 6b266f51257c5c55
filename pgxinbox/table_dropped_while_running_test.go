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
// poisoned and acked. The same holds on a connection the pool opened after
// the drop (a restart of the pool's connections, a new one under load),
// where pgx prepares the claim afresh and the server refuses the prepare
// rather than the execution.
func TestTableDroppedAfterTheStartupCheckIsNotPoisoned(t *testing.T) {
	for _, tc := range []struct {
		name           string
		freshConnAfter bool // the pool's connections are replaced after the drop
	}{
		{"same connection", false},
		{"fresh connection", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pool := openPool(t, "", "table_dropped", nil)
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
			if tc.freshConnAfter {
				pool.Reset()
			}
			acked := in.deliver(t, message.NewMessage(watermill.NewUUID(), nil))
			for _, m := range sink.poisoned() {
				t.Logf("poisoned for: %s", m.Metadata.Get(middleware.ReasonForPoisonedKey))
			}
			if err := rec.last(); acked || !inbox.IsTransient(err) || !errors.Is(err, inbox.ErrTableNotFound) || len(sink.poisoned()) > 0 {
				t.Fatalf("acked %v, with %v (IsTransient %v, ErrTableNotFound %v), poisoned %d; want a transient nack wrapping"+
					" ErrTableNotFound, nothing poisoned", acked, err, inbox.IsTransient(err), errors.Is(err, inbox.ErrTableNotFound), len(sink.poisoned()))
			}
		})
	}
}
