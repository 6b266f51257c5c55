package pgxinbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// A handler that runs ROLLBACK through its pgx transaction is
// ErrTransactionEnded, not transient, whether it returns nothing, returns an
// output or publishes one after the ROLLBACK: with an output it was
// ErrTxRolledBack, transient, and a poison filter built on IsTransient never
// took the message (PostgreSQL never ends a transaction on its own).
func TestHandlersRollbackIsItsEndWhetherOrNotItHasOutputs(t *testing.T) {
	for _, output := range []string{"none", "returned", "published"} {
		t.Run(output, func(t *testing.T) {
			pool := openPool(t, "", "rollback_outputs", nil)
			sfx := testdb.RandomSuffix()
			inboxTable, outboxTable := "inbox_"+sfx, "outbox_"+sfx
			t.Cleanup(func() {
				for _, tb := range []string{inboxTable, outboxTable, outboxTable + "_dead"} {
					_, _ = pool.Exec(context.Background(), "DROP TABLE IF EXISTS "+tb)
				}
			})
			db := pgxinbox.DB(pool)
			t.Cleanup(func() { db.Close() })
			ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Table: outboxTable, Publisher: &countingBroker{}, PollInterval: time.Hour})
			if err != nil {
				t.Fatal(err)
			}
			if err := ob.InitializeSchema(context.Background()); err != nil {
				t.Fatal(err)
			}
			ib, err := pgxinbox.New(pgxinbox.Config{Pool: pool, Table: inboxTable, Outbox: pgxinbox.OutboxPublisher(ob)})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = ib.Close() })
			if err := ib.InitializeSchema(context.Background()); err != nil {
				t.Fatal(err)
			}
			in, rec := newFeed(), &recorder{}
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(rec.Middleware, ib.Middleware)
				r.AddHandler("billing", "orders", in, "invoices", nil, func(msg *message.Message) ([]*message.Message, error) {
					tx, _ := pgxinbox.TxFromContext(msg.Context())
					if _, err := tx.Exec(msg.Context(), "ROLLBACK"); err != nil {
						return nil, err
					}
					invoice := message.NewMessage(msg.UUID+"-invoice", []byte("invoice"))
					switch output {
					case "returned":
						return []*message.Message{invoice}, nil
					case "published":
						pub, _ := inbox.OutboxFromContext(msg.Context())
						return nil, pub.Publish("invoices", invoice)
					}
					return nil, nil
				})
			})
			if in.deliver(t, message.NewMessage(watermill.NewUUID(), []byte("order"))) {
				t.Fatal("acked a message whose handler rolled its transaction back")
			}
			if got := rec.last(); !errors.Is(got, inbox.ErrTransactionEnded) || inbox.IsTransient(got) {
				t.Errorf("router got %v (transient %v), want ErrTransactionEnded, not transient", got, inbox.IsTransient(got))
			}
			var n int
			if err := pool.QueryRow(context.Background(), "SELECT count(*) FROM "+outboxTable).Scan(&n); err != nil || n != 0 {
				t.Errorf("%d outputs in the outbox (%v), want 0", n, err)
			}
		})
	}
}
