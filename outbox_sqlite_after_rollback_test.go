package inbox_test

import (
	"context"
	"errors"
	"path/filepath"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// On SQLite, an output written after the transaction was rolled back (by
// the handler's ROLLBACK, or by SQLite itself: a trigger's RAISE(ROLLBACK)
// or a constraint declared ON CONFLICT ROLLBACK, whose error the handler
// took for "already there") is not written: the outbox insert reads the
// claim's row, gone with the rollback. modernc.org/sqlite reports no
// transaction status, so the insert ran in autocommit, the COMMIT then
// failed (no transaction) and each redelivery wrote one more output, which
// the relay sent: four invoices for an order never processed.
func TestSQLiteOutboxWritesNothingAfterTheTransactionWasRolledBack(t *testing.T) {
	for _, how := range []string{"handler-rollback", "on-conflict-rollback", "trigger-raise-rollback"} {
		for _, output := range []string{"returned", "published"} {
			t.Run(how+"/"+output, func(t *testing.T) {
				db := testdb.OpenSQLite(t, filepath.Join(t.TempDir(), "inbox.db"))
				exec(t, db, "CREATE TABLE business (id TEXT NOT NULL PRIMARY KEY)")
				switch how {
				case "on-conflict-rollback":
					exec(t, db, "CREATE TABLE customers (k TEXT NOT NULL PRIMARY KEY ON CONFLICT ROLLBACK)")
				default:
					exec(t, db, "CREATE TABLE customers (k TEXT NOT NULL)")
					exec(t, db, "CREATE TRIGGER customers_once BEFORE INSERT ON customers"+
						" WHEN EXISTS (SELECT 1 FROM customers WHERE k = NEW.k) BEGIN SELECT RAISE(ROLLBACK, 'duplicate customer'); END")
				}
				exec(t, db, "INSERT INTO customers (k) VALUES ('customer-1')")
				broker := newBrokerStub()
				ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Publisher: broker})
				if err != nil {
					t.Fatal(err)
				}
				if err := ob.InitializeSchema(context.Background()); err != nil {
					t.Fatal(err)
				}
				ib, err := inbox.New(inbox.Config{DB: db, Outbox: ob.Publisher})
				if err != nil {
					t.Fatal(err)
				}
				if err := ib.InitializeSchema(context.Background()); err != nil {
					t.Fatal(err)
				}
				var published error
				in := newFeed()
				runRouter(t, func(r *message.Router) {
					r.AddMiddleware(ib.Middleware)
					r.AddHandler("billing", "orders", in, "invoices", nil, func(msg *message.Message) ([]*message.Message, error) {
						tx, _ := inbox.TxFromContext(msg.Context())
						ctx := msg.Context()
						if _, err := tx.ExecContext(ctx, "INSERT INTO business (id) VALUES (?)", msg.UUID); err != nil {
							return nil, err
						}
						if how == "handler-rollback" {
							if _, err := tx.ExecContext(ctx, "ROLLBACK"); err != nil {
								return nil, err
							}
						} else {
							_, _ = tx.ExecContext(ctx, "INSERT INTO customers (k) VALUES ('customer-1')") // "already there"
						}
						out := message.NewMessage(watermill.NewUUID(), []byte("invoice"))
						if output == "returned" {
							return []*message.Message{out}, nil
						}
						pub, _ := inbox.OutboxFromContext(ctx)
						published = pub.Publish("invoices", out)
						return nil, nil // its error ignored too
					})
				})
				msg := message.NewMessage(watermill.NewUUID(), []byte("order"))
				for i := 0; i < 4; i++ { // the delivery and the broker's redeliveries
					if in.deliver(t, msg) {
						t.Fatalf("delivery %d acked; want nacked: its transaction was rolled back", i+1)
					}
				}
				if output == "published" && !errors.Is(published, inbox.ErrTxRolledBack) {
					t.Errorf("Publish after the rollback = %v, want an error wrapping ErrTxRolledBack", published)
				}
				if n := count(t, db, ob.Table(), ""); n != 0 {
					t.Errorf("%d outputs in the outbox for an order never processed (business rows %d); want 0",
						n, count(t, db, "business", ""))
				}
				if round := ob.RelayOnce(context.Background()); round.Err != nil || round.Relayed != 0 {
					t.Errorf("relay round = %+v, want nothing relayed", round)
				}
			})
		}
	}
}
