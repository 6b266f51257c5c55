package inbox_test

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// Where Retry and PoisonQueue go relative to the inbox decides what a failed
// handler leaves behind. The handler inserts a row and then fails.
//   - The right orders, PoisonQueue and Retry outside the inbox, are the
//     conformance suite's (PoisonedMessageIsNotMarkedProcessed,
//     RetryOutsideRunsEachAttemptInItsOwnTransaction), on every backend.
//   - The wrong orders cannot be seen by the inbox (a middleware is an opaque
//     function), so they are documented here and in the README: Retry inside
//     the inbox keeps the failed attempt's write (two rows), and on
//     PostgreSQL an attempt that failed on SQL makes every later attempt fail
//     with 25P02; PoisonQueue inside commits the poisoned message's inbox row
//     and the failed handler's write, so its replay is skipped.
func TestMiddlewareOrder(t *testing.T) {
	t.Parallel()
	// failOnce is a handler that inserts a row (its id names the attempt) and
	// fails on its first attempt.
	failOnce := func(f *fixture, attempts *atomic.Int32) message.NoPublishHandlerFunc {
		return func(msg *message.Message) error {
			n := attempts.Add(1)
			if err := f.insertRow(msg, fmt.Sprintf("%s:%d", msg.UUID, n)); err != nil {
				return err
			}
			if n == 1 {
				return errors.New("card declined")
			}
			return nil
		}
	}
	retry := middleware.Retry{MaxRetries: 2, InitialInterval: time.Millisecond}.Middleware

	t.Run("Retry inside (wrong order, documented)", func(t *testing.T) {
		t.Parallel()
		forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
			f := newFixture(t, db)
			ib := f.newInbox(inbox.Config{})
			var attempts atomic.Int32
			in := newFeed()
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(ib.Middleware, retry)
				r.AddConsumerHandler("billing", "orders", in, failOnce(f, &attempts))
			})
			if !in.deliver(t, message.NewMessage(watermill.NewUUID(), []byte("x"))) {
				t.Fatal("nacked")
			}
			if attempts.Load() != 2 || f.businessRows() != 2 || f.inboxRows() != 1 {
				t.Errorf("attempts %d, business rows %d, inbox rows %d; the documented outcome is 2, 2, 1 "+
					"(the failed attempt's write commits with the successful one)", attempts.Load(), f.businessRows(), f.inboxRows())
			}
		})
	})

	t.Run("Retry inside, attempt fails on SQL (wrong order, documented)", func(t *testing.T) {
		t.Parallel()
		forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
			f := newFixture(t, db)
			ib := f.newInbox(inbox.Config{})
			var attempts atomic.Int32
			var errs []error
			var mu sync.Mutex
			in := newFeed()
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(ib.Middleware, retry)
				r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
					n := attempts.Add(1)
					id := msg.UUID // exists: the first attempt fails on SQL
					if n > 1 {
						id = fmt.Sprintf("%s:%d", msg.UUID, n)
					}
					err := f.insertRow(msg, id)
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
					return err
				})
			})
			msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
			exec(t, db, "INSERT INTO "+f.business+" (id, consumer) VALUES (?, ?)", msg.UUID, "other")
			acked := in.deliver(t, msg)
			mu.Lock()
			defer mu.Unlock()
			if isPostgres(tdb.Dialect) {
				// The transaction is aborted: every later attempt fails with
				// 25P02 and the message is nacked after the last retry.
				if acked || attempts.Load() != 3 || f.inboxRows() != 0 || f.businessRows() != 1 {
					t.Errorf("acked %v, attempts %d, inbox rows %d, business rows %d; want false, 3, 0, 1 (the pre-existing row)",
						acked, attempts.Load(), f.inboxRows(), f.businessRows())
				}
				for i, err := range errs[1:] {
					if sqlState(err) != "25P02" {
						t.Errorf("attempt %d: err %v, want SQLSTATE 25P02 (in failed SQL transaction)", i+2, err)
					}
				}
				return
			}
			// MySQL and SQLite roll back only the failed statement: the second
			// attempt commits.
			if !acked || attempts.Load() != 2 || f.inboxRows() != 1 || f.businessRows() != 2 {
				t.Errorf("acked %v, attempts %d, inbox rows %d, business rows %d; want true, 2, 1, 2",
					acked, attempts.Load(), f.inboxRows(), f.businessRows())
			}
		})
	})

	t.Run("PoisonQueue inside (wrong order, documented)", func(t *testing.T) {
		t.Parallel()
		forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
			f := newFixture(t, db)
			ib := f.newInbox(inbox.Config{})
			sink := &poisonSink{}
			poison, err := middleware.PoisonQueue(sink, "poison")
			if err != nil {
				t.Fatal(err)
			}
			var attempts atomic.Int32
			in := newFeed()
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(ib.Middleware, poison)
				r.AddConsumerHandler("billing", "orders", in, failOnce(f, &attempts))
			})
			msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
			if !in.deliver(t, msg) {
				t.Fatal("nacked")
			}
			poisoned := sink.poisoned()
			if len(poisoned) != 1 {
				t.Fatalf("poison topic holds %d messages, want 1", len(poisoned))
			}
			if !in.deliver(t, poisoned[0]) {
				t.Fatal("replay nacked")
			}
			if attempts.Load() != 1 || f.inboxRows() != 1 || f.businessRows() != 1 {
				t.Errorf("handler calls %d, inbox rows %d, business rows %d; the documented outcome is 1, 1, 1 "+
					"(the poisoned message and its failed write are committed, the replay is skipped)",
					attempts.Load(), f.inboxRows(), f.businessRows())
			}
		})
	})
}
