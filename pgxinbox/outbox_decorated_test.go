package pgxinbox_test

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/inbox/pgxinbox"
)

// pgxinbox.OutboxPublisher behind a publisher decorator (Watermill's
// MessageTransformPublisherDecorator) is bound to the delivery as without
// it: the commit wakes the relay, which sends the returned message, through
// the decorator, at once (it was left for the next poll, an hour here).
func TestOutboxPublisherBehindADecoratorWakesTheRelay(t *testing.T) {
	t.Parallel()
	pool := openPool(t, "", "outbox_decorated", nil)
	f := newFixture(t, pool)
	broker := &countingBroker{}
	ob := f.newRelayOutbox(broker)
	factory := pgxinbox.OutboxPublisher(ob)
	ib := f.newInbox(pgxinbox.Config{Outbox: func(tx pgx.Tx) (message.Publisher, error) {
		p, err := factory(tx)
		if err != nil {
			return nil, err
		}
		return message.MessageTransformPublisherDecorator(func(m *message.Message) { m.Metadata.Set("correlation_id", "c-1") })(p)
	}})
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddPlugin(ob.RouterPlugin)
		r.AddMiddleware(ib.Middleware)
		r.AddHandler("billing", "orders", in, "invoices", broker, func(msg *message.Message) ([]*message.Message, error) {
			return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("invoice"))}, nil
		})
	})
	time.Sleep(300 * time.Millisecond) // the relay's first round has run
	if !in.deliver(t, message.NewMessage(watermill.NewUUID(), []byte("order"))) {
		t.Fatal("nacked")
	}
	deadline := time.Now().Add(10 * time.Second)
	for len(broker.sent()) == 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if sent := broker.sent(); len(sent) != 1 || sent[0].Metadata.Get("correlation_id") != "c-1" {
		t.Errorf("10 s after the commit the relay had sent %d messages (%v), want the one, decorated: not woken", len(sent), sent)
	}
}
