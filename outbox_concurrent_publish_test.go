package inbox_test

import (
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// A handler that publishes from several goroutines at once through
// OutboxFromContext (the outbox publisher is safe for concurrent use while
// the transaction is open) and then returns a message: every output is
// written once, in the message's transaction, and leaves once. Under -race
// this guards the publisher's own state: each Publish asks whether the
// server has ended the transaction.
func TestOutboxPublishesFromSeveralGoroutinesOfOneHandler(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		broker := newBrokerStub()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, PollInterval: time.Hour})
		f := newFixture(t, db)
		ib := f.newInbox(inbox.Config{Outbox: ob.Publisher})
		in := newFeed()
		out := &outcomes{}
		runRouter(t, func(r *message.Router) {
			r.AddMiddleware(out.Middleware, ib.Middleware)
			r.AddHandler("billing", "orders", in, "invoices", &recordingPublisher{fail: true}, func(msg *message.Message) ([]*message.Message, error) {
				pub, _ := inbox.OutboxFromContext(msg.Context())
				var wg sync.WaitGroup
				errs := make([]error, 4)
				for g := range errs {
					wg.Go(func() {
						for i := range 3 {
							if err := pub.Publish("invoices", message.NewMessage(fmt.Sprintf("%s-g%d-%d", msg.UUID, g, i), nil)); err != nil {
								errs[g] = err
							}
						}
					})
				}
				wg.Wait()
				for _, err := range errs {
					if err != nil {
						return nil, err
					}
				}
				return []*message.Message{message.NewMessage(msg.UUID+"-returned", nil)}, nil
			})
		})
		var want []string
		for range 5 {
			m := message.NewMessage(watermill.NewUUID(), nil)
			if !in.deliver(t, delivery(m, "d")) {
				t.Fatalf("nacked: %v", out.last("d"))
			}
			for g := range 4 {
				for i := range 3 {
					want = append(want, fmt.Sprintf("%s-g%d-%d", m.UUID, g, i))
				}
			}
			want = append(want, m.UUID+"-returned")
		}
		relayUntilEmpty(t, ob)
		got := broker.uuids("invoices")
		slices.Sort(got)
		slices.Sort(want)
		if !slices.Equal(got, want) {
			t.Errorf("sent %d outputs, want %d, each once", len(got), len(want))
		}
	})
}
