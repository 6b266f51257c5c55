// Package harness runs the data-layer bindings' tests: a fresh database per
// case (a schema on PostgreSQL, a database on MariaDB, a file on SQLite)
// holding the invoices table, a real Watermill router fed one message at a
// time, and the contract every binding must keep (Run).
package harness

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// waitTimeout bounds every wait for the router: a hang fails the test
// instead of stalling the suite. It is a bound, never a measurement.
const waitTimeout = 30 * time.Second

// Feed is a message.Subscriber for one handler that delivers exactly the
// messages a test hands it and reports whether the router acked or nacked
// each one. Unlike a broker it never redelivers by itself: a redelivery is
// a test calling Deliver again with the same message.
type Feed struct {
	ch        chan *message.Message
	closed    chan struct{}
	closeOnce sync.Once
}

// NewFeed returns an open feed.
func NewFeed() *Feed {
	return &Feed{ch: make(chan *message.Message), closed: make(chan struct{})}
}

// Subscribe returns a channel that closes when ctx ends or the feed is
// closed, as every Watermill subscriber's does.
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
// context and ack channels, as a broker's redelivery has) and waits for the
// router's ack (true) or nack (false).
func (f *Feed) Deliver(t testing.TB, msg *message.Message) bool {
	t.Helper()
	m := msg.Copy()
	select {
	case f.ch <- m:
	case <-time.After(waitTimeout):
		t.Fatalf("message %s: the router did not take it within %s", msg.UUID, waitTimeout)
	}
	select {
	case <-m.Acked():
		return true
	case <-m.Nacked():
		return false
	case <-time.After(waitTimeout):
		t.Fatalf("message %s: neither acked nor nacked within %s", msg.UUID, waitTimeout)
		return false
	}
}

// RunRouter starts a router with one handler, named handlerName, that
// consumes feed and runs h (with its middlewares already around it), and
// closes the router when the test ends.
func RunRouter(t testing.TB, handlerName string, feed *Feed, h message.HandlerFunc) {
	t.Helper()
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r.AddConsumerHandler(handlerName, "orders.confirmed", feed, func(msg *message.Message) error {
		_, err := h(msg)
		return err
	})
	errc := make(chan error, 1)
	go func() { errc <- r.Run(context.Background()) }()
	select {
	case <-r.Running():
	case err := <-errc:
		t.Fatalf("router stopped: %v", err)
	}
	t.Cleanup(func() {
		if err := r.Close(); err != nil {
			t.Errorf("close router: %v", err)
		}
	})
}
