package pgxinbox_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// Behind PgBouncer in transaction mode, with pgx's exec or simple_protocol
// mode: the pgx inbox writes a handler's output through OutboxPublisher in
// the message's transaction, and the relay, as the router's plugin on the
// same pool (through database/sql), sends each output exactly once with its
// UUID, payload and metadata, while every message is delivered twice at
// once; no relay round fails and the outbox ends empty.
func TestOutboxRelay_BehindPgBouncer(t *testing.T) {
	t.Parallel()
	for _, mode := range bouncerModes {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			pool := testdb.OpenPgxPoolBouncer(t, "default_query_exec_mode="+mode)
			f := newFixture(t, pool)
			db := sqlx.NewDb(stdlib.OpenDBFromPool(pool), "pgx")
			t.Cleanup(func() { db.Close() })
			broker := &countingBroker{}
			var mu sync.Mutex
			var failed []error
			table := "pgx_outbox_" + testdb.RandomSuffix()
			f.dropLater(table, table+"_dead")
			ob, err := inbox.NewOutbox(inbox.OutboxConfig{
				DB: db, Table: table, Publisher: broker, BatchSize: 3, PollInterval: 50 * time.Millisecond,
				OnRound: func(r inbox.OutboxRound) {
					if r.Err != nil {
						mu.Lock()
						failed = append(failed, r.Err)
						mu.Unlock()
					}
				},
			})
			if err != nil {
				t.Fatal(err)
			}
			if err := ob.InitializeSchema(context.Background()); err != nil {
				t.Fatal(err)
			}
			ib := f.newInbox(pgxinbox.Config{Outbox: pgxinbox.OutboxPublisher(ob)})
			in := newFeed()
			runRouter(t, func(r *message.Router) {
				r.AddPlugin(ob.RouterPlugin)
				r.AddMiddleware(ib.Middleware)
				r.AddHandler("billing", "orders", in, "invoices", broker, func(msg *message.Message) ([]*message.Message, error) {
					if err := f.writeEffect(msg); err != nil {
						return nil, err
					}
					out := message.NewMessage(msg.UUID+"-invoice", []byte{0, 1, 2, 255})
					out.Metadata.Set("order", msg.UUID)
					return []*message.Message{out}, nil
				})
			})
			const n = 30
			var orders []*message.Message
			for range n {
				orders = append(orders, message.NewMessage(watermill.NewUUID(), nil))
			}
			var wg sync.WaitGroup
			for _, m := range orders {
				for range 2 {
					wg.Go(func() {
						for !in.deliver(t, m) { // a nack is redelivered
						}
					})
				}
			}
			wg.Wait()
			waitFor(t, "every invoice relayed and the outbox empty", func() bool {
				stats, err := ob.Stats(context.Background())
				return err == nil && stats.Pending == 0 && len(broker.sent()) >= n
			})
			got := map[string]*message.Message{}
			for _, m := range broker.sent() {
				if got[m.UUID] != nil {
					t.Errorf("invoice %s sent twice", m.UUID)
				}
				got[m.UUID] = m
			}
			for _, o := range orders {
				m := got[o.UUID+"-invoice"]
				if m == nil || string(m.Payload) != "\x00\x01\x02\xff" || m.Metadata.Get("order") != o.UUID {
					t.Errorf("invoice of %s: %+v, want it sent with its payload and metadata", o.UUID, m)
				}
			}
			f.expectRows(n, n)
			mu.Lock()
			defer mu.Unlock()
			if len(failed) > 0 {
				t.Errorf("%d relay rounds failed behind the pooler, the first: %v", len(failed), failed[0])
			}
		})
	}
}
