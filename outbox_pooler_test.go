package inbox_test

// The outbox relay behind PgBouncer in transaction pooling mode
// (pooler_test.go says which drivers and why), where each transaction may
// run on another server connection.

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// Behind PgBouncer in transaction mode, through a real router: an inbox
// whose handler returns one message and publishes another through
// OutboxFromContext, each message delivered twice at once, and the outbox
// relay as the router's plugin on the same pool. Every output reaches the
// broker exactly once, with its UUID, payload and metadata, every message is
// processed once, no relay round fails, and the outbox table ends empty.
func TestOutboxRelayBehindPgBouncer(t *testing.T) {
	forEachPooledDriver(t, func(t *testing.T, _ testdb.PgBouncerDriver, db *sqlx.DB) {
		broker := newBrokerStub()
		var mu sync.Mutex
		var failed []error // relay rounds that failed
		ob, _ := newNamedTestOutbox(t, db, inbox.PostgreSQL, inbox.OutboxConfig{
			Publisher: broker, BatchSize: 3, PollInterval: 50 * time.Millisecond,
			OnRound: func(r inbox.OutboxRound) {
				if r.Err != nil {
					mu.Lock()
					failed = append(failed, r.Err)
					mu.Unlock()
				}
			},
		})
		f := newFixture(t, db)
		ib := f.newInbox(inbox.Config{Dialect: inbox.PostgreSQL, Outbox: ob.Publisher})
		in := newFeed()
		runRouter(t, func(r *message.Router) {
			r.AddPlugin(ob.RouterPlugin)
			r.AddMiddleware(ib.Middleware)
			r.AddHandler("billing", "orders", in, "invoices", broker, func(msg *message.Message) ([]*message.Message, error) {
				if err := f.writeBusinessRow(msg); err != nil {
					return nil, err
				}
				pub, ok := inbox.OutboxFromContext(msg.Context())
				if !ok {
					return nil, errors.New("no outbox publisher")
				}
				mail := message.NewMessage(msg.UUID+"-mail", []byte("mail for "+msg.UUID))
				mail.Metadata.Set("order", msg.UUID)
				if err := pub.Publish("mails", mail); err != nil {
					return nil, err
				}
				invoice := message.NewMessage(msg.UUID+"-invoice", []byte("invoice of "+msg.UUID))
				invoice.Metadata.Set("order", msg.UUID)
				return []*message.Message{invoice}, nil
			})
		})
		const n = 40
		var orders []*message.Message
		for range n {
			orders = append(orders, message.NewMessage(watermill.NewUUID(), nil))
		}
		var wg sync.WaitGroup
		for _, m := range orders {
			for range 2 {
				wg.Go(func() {
					for !in.deliver(t, m) { // a nack (a lost claim race) is redelivered
					}
				})
			}
		}
		wg.Wait()
		waitFor(t, func() bool {
			stats, err := ob.Stats(context.Background())
			return err == nil && stats.Pending == 0 && len(broker.uuids("invoices")) >= n && len(broker.uuids("mails")) >= n
		})
		for _, topic := range []string{"invoices", "mails"} {
			got := map[string]*message.Message{}
			for _, m := range broker.messages(topic) {
				if got[m.UUID] != nil {
					t.Errorf("%s %s sent twice", topic, m.UUID)
				}
				got[m.UUID] = m
			}
			for _, o := range orders {
				suffix, what := "-invoice", "invoice of "
				if topic == "mails" {
					suffix, what = "-mail", "mail for "
				}
				m := got[o.UUID+suffix]
				switch {
				case m == nil:
					t.Errorf("%s of order %s never reached the broker", topic, o.UUID)
				case string(m.Payload) != what+o.UUID || m.Metadata.Get("order") != o.UUID:
					t.Errorf("%s %s arrived with payload %q metadata %v", topic, m.UUID, m.Payload, m.Metadata)
				}
			}
			if len(got) != n {
				t.Errorf("%d distinct %s sent, want %d", len(got), topic, n)
			}
		}
		if rows := f.businessRows(); rows != n {
			t.Errorf("%d business rows, want %d (each order processed once)", rows, n)
		}
		assertOutboxEmpty(t, ob)
		mu.Lock()
		defer mu.Unlock()
		if len(failed) > 0 {
			t.Errorf("%d relay rounds failed behind the pooler, the first: %v", len(failed), failed[0])
		}
	})
}
