package pgxinbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// In every pgx query mode, on a pool of one connection, an Outbox that only
// writes (its relay runs elsewhere) looks up its table's schema in the
// message's transaction before the handler runs: the handler's SET LOCAL
// search_path (a schema per tenant, whose schema holds a table named like
// the outbox) leaves its outputs, published and returned, in the outbox the
// relay reads, and the look-up needs no second connection (on a pool of
// one, a look-up on a connection of its own waited for the one the
// handler's transaction held).
func TestOutboxPublisher_WritesToItsTableWhateverTheHandlersSearchPath(t *testing.T) {
	for _, mode := range allModes {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			pool := openPool(t, "", "pgxinbox-search-path", func(c *pgxpool.Config) {
				c.ConnConfig.DefaultQueryExecMode = mode
				c.MaxConns = 1
			})
			f := newFixture(t, pool)
			db := pgxinbox.DB(pool)
			t.Cleanup(func() { db.Close() })
			table := "outbox_" + testdb.RandomSuffix()
			f.dropLater(table, table+"_dead")
			creator, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Table: table, Publisher: &countingBroker{}})
			if err != nil {
				t.Fatal(err)
			}
			if err := creator.InitializeSchema(context.Background()); err != nil {
				t.Fatal(err)
			}
			tenant := "tenant_" + testdb.RandomSuffix()
			f.exec("CREATE SCHEMA " + tenant)
			t.Cleanup(func() { _, _ = pool.Exec(context.Background(), "DROP SCHEMA "+tenant+" CASCADE") })
			f.exec("CREATE TABLE " + tenant + "." + table + " (LIKE " + table + " INCLUDING ALL)")
			writer, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Table: table, Publisher: &countingBroker{}})
			if err != nil {
				t.Fatal(err)
			}
			ib := f.newInbox(pgxinbox.Config{Outbox: pgxinbox.OutboxPublisher(writer)})
			in := newFeed()
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(ib.Middleware)
				r.AddHandler("billing", "orders", in, "invoices", refusingPublisher{}, func(msg *message.Message) ([]*message.Message, error) {
					tx, _ := pgxinbox.TxFromContext(msg.Context())
					if _, err := tx.Exec(msg.Context(), "SET LOCAL search_path TO "+tenant+", public"); err != nil {
						return nil, err
					}
					outbox, _ := inbox.OutboxFromContext(msg.Context())
					if err := outbox.Publish("emails", message.NewMessage(msg.UUID+"-email", []byte("email"))); err != nil {
						return nil, err
					}
					return []*message.Message{message.NewMessage(msg.UUID+"-invoice", []byte("invoice"))}, nil
				})
			})
			const orders = 3
			start := time.Now()
			for range orders {
				if !in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
					t.Fatalf("a message was nacked (after %v)", time.Since(start))
				}
			}
			if n, tenantRows := f.count(table), f.count(tenant+"."+table); n != 2*orders || tenantRows != 0 {
				t.Errorf("outbox rows %d, rows in the tenant's table named like it %d, want %d and none", n, tenantRows, 2*orders)
			}
		})
	}
}
