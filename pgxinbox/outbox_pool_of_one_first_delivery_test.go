package pgxinbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// The first message of a pgxinbox inbox whose Outbox is on the inbox's own
// pool (pgxinbox.DB(pool), as the docs advise) runs its handler at once on a
// pool of one connection: nothing before the handler waits for a second
// connection of the pool while the delivery's transaction holds the only
// one (and the claimed key with it).
func TestFirstDeliveryWithAnOutboxOnAPoolOfOneDoesNotWaitForASecondConnection(t *testing.T) {
	pool := openPool(t, "", "pgx_pool_of_one_outbox", func(c *pgxpool.Config) { c.MaxConns = 1 })
	f := newFixture(t, pool)
	table := "pgx_pgx_outbox_" + f.sfx
	f.dropLater(table, table+"_dead")
	ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: pgxinbox.DB(pool), Table: table, Publisher: &countingBroker{}, PollInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	ib := f.newInbox(pgxinbox.Config{Outbox: pgxinbox.OutboxPublisher(ob), Logger: &infoLines{}})
	in := newFeed()
	var handlerAt time.Time
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(ib.Middleware)
		r.AddHandler("billing", "orders", in, "invoices", &countingBroker{}, func(msg *message.Message) ([]*message.Message, error) {
			if handlerAt.IsZero() {
				handlerAt = time.Now()
			}
			return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("invoice"))}, nil
		})
	})
	start := time.Now()
	if !in.deliver(t, message.NewMessage(watermill.NewUUID(), []byte("order"))) {
		t.Fatal("first delivery nacked")
	}
	if took := time.Since(start); took > 4*time.Second {
		t.Errorf("first delivery took %v (handler called after %v); want well under the 5 s it waited for a connection: before its handler the delivery"+
			" waited for a second connection of a pool of one", took.Round(time.Millisecond), handlerAt.Sub(start).Round(time.Millisecond))
	}
}
