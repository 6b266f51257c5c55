package inbox_test

import (
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A watermill-sql outbox (Config.Outbox, v4 and v3) writes nothing for a
// delivery whose handler ended the transaction with its own ROLLBACK and
// then returned an output: the inbox checks the transaction before it
// publishes through another package's publisher. It wrote the output in
// autocommit, the forwarder sent it for a nacked delivery, and each
// redelivery wrote one more under a new UUID.
func TestWatermillSQLOutboxWritesNothingAfterTheHandlersRollback(t *testing.T) {
	for _, kind := range []outboxKind{outboxV4, outboxV3} {
		for _, be := range []struct {
			name string
			pg   bool
			open func(t *testing.T) *sqlx.DB
		}{
			{"pgx", true, func(t *testing.T) *sqlx.DB { return testdb.OpenPostgres(t, "") }},
			{"libpq", true, func(t *testing.T) *sqlx.DB { return testdb.OpenPostgresWith(t, "postgres", "") }},
			{"mariadb", false, func(t *testing.T) *sqlx.DB { return testdb.OpenMySQL(t, "") }},
			// The check's read runs on the driver connection: here otelsql's.
			{"mariadb-otelsql", false, func(t *testing.T) *sqlx.DB {
				return sqlx.NewDb(testdb.OpenMySQLWith(t, otelsqlMySQL(t), "").DB, "mysql")
			}},
		} {
			t.Run(kind.name+"/"+be.name, func(t *testing.T) {
				db := be.open(t)
				o := newSQLOutbox(t, kind, db, be.pg)
				f := newFixture(t, db)
				ib := f.newInbox(inbox.Config{Outbox: o.factory, OutboxTables: []string{o.table}})
				rec := &recorder{}
				in := newFeed()
				runRouter(t, func(r *message.Router) {
					r.AddMiddleware(rec.Middleware, ib.Middleware)
					r.AddHandler("billing", "orders", in, "invoices", nil, func(msg *message.Message) ([]*message.Message, error) {
						if err := f.writeBusinessRow(msg); err != nil {
							return nil, err
						}
						tx, _ := inbox.TxFromContext(msg.Context())
						if _, err := tx.ExecContext(msg.Context(), "ROLLBACK"); err != nil {
							return nil, err
						}
						return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("invoice"))}, nil
					})
				})
				for i := 0; i < 2; i++ { // the delivery and a redelivery
					if acked := in.deliver(t, message.NewMessage("order-1", []byte("order"))); acked {
						t.Fatalf("delivery %d acked; want nacked: the handler rolled its transaction back", i+1)
					}
				}
				if !errors.Is(rec.last(), inbox.ErrTransactionEnded) && !errors.Is(rec.last(), inbox.ErrTxRolledBack) {
					t.Errorf("error = %v, want one wrapping ErrTransactionEnded or ErrTxRolledBack", rec.last())
				}
				if n := o.rows(t); n != 0 {
					t.Errorf("%d outputs in the watermill-sql outbox for deliveries whose effects did not commit (business rows %d, inbox rows %d); want 0",
						n, f.businessRows(), f.inboxRows())
				}
			})
		}
	}
}

// On MariaDB, a handler that ignores its deadlock error (InnoDB rolled the
// whole transaction back) and then returns an output, or publishes one
// through OutboxFromContext, has nothing written to a watermill-sql outbox:
// the output went in autocommit, sent for a nacked delivery and again under
// a new UUID by its redelivery (two invoices for one order).
func TestWatermillSQLOutboxWritesNothingAfterADeadlockTheHandlerIgnored(t *testing.T) {
	for _, how := range []string{"returned", "published"} {
		t.Run(how, func(t *testing.T) {
			db := testdb.OpenMySQL(t, "")
			o := newSQLOutbox(t, outboxV4, db, false)
			f := newFixture(t, db)
			ib := f.newInbox(inbox.Config{Dialect: inbox.MySQL, Outbox: o.factory, OutboxTables: []string{o.table}})
			victim := deadlockVictim(t, inbox.MySQL, db)
			first := true
			var ignored, published error
			in := newFeed()
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(ib.Middleware)
				r.AddHandler("billing", "orders", in, "invoices", nil, func(msg *message.Message) ([]*message.Message, error) {
					if err := f.writeBusinessRow(msg); err != nil {
						return nil, err
					}
					if first {
						first = false
						tx, _ := inbox.TxFromContext(msg.Context())
						ignored = victim(msg, tx) // and ignored
					}
					out := message.NewMessage(watermill.NewUUID(), []byte("invoice"))
					if how == "returned" {
						return []*message.Message{out}, nil
					}
					pub, _ := inbox.OutboxFromContext(msg.Context())
					published = pub.Publish("invoices", out)
					return nil, nil // the publish error ignored too
				})
			})
			msg := message.NewMessage(watermill.NewUUID(), nil)
			if acked := in.deliver(t, msg); acked {
				t.Fatal("the deadlocked delivery was acked")
			}
			if ignored == nil {
				t.Fatal("the handler's statement was no deadlock victim")
			}
			if how == "published" && !errors.Is(published, inbox.ErrTxRolledBack) {
				t.Errorf("Publish after the deadlock = %v, want an error wrapping ErrTxRolledBack", published)
			}
			if n := o.rows(t); n != 0 {
				t.Fatalf("%d outputs in the watermill-sql outbox for the deadlocked delivery; want 0", n)
			}
			if acked := in.deliver(t, msg); !acked {
				t.Fatal("the redelivery was not acked")
			}
			if b, n := f.businessRows(), o.rows(t); b != 1 || n != 1 {
				t.Errorf("after the redelivery: %d business rows and %d outputs; want 1 and 1", b, n)
			}
		})
	}
}
