package inbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/watermill-inbox/inbox"
)

// sqlx's MustExec (no context: the commonest Must* call) on the *sqlx.Tx
// of TxFromContext, run after the router's Close ended the message context:
// database/sql has rolled the transaction back, and MustExec panics with
// sql.ErrTxDone. Returned, that error is made transient (run wraps the
// context's end: "a shutdown had such a message poisoned"); panicked, the
// RecoveredPanicError's value alone decided (IsTransient(sql.ErrTxDone) is
// false), and the message in flight at the deploy went to the poison topic:
// acked on its own topic, its effects never committed. The inbox adds the
// context's end to such a panic's value.
func TestPanicOfTxDoneAfterAShutdownIsNotPoisoned(t *testing.T) {
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
	for name, stack := range stacks {
		t.Run("gochannel/"+name, func(t *testing.T) {
			shutdownCase(t, "gochannel", stack, func(ctx context.Context) error {
				<-ctx.Done() // the router closes while the handler works
				// database/sql rolls the transaction back once its
				// context ends; the handler's next statement comes after.
				time.Sleep(200 * time.Millisecond)
				tx, _ := inbox.TxFromContext(ctx)
				tx.MustExec("SELECT 1") // panics with sql.ErrTxDone
				return nil
			})
		})
	}
}
