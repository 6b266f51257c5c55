package harness

import (
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/datalayers/internal/invoices"
	"github.com/watermill-inbox/inbox/internal/testrouter"
)

// Env is what the contract's cases run on: a fresh database with the
// invoices table, an inbox on it, and the data layer's write.
type Env struct {
	// Inbox is the middleware of an inbox on the database, its table made.
	Inbox message.HandlerMiddleware

	// Write is the handler body under test: it writes msg's invoice
	// (Invoice) through the data layer bound to the inbox transaction in
	// msg.Context(), reads it back through the same handle (a read through
	// the pool would not see the uncommitted row on PostgreSQL or MariaDB)
	// and returns an error if it differs. With no inbox transaction it
	// returns the binding's refusal unchanged and writes nothing.
	Write func(msg *message.Message) error

	// Count returns the number of rows in table, read outside any handler.
	Count func(t testing.TB, table string) int
}

// errPaymentDown is what a failing handler returns after its write.
var errPaymentDown = errors.New("payment service down")

// NewMessage returns an order-confirmed message whose invoice (Invoice) is
// amountCents for the order msg.UUID.
func NewMessage(amountCents int64) *message.Message {
	return message.NewMessage(watermill.NewUUID(), []byte(strconv.FormatInt(amountCents, 10)))
}

// Invoice returns the invoice a handler writes for msg: the order id is
// msg.UUID, the amount in cents the payload.
func Invoice(msg *message.Message) (orderID string, amountCents int64, err error) {
	amountCents, err = strconv.ParseInt(string(msg.Payload), 10, 64)
	if err != nil {
		return "", 0, fmt.Errorf("message %s: amount: %w", msg.UUID, err)
	}
	return msg.UUID, amountCents, nil
}

// Run runs the contract of a data layer bound to the inbox transaction, each
// case in parallel on a database of its own from open:
//   - a message is processed once: one invoice row and one inbox row;
//   - a duplicate delivery is acked without calling the handler;
//   - a handler error after the data layer's write rolls the write back with
//     the inbox row, and the redelivery processes the message;
//   - without the inbox middleware the data layer refuses with an error
//     that wraps inbox.ErrNoTx, the message is nacked and nothing is written.
func Run(t *testing.T, open func(t *testing.T) Env) {
	t.Helper()
	cases := []struct {
		name string
		run  func(t *testing.T, env Env)
	}{
		{"ProcessesOnce", processesOnce},
		{"SkipsDuplicate", skipsDuplicate},
		{"HandlerErrorRollsBackTheWrite", handlerErrorRollsBack},
		{"RefusesWithoutInbox", refusesWithoutInbox},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			c.run(t, open(t))
		})
	}
}

// A delivery writes the invoice and the inbox row, in one commit.
func processesOnce(t *testing.T, env Env) {
	h := start(t, env, true, nil)
	if !h.feed.Deliver(t, NewMessage(1250)) {
		t.Fatalf("nacked: %v", h.errs())
	}
	h.expect(t, env, 1, 1, 1)
}

// A second delivery of a processed message is acked and skipped: the
// handler does not run again and the invoice is not written twice.
func skipsDuplicate(t *testing.T, env Env) {
	h := start(t, env, true, nil)
	msg := NewMessage(1250)
	for i := range 2 {
		if !h.feed.Deliver(t, msg) {
			t.Fatalf("delivery %d nacked: %v", i+1, h.errs())
		}
	}
	h.expect(t, env, 1, 1, 1)
}

// The first run writes the invoice and then fails: the write rolls back
// with the inbox row and the message is nacked; the redelivery runs the
// handler again and commits both.
func handlerErrorRollsBack(t *testing.T, env Env) {
	h := start(t, env, true, func(call int32) bool { return call == 1 })
	msg := NewMessage(1250)
	if h.feed.Deliver(t, msg) {
		t.Fatal("the failing delivery was acked")
	}
	if errs := h.errs(); len(errs) != 1 || !errors.Is(errs[0], errPaymentDown) {
		t.Fatalf("the router got %v, want the handler's error", errs)
	}
	h.expect(t, env, 1, 0, 0)
	if !h.feed.Deliver(t, msg) {
		t.Fatalf("the redelivery was nacked: %v", h.errs())
	}
	h.expect(t, env, 2, 1, 1)
}

// With no inbox middleware around the handler, the data layer gives an
// error instead of a handle on the pool: the message is nacked with an
// error that wraps inbox.ErrNoTx and no invoice is written.
func refusesWithoutInbox(t *testing.T, env Env) {
	h := start(t, env, false, nil)
	if h.feed.Deliver(t, NewMessage(1250)) {
		t.Fatal("acked without an inbox transaction")
	}
	errs := h.errs()
	if len(errs) != 1 || !errors.Is(errs[0], inbox.ErrNoTx) {
		t.Fatalf("the router got %v, want an error that wraps inbox.ErrNoTx", errs)
	}
	t.Logf("the refusal: %v", errs[0])
	h.expect(t, env, 1, 0, 0)
}

// running is a router whose handler runs Env.Write.
type running struct {
	feed  *testrouter.Feed
	calls atomic.Int32

	mu       sync.Mutex
	received []error // what the router got from each delivery, in order
}

// start runs a router whose handler counts its calls, runs env.Write and
// then, when fail reports true for the call's number (from 1), returns
// errPaymentDown. With withInbox the inbox middleware is around it.
func start(t *testing.T, env Env, withInbox bool, fail func(call int32) bool) *running {
	t.Helper()
	r := &running{}
	h := func(msg *message.Message) ([]*message.Message, error) {
		call := r.calls.Add(1)
		if err := env.Write(msg); err != nil {
			return nil, err
		}
		if fail != nil && fail(call) {
			return nil, errPaymentDown
		}
		return nil, nil
	}
	if withInbox {
		h = env.Inbox(h)
	}
	r.feed = RunRouter(t, func(msg *message.Message) ([]*message.Message, error) {
		msgs, err := h(msg)
		if err != nil {
			r.mu.Lock()
			r.received = append(r.received, err)
			r.mu.Unlock()
		}
		return msgs, err
	})
	return r
}

// errs returns the errors the router got so far.
func (r *running) errs() []error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]error(nil), r.received...)
}

// expect checks the handler calls and the rows of both tables.
func (r *running) expect(t *testing.T, env Env, calls int32, invoiceRows, inboxRows int) {
	t.Helper()
	if got := r.calls.Load(); got != calls {
		t.Errorf("handler calls: %d, want %d", got, calls)
	}
	if got := env.Count(t, invoices.Table); got != invoiceRows {
		t.Errorf("invoice rows: %d, want %d", got, invoiceRows)
	}
	if got := env.Count(t, InboxTable); got != inboxRows {
		t.Errorf("inbox rows: %d, want %d", got, inboxRows)
	}
}

// WriteAfterTheTransactionEnded delivers one message whose handler runs
// env.Write (which must succeed) and then returns the errors of env.Write
// called again on the handler's context once the inbox has ended the
// transaction: from an inbox.AfterCommit function, and after the ack (a
// goroutine that outlived the handler). It checks that the message was
// processed once and that neither late call wrote anything.
func WriteAfterTheTransactionEnded(t *testing.T, env Env) (inAfterCommit, afterReturn error) {
	t.Helper()
	var late *message.Message
	feed := RunRouter(t, env.Inbox(func(msg *message.Message) ([]*message.Message, error) {
		if err := env.Write(msg); err != nil {
			return nil, err
		}
		late = message.NewMessage(watermill.NewUUID(), msg.Payload)
		late.SetContext(msg.Context())
		if !inbox.AfterCommit(msg.Context(), func() { inAfterCommit = env.Write(late) }) {
			return nil, errors.New("AfterCommit refused in the handler")
		}
		return nil, nil
	}))
	if !feed.Deliver(t, NewMessage(1250)) {
		t.Fatal("nacked")
	}
	afterReturn = env.Write(late)
	if got := env.Count(t, invoices.Table); got != 1 {
		t.Errorf("invoice rows: %d, want 1 (the late writes refused)", got)
	}
	return inAfterCommit, afterReturn
}
