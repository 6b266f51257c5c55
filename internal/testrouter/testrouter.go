// Package testrouter runs one Watermill handler on a real message.Router for
// the tests of the modules that bind data layers to the inbox transaction
// (gorminbox, entinbox, datalayers): a feed that delivers exactly the messages a test
// hands it, and a record of what the router got back from each delivery.
package testrouter

import (
	"context"
	"errors"
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
	in, out := newFeed(), &Outcomes{}
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		tb.Fatal(err)
	}
	r.AddMiddleware(out.middleware)
	r.AddMiddleware(middlewares...)
	r.AddConsumerHandler("billing", "orders", in, h)
	errc := make(chan error, 1)
	go func() { errc <- r.Run(context.Background()) }()
	select {
	case <-r.Running():
	case err := <-errc:
		tb.Fatalf("router stopped: %v", err)
	}
	tb.Cleanup(func() {
		if err := r.Close(); err != nil {
			tb.Errorf("close router: %v", err)
		}
	})
	return in, out
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

func newFeed() *Feed { return &Feed{ch: make(chan *message.Message), closed: make(chan struct{})} }

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

// Deliver sends a fresh copy of msg (same UUID, payload and metadata, as a
// broker's redelivery has) and reports whether the router acked it.
func (f *Feed) Deliver(tb testing.TB, msg *message.Message) bool {
	tb.Helper()
	m := msg.Copy()
	select {
	case f.ch <- m:
	case <-time.After(30 * time.Second):
		tb.Fatalf("message %s: router did not take it within 30s", msg.UUID)
	}
	select {
	case <-m.Acked():
		return true
	case <-m.Nacked():
		return false
	case <-time.After(30 * time.Second):
		tb.Fatalf("message %s: neither acked nor nacked within 30s", msg.UUID)
		return false
	}
}

// Outcomes records the error each delivery returned to the router.
type Outcomes struct {
	mu   sync.Mutex
	errs []error
}

func (o *Outcomes) middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		msgs, err := h(msg)
		o.mu.Lock()
		o.errs = append(o.errs, err)
		o.mu.Unlock()
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
