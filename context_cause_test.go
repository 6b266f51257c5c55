package inbox_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

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

var errInvalidByAnOuterMiddleware = errors.New("an outer middleware gave up on the message")

// cancelWithACause is a middleware outside the inbox that cancels the
// message's context with a cause of its own after wait (0: before the
// inbox runs).
func cancelWithACause(wait time.Duration) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			ctx, cancel := context.WithCancelCause(msg.Context())
			defer cancel(nil)
			msg.SetContext(ctx)
			if wait == 0 {
				cancel(errInvalidByAnOuterMiddleware)
			} else {
				time.AfterFunc(wait, func() { cancel(errInvalidByAnOuterMiddleware) })
			}
			return h(msg)
		}
	}
}

// A message context cancelled with a cause of its own (context.WithCancelCause
// in a middleware outside the inbox, errgroup.WithContext at a shutdown) ends
// the transaction with that cause and context.Canceled both: transient, as a
// shutdown's messages must be (a cancellation is no way to give a message up:
// return an error), and the cause still there for errors.Is and the logs;
// whether the context ends before the inbox begins, while the handler runs,
// or while it runs a statement without the context (tx.Exec, which returns
// sql.ErrTxDone).
func TestContextCancelledWithACauseIsTransientAndKeepsItsCause(t *testing.T) {
	for _, tc := range []struct {
		name   string
		wait   time.Duration
		txDone bool
	}{
		{"before the inbox began", 0, false},
		{"while the handler runs", 50 * time.Millisecond, false},
		{"the handler then finds the transaction done", 50 * time.Millisecond, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			db := sqliteDB(t)
			f := newFixture(t, db)
			ib := f.newInbox(inbox.Config{})
			rec := &recorder{}
			in := newFeed()
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(rec.Middleware, cancelWithACause(tc.wait), ib.Middleware)
				r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
					time.Sleep(200 * time.Millisecond) // does not watch the context
					if !tc.txDone {
						return nil
					}
					tx, _ := inbox.TxFromContext(msg.Context())
					_, err := tx.Exec(tx.Rebind("INSERT INTO "+f.business+" (id, consumer) VALUES (?, ?)"), "billing:"+msg.UUID, "billing")
					return err
				})
			})
			if in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
				t.Fatal("acked after the context was cancelled")
			}
			if err := rec.last(); !inbox.IsTransient(err) || !errors.Is(err, errInvalidByAnOuterMiddleware) {
				t.Errorf("a cancelled message context: transient %v, carries the cause %v (want both): %v",
					inbox.IsTransient(err), errors.Is(err, errInvalidByAnOuterMiddleware), err)
			}
			if f.businessRows() != 0 || f.inboxRows() != 0 {
				t.Errorf("business rows %d, inbox rows %d; want none", f.businessRows(), f.inboxRows())
			}
		})
	}
}

// A router run under errgroup.WithContext beside another service (an HTTP
// server) that fails: the group's context is cancelled with that failure as
// its cause, and the messages in flight end with it. They are transient, not
// poisoned: the cause alone (no context.Canceled beside it) made
// Inbox.Middlewares' PoisonQueue(!IsTransient) poison every message in flight
// at such a shutdown.
func TestShutdownWithACauseIsTransient(t *testing.T) {
	for _, txDone := range []bool{false, true} {
		name := map[bool]string{false: "handler returns nil", true: "handler finds the tx done"}[txDone]
		t.Run(name, func(t *testing.T) { shutdownWithACause(t, txDone) })
	}
}

func shutdownWithACause(t *testing.T, txDone bool) {
	db := sqliteDB(t)
	f := newFixture(t, db)
	ib := f.newInbox(inbox.Config{})
	logger := watermill.NopLogger{}
	pubSub := gochannel.NewGoChannel(gochannel.Config{}, logger)
	defer pubSub.Close()
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var got []error
	record := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			mu.Lock()
			got = append(got, err)
			mu.Unlock()
			return out, err
		}
	}
	started := make(chan struct{}, 10)
	router.AddMiddleware(record, ib.Middleware)
	router.AddConsumerHandler("billing", "orders", pubSub, func(msg *message.Message) error {
		started <- struct{}{}
		time.Sleep(300 * time.Millisecond) // a remote call that does not watch the context
		if txDone {                        // then a statement without the context (tx.Exec)
			tx, _ := inbox.TxFromContext(msg.Context())
			_, err := tx.Exec(tx.Rebind("INSERT INTO "+f.business+" (id, consumer) VALUES (?, ?)"), "billing:"+msg.UUID, "billing")
			return err
		}
		return nil // its work was a remote call: nothing to write
	})
	// What errgroup.WithContext does when another service of the group
	// fails: it cancels the group's context with that failure as its cause.
	group, shutdown := context.WithCancelCause(context.Background())
	defer shutdown(nil)
	ran := make(chan struct{})
	go func() { defer close(ran); _ = router.Run(group) }()
	errHTTP := errors.New("http server: listen tcp :8080: bind: address already in use")
	<-router.Running()
	if err := pubSub.Publish("orders", message.NewMessage(watermill.NewUUID(), nil)); err != nil {
		t.Fatal(err)
	}
	<-started
	shutdown(errHTTP) // the other service fails while the handler runs: the process shuts down
	<-ran
	mu.Lock()
	defer mu.Unlock()
	if len(got) == 0 {
		t.Fatal("no outcome recorded")
	}
	err = got[0]
	t.Logf("in-flight message at shutdown: %v (IsTransient %v, Is Canceled %v)", err, inbox.IsTransient(err), errors.Is(err, context.Canceled))
	if err == nil {
		t.Skip("the handler's commit won the race")
	}
	if !inbox.IsTransient(err) {
		t.Errorf("a message in flight at a shutdown is poisoned by PoisonQueue(!IsTransient): %v", err)
	}
}
