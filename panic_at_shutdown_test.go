package inbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/watermill-inbox/inbox"
)

// A handler that writes with sqlx's Must* methods (tx.MustExecContext on the
// *sqlx.Tx that TxFromContext hands out) panics with the statement's error.
// At a shutdown that error is the message context's end (context.Canceled),
// and the docs promise that a message whose context the router's Close
// ended is "nacked and redelivered to the next instance, never poisoned".
// With a poison queue and Recoverer inside it, as the docs order them
// (Inbox.Middlewares without Retry, MaxRetries -1, or the hand-written order
// without Retry), the panic becomes a middleware.RecoveredPanicError that
// hides its value from IsTransient, and the message in flight at the deploy
// goes to the poison topic: acked on its own topic, its effects never
// committed.
func TestPanicOfATransientErrorAtAShutdownIsNotPoisoned(t *testing.T) {
	stacks := map[string]func(*inbox.Inbox, message.Publisher) []message.HandlerMiddleware{
		"Middlewares-without-Retry": func(ib *inbox.Inbox, poison message.Publisher) []message.HandlerMiddleware {
			mws, err := ib.Middlewares(inbox.MiddlewaresConfig{PoisonQueue: poison, PoisonTopic: "poison",
				Retry: middleware.Retry{MaxRetries: -1}})
			if err != nil {
				t.Fatal(err)
			}
			return mws
		},
		"by-hand-without-Retry": func(ib *inbox.Inbox, poison message.Publisher) []message.HandlerMiddleware {
			pq, err := middleware.PoisonQueueWithFilter(poison, "poison", func(err error) bool { return !inbox.IsTransient(err) })
			if err != nil {
				t.Fatal(err)
			}
			return []message.HandlerMiddleware{pq, middleware.Timeout(30 * time.Second), middleware.Recoverer, ib.Middleware}
		},
	}
	for _, broker := range []string{"gochannel", "kafka"} {
		for name, stack := range stacks {
			t.Run(broker+"/"+name, func(t *testing.T) {
				shutdownCase(t, broker, stack, func(ctx context.Context) error {
					<-ctx.Done() // the router closes while the handler works
					tx, _ := inbox.TxFromContext(ctx)
					tx.MustExecContext(ctx, "SELECT 1") // panics with context.Canceled
					return nil
				})
			})
		}
	}
}
