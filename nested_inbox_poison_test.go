package inbox_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/watermill-inbox/inbox"
)

// The inbox added twice, Inbox.Middlewares on the router (with a poison
// queue, default filter) and ib.Middleware once more on the handler: a setup
// mistake the docs say is refused per message with ErrNestedInbox, "nack",
// and the README promises that "the inbox's own errors of setup are
// transient (nacked, never poisoned), so a misconfigured inbox does not
// drain the topic". ErrNestedInbox was not transient, Retry skipped it, and
// the default filter sent every message of the topic to the poison queue:
// the whole topic was drained, acked, and none of it processed.
func TestNestedInboxDoesNotDrainTheTopicIntoThePoisonQueue(t *testing.T) {
	t.Parallel()
	for _, broker := range []string{"gochannel", "kafka"} {
		t.Run(broker, func(t *testing.T) {
			db := sqliteDB(t)
			f := newFixture(t, db)
			ib := f.newInbox(inbox.Config{})
			sub, pub, poisoned := shutdownBroker(t, broker)
			router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
			if err != nil {
				t.Fatal(err)
			}
			mws, err := ib.Middlewares(inbox.MiddlewaresConfig{PoisonQueue: pub, PoisonTopic: "poison"})
			if err != nil {
				t.Fatal(err)
			}
			router.AddMiddleware(mws...)
			var mu sync.Mutex
			var seen []error
			router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
				return func(msg *message.Message) ([]*message.Message, error) {
					out, err := h(msg)
					mu.Lock()
					seen = append(seen, err)
					mu.Unlock()
					return out, err
				}
			})
			h := router.AddConsumerHandler("billing", "orders", sub, func(msg *message.Message) error {
				return f.writeBusinessRow(msg)
			})
			h.AddMiddleware(ib.Middleware) // the mistake: the inbox once more, on the handler
			ctx, cancel := context.WithCancel(context.Background())
			ran := make(chan struct{})
			go func() { defer close(ran); _ = router.Run(ctx) }()
			<-router.Running()
			const n = 3
			for range n {
				if err := pub.Publish("orders", message.NewMessage(watermill.NewUUID(), []byte("order"))); err != nil {
					t.Fatal(err)
				}
			}
			waitFor(t, func() bool { mu.Lock(); defer mu.Unlock(); return len(seen) >= n })
			time.Sleep(500 * time.Millisecond)
			cancel()
			<-ran
			mu.Lock()
			if len(seen) > 0 && !errors.Is(seen[0], inbox.ErrNestedInbox) {
				t.Logf("first error: %v", seen[0])
			}
			mu.Unlock()
			got := poisoned()
			for _, p := range got {
				t.Errorf("message %s poisoned for a setup mistake (reason %q)", p.UUID, p.Metadata.Get(middleware.ReasonForPoisonedKey))
			}
			if len(got) > 0 {
				t.Errorf("%d of %d messages drained into the poison queue; business rows %d: acked on orders, never processed",
					len(got), n, f.businessRows())
			}
		})
	}
}
