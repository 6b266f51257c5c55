// Package testrouter runs one Watermill handler on a real message.Router for
// the tests of the modules that bind data layers to the inbox transaction
// (gorminbox, entinbox, datalayers): a feed that delivers exactly the messages a test
// hands it, and a record of what the router got back from each delivery.
package testrouter

import (
	"context"
	"errors"
	"fmt"
	"runtime/pprof"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// Run starts a router with one handler, "billing" on topic "orders", behind
// middlewares (outermost first; the inbox's Middleware goes last), and
// closes it when tb ends. It returns the handler's feed and the record of
// its outcomes, which a middleware outside all the others keeps.
func Run(tb testing.TB, h message.NoPublishHandlerFunc, middlewares ...message.HandlerMiddleware) (*Feed, *Outcomes) {
	tb.Helper()
	return RunHandler(tb, "billing", h, middlewares...)
}

// RunHandler is Run with the handler named name (the inbox's default
// consumer).
func RunHandler(tb testing.TB, name string, h message.NoPublishHandlerFunc, middlewares ...message.HandlerMiddleware) (*Feed, *Outcomes) {
	tb.Helper()
	in, out := NewFeed(), &Outcomes{}
	Start(tb, func(r *message.Router) {
		r.AddMiddleware(out.Middleware)
		r.AddMiddleware(middlewares...)
		r.AddConsumerHandler(name, "orders", in, h)
	})
	return in, out
}

// Start runs a router that setup configured, once it is running, and
// closes it when tb ends; a router that does not close within its
// CloseTimeout (10 s) fails tb with every goroutine's stack.
func Start(tb testing.TB, setup func(r *message.Router)) *message.Router {
	tb.Helper()
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		tb.Fatal(err)
	}
	setup(r)
	errc := make(chan error, 1)
	go func() { errc <- r.Run(context.Background()) }()
	select {
	case <-r.Running():
	case err := <-errc:
		tb.Fatalf("router stopped: %v", err)
	}
	tb.Cleanup(func() {
		if err := r.Close(); err != nil {
			var stacks strings.Builder
			_ = pprof.Lookup("goroutine").WriteTo(&stacks, 1)
			tb.Errorf("close router: %v; goroutines:\n%s", err, stacks.String())
		}
	})
	return r
}

// Order returns a message for orderID (its payload, and metadata
// "order_id") with a fresh UUID.
func Order(orderID string) *message.Message {
	msg := message.NewMessage(watermill.NewUUID(), []byte(orderID))
	msg.Metadata.Set("order_id", orderID)
	return msg
}

// Feed is a message.Subscriber that delivers exactly the messages a test
// hands it. It never redelivers by itself: a redelivery is a test calling
// Deliver again with the same message.
type Feed struct {
	ch        chan *message.Message
	closed    chan struct{}
	closeOnce sync.Once
}

// NewFeed returns a feed for one handler of a router.
func NewFeed() *Feed { return &Feed{ch: make(chan *message.Message), closed: make(chan struct{})} }

// Subscribe returns a channel that closes when ctx ends or the feed is
// closed, as a broker subscriber's does.
func (f *Feed) Subscribe(ctx context.Context, _ string) (<-chan *message.Message, error) {
	out := make(chan *message.Message)
	go func() {
		defer close(out)
		for {
			select {
			case <-ctx.Done():
				return
			case <-f.closed:
				return
			case m := <-f.ch:
				select {
				case out <- m:
				case <-ctx.Done():
					return
				case <-f.closed:
					return
				}
			}
		}
	}()
	return out, nil
}

// Close stops the feed's subscriptions.
func (f *Feed) Close() error {
	f.closeOnce.Do(func() { close(f.closed) })
	return nil
}

// Deliver sends a fresh copy of msg (same UUID, payload and metadata, a new
// context and ack channels, as a broker's redelivery has) and reports
// whether the router acked it; it fails tb if the router neither takes nor
// answers it within 30 s.
func (f *Feed) Deliver(tb testing.TB, msg *message.Message) bool {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), deliverTimeout)
	defer cancel()
	acked, err := f.Send(ctx, msg.Copy())
	if err != nil {
		tb.Fatal(err)
	}
	return acked
}

// deliverTimeout bounds Deliver's waits: a hang fails the test instead of
// stalling the suite. It is a bound, never a measurement.
const deliverTimeout = 30 * time.Second

// DeliverAsync is Deliver in a goroutine: the channel yields whether the
// router acked (false, with tb's error, when it did not answer in time).
func (f *Feed) DeliverAsync(tb testing.TB, msg *message.Message) <-chan bool {
	acked := make(chan bool, 1)
	m := msg.Copy()
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), deliverTimeout)
		defer cancel()
		ok, err := f.Send(ctx, m)
		if err != nil {
			tb.Error(err)
		}
		acked <- ok
	}()
	return acked
}

// Send hands msg itself to the router (the caller made the copy and set
// its context and metadata) and waits, until ctx ends, for the ack (true)
// or nack (false); it returns an error if ctx ends first.
func (f *Feed) Send(ctx context.Context, msg *message.Message) (bool, error) {
	select {
	case f.ch <- msg:
	case <-ctx.Done():
		return false, fmt.Errorf("message %s: the router did not take it: %w", msg.UUID, ctx.Err())
	}
	select {
	case <-msg.Acked():
		return true, nil
	case <-msg.Nacked():
		return false, nil
	case <-ctx.Done():
		return false, fmt.Errorf("message %s: neither acked nor nacked: %w", msg.UUID, ctx.Err())
	}
}

// Outcomes records the error each delivery returned to the router, in
// order and by the delivery's label (its "delivery" metadata). Its
// Middleware goes outside every other middleware.
type Outcomes struct {
	mu      sync.Mutex
	errs    []error
	byLabel map[string][]error
}

// Middleware records what the router gets back from the handler and the
// middlewares inside it.
func (o *Outcomes) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		msgs, err := h(msg)
		o.mu.Lock()
		defer o.mu.Unlock()
		if o.byLabel == nil {
			o.byLabel = map[string][]error{}
		}
		label := msg.Metadata.Get("delivery")
		o.errs = append(o.errs, err)
		o.byLabel[label] = append(o.byLabel[label], err)
		return msgs, err
	}
}

// Last returns the error of the last delivery, or an error saying that
// there was none.
func (o *Outcomes) Last() error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if len(o.errs) == 0 {
		return errors.New("no delivery recorded")
	}
	return o.errs[len(o.errs)-1]
}

// LastOr returns the error of the last delivery, or none when there was
// none.
func (o *Outcomes) LastOr(none error) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if len(o.errs) == 0 {
		return none
	}
	return o.errs[len(o.errs)-1]
}

// LastOf returns the error of the last delivery labelled label; nil when
// there was none.
func (o *Outcomes) LastOf(label string) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	errs := o.byLabel[label]
	if len(errs) == 0 {
		return nil
	}
	return errs[len(errs)-1]
}

// All returns every error recorded, nil for an acked delivery, in order.
func (o *Outcomes) All() []error {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]error(nil), o.errs...)
}

// Failures returns every non-nil error recorded, in order.
func (o *Outcomes) Failures() []error {
	o.mu.Lock()
	defer o.mu.Unlock()
	var all []error
	for _, err := range o.errs {
		if err != nil {
			all = append(all, err)
		}
	}
	return all
}
