package inbox_test

import (
	"fmt"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A handler that publishes from several goroutines through a watermill-sql
// outbox (Config.Outbox) has every publish accepted and every delivery
// acked, with each output written once: the inbox's check before each such
// publish reads the claim on MySQL/MariaDB, and another goroutine's publish
// between that read and its Scan broke the connection (every delivery
// nacked, "bad connection").
func TestWatermillSQLOutboxTakesPublishesFromSeveralGoroutines(t *testing.T) {
	for _, be := range []struct {
		name string
		pg   bool
		open func(t *testing.T) *sqlx.DB
	}{
		{"mariadb", false, func(t *testing.T) *sqlx.DB { return testdb.OpenMySQL(t, "") }},
		{"pgx", true, func(t *testing.T) *sqlx.DB { return testdb.OpenPostgres(t, "") }},
		{"libpq", true, func(t *testing.T) *sqlx.DB { return testdb.OpenPostgresWith(t, "postgres", "") }},
	} {
		t.Run(be.name, func(t *testing.T) {
			db := be.open(t)
			o := newSQLOutbox(t, outboxV4, db, be.pg)
			f := newFixture(t, db)
			ib := f.newInbox(inbox.Config{Outbox: o.factory, OutboxTables: []string{o.table}})
			in := newFeed()
			rec := &recorder{}
			const G, N, msgs = 8, 10, 20
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(rec.Middleware, ib.Middleware)
				r.AddHandler("billing", "orders", in, "invoices", nil, func(msg *message.Message) ([]*message.Message, error) {
					pub, _ := inbox.OutboxFromContext(msg.Context())
					var wg sync.WaitGroup
					errs := make([]error, G)
					for g := range errs {
						wg.Go(func() {
							for i := range N {
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
					return nil, nil
				})
			})
			nacked := 0
			for range msgs {
				if !in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
					nacked++
					t.Logf("nacked: %v", rec.last())
				}
			}
			if nacked > 0 {
				t.Errorf("%d of %d deliveries nacked", nacked, msgs)
			}
			if n := o.rows(t); n != (msgs-nacked)*G*N {
				t.Errorf("%d outputs, want %d", n, (msgs-nacked)*G*N)
			}
		})
	}
}
