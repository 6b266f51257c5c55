package inbox_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/watermill-inbox/inbox"
)

// A delivery that fails with one of the inbox's transient errors of setup
// waits before its nack, 100 ms doubling to 5 s over consecutive such
// deliveries (docs/errors.md), so that a broker that redelivers at once does
// not spin: a misconfigured service sends each message through BEGIN, the
// claim and a rollback a few times a second at first, then once every 5 s.
// The case here is the one the README's outbox snippet invites: a handler
// added with a publish topic and a nil publisher that returns messages to an
// inbox whose Config.Outbox was left out (transient, wrapping
// ErrInvalidConfig). GoChannel redelivers a nacked message at once, as a
// Kafka subscriber with kafka.NoSleep does. The backoff holds while another
// handler behind the same inbox (router.AddMiddleware: every handler of the
// router) commits its own messages: their commits say nothing about the
// misconfigured handler, which is not fixed by them.
func TestOutputsWithNowhereToGoBackOffOverConsecutiveDeliveries(t *testing.T) {
	for _, tc := range []struct {
		name         string
		otherCommits bool // another handler of the inbox commits a message every 50 ms
	}{
		{"alone", false},
		{"while another handler commits", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			db := sqliteDB(t)
			f := newFixture(t, db)
			ib := f.newInbox(inbox.Config{})
			mws, err := ib.Middlewares(inbox.MiddlewaresConfig{})
			if err != nil {
				t.Fatal(err)
			}
			ps := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
			t.Cleanup(func() { _ = ps.Close() })
			var calls atomic.Int32
			r := runRouter(t, func(r *message.Router) {
				r.AddMiddleware(mws...)
				r.AddHandler("billing", "orders", ps, "invoices", nil, func(msg *message.Message) ([]*message.Message, error) {
					calls.Add(1)
					return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("invoice"))}, nil
				})
				r.AddConsumerHandler("shipping", "parcels", ps, func(msg *message.Message) error { return nil })
			})
			<-r.Running()
			if err := ps.Publish("orders", message.NewMessage(watermill.NewUUID(), nil)); err != nil {
				t.Fatal(err)
			}
			// 100 + 200 + 400 + 800 + 1600 ms: at most 6 deliveries in 3 s
			// (one more for scheduling slack), whatever Retry adds in place.
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer cancel()
			for ctx.Err() == nil {
				if tc.otherCommits {
					if err := ps.Publish("parcels", message.NewMessage(watermill.NewUUID(), nil)); err != nil {
						t.Fatal(err)
					}
				}
				select {
				case <-ctx.Done():
				case <-time.After(50 * time.Millisecond):
				}
			}
			if n := calls.Load(); n > 7 {
				t.Errorf("handler called %d times in 3 s for one message whose outputs have nowhere to go; want at most 7:"+
					" the wait before each nack doubles from 100 ms to 5 s", n)
			}
		})
	}
}
