package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
)

// AfterCommit functions run once after a commit, in order, and never after a
// rollback or for a duplicate; a panicking one is logged and the message is
// still acked.
func TestAfterCommit(t *testing.T) {
	db := sqliteDB(t)
	f := newFixture(t, db)
	logger := newCaptureLogger()
	ib := f.newInbox(inbox.Config{Logger: logger})
	var mu sync.Mutex
	var ran []string
	var fail atomic.Bool
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(ib.Middleware)
		r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
			for _, name := range []string{"purge cache", "panics", "count"} {
				name := name
				if !inbox.AfterCommit(msg.Context(), func() {
					if name == "panics" {
						panic("after-commit bug")
					}
					mu.Lock()
					ran = append(ran, fmt.Sprintf("%s %s", name, msg.UUID))
					mu.Unlock()
				}) {
					return errors.New("no inbox transaction")
				}
			}
			if fail.Load() {
				return errors.New("rolled back")
			}
			return nil
		})
	})
	msg := message.NewMessage(watermill.NewUUID(), nil)
	fail.Store(true)
	if in.deliver(t, msg) || len(ran) != 0 {
		t.Fatalf("after a rollback: ran %v", ran)
	}
	fail.Store(false)
	if !in.deliver(t, msg) {
		t.Fatal("nacked although committed (after-commit panic must not nack)")
	}
	in.deliver(t, msg) // duplicate
	want := []string{"purge cache " + msg.UUID, "count " + msg.UUID}
	if fmt.Sprint(ran) != fmt.Sprint(want) {
		t.Errorf("ran %v, want %v", ran, want)
	}
	var errs int
	for _, l := range *logger.lines {
		if l.level == "error" {
			errs++
		}
	}
	if errs != 1 {
		t.Errorf("error log lines = %d, want 1 for the panic", errs)
	}
	if inbox.AfterCommit(msg.Context(), func() {}) {
		t.Error("AfterCommit outside a handler returned true")
	}
}

// AfterCommit on a context the handler captured (a goroutine, a callback
// that fires late), called after the transaction ended, does not report f
// registered unless f runs: it returns false, or runs f.
func TestAfterCommit_OnAnEndedTransactionRunsFOrReturnsFalse(t *testing.T) {
	db := sqliteDB(t)
	f := newFixture(t, db)
	ib := f.newInbox(inbox.Config{Consumer: "billing"})
	var captured context.Context
	if _, err := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		captured = msg.Context()
		return nil, nil
	})(message.NewMessage(watermill.NewUUID(), nil)); err != nil {
		t.Fatal(err)
	}
	var ran atomic.Bool
	if ok := inbox.AfterCommit(captured, func() { ran.Store(true) }); ok && !ran.Load() {
		t.Errorf("AfterCommit after the transaction ended returned true, f never runs")
	}
	if tx, ok := inbox.TxFromContext(captured); ok {
		t.Logf("TxFromContext on the captured context still returns the finished tx: %v", tx.Commit())
	}
}

// ContextOutbox refuses a message whose context has no inbox transaction:
// nothing is published outside a claimed message's handler.
func TestContextOutbox_RefusesAMessageOutsideAnInboxTransaction(t *testing.T) {
	t.Parallel()
	err := inbox.ContextOutbox{}.Publish("topic", message.NewMessage("m-1", nil))
	if !errors.Is(err, inbox.ErrNoOutbox) {
		t.Fatalf("err = %v, want ErrNoOutbox", err)
	}
}
