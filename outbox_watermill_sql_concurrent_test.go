package inbox_test

import (
	"errors"
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
		{"mariadb-otelsql", false, func(t *testing.T) *sqlx.DB {
			return sqlx.NewDb(testdb.OpenMySQLWith(t, otelsqlMySQL(t), "").DB, "mysql")
		}},
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

// A handler that publishes through a watermill-sql outbox in one goroutine
// while another writes its business rows on the same transaction (plain
// Execs, safe on a database/sql Tx) has every delivery acked: the inbox's
// read of the claim before each such publish (MySQL/MariaDB) left its rows
// to be read after database/sql gave the connection back, and the other
// goroutine's Exec in between broke it (18 of 20 deliveries nacked,
// "invalid connection").
func TestWatermillSQLOutboxPublishesBesideTheHandlersOwnStatements(t *testing.T) {
	db := testdb.OpenMySQL(t, "")
	o := newSQLOutbox(t, outboxV4, db, false)
	f := newFixture(t, db)
	ib := f.newInbox(inbox.Config{Outbox: o.factory, OutboxTables: []string{o.table}})
	in := newFeed()
	rec := &recorder{}
	const n, deliveries = 30, 20
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(rec.Middleware, ib.Middleware)
		r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
			pub, _ := inbox.OutboxFromContext(msg.Context())
			tx, _ := inbox.TxFromContext(msg.Context())
			var wg sync.WaitGroup
			var pubErr, execErr error
			wg.Go(func() {
				for i := range n {
					if err := pub.Publish("invoices", message.NewMessage(fmt.Sprintf("%s-%d", msg.UUID, i), nil)); err != nil {
						pubErr = err
						return
					}
				}
			})
			wg.Go(func() {
				for i := range n {
					if _, err := tx.ExecContext(msg.Context(), "INSERT INTO "+f.business+" (id, consumer) VALUES (?, ?)",
						fmt.Sprintf("%s-%d", msg.UUID, i), "billing"); err != nil {
						execErr = err
						return
					}
				}
			})
			wg.Wait()
			return errors.Join(pubErr, execErr)
		})
	})
	nacked := 0
	for range deliveries {
		if !in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
			nacked++
			t.Logf("nacked: %v", rec.last())
		}
	}
	if nacked > 0 {
		t.Errorf("%d of %d deliveries nacked", nacked, deliveries)
	}
	if got := o.rows(t); got != (deliveries-nacked)*n {
		t.Errorf("%d outputs, want %d", got, (deliveries-nacked)*n)
	}
}
