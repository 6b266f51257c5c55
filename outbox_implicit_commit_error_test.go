package inbox_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// On MariaDB, a handler whose statement commits implicitly (ANALYZE TABLE,
// LOCK TABLES: the claim and its effects are then committed) and that
// returns an output fails with ErrTransactionEnded, the handler's mistake,
// which the default poison filter takes: it failed with ErrTxRolledBack,
// "the database rolled the transaction back", transient, so the
// redelivery was skipped as a duplicate and the output lost with nothing
// to tell.
func TestOutputAfterAnImplicitCommitFailsAsTheHandlersEndOfTheTransaction(t *testing.T) {
	for _, c := range []struct {
		stmt   string
		unlock bool
	}{
		{"ANALYZE TABLE {t}", false},
		{"LOCK TABLES {t} WRITE", true},
		// Left in force: the writer's read of the claim is then refused
		// (1100, a table not locked): it cannot tell a commit from a
		// rollback, and takes the handler's end for a commit.
		{"LOCK TABLES {t} WRITE", false},
	} {
		stmt := c.stmt
		t.Run(fmt.Sprintf("%s/unlock=%v", stmt, c.unlock), func(t *testing.T) {
			db := testdb.OpenMySQL(t, "")
			f := newFixture(t, db)
			ob := newTestOutbox(t, db, inbox.MySQL, inbox.OutboxConfig{Publisher: newBrokerStub()})
			ib := f.newInbox(inbox.Config{Dialect: inbox.MySQL, Outbox: ob.Publisher})
			rec := &recorder{}
			in := newFeed()
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(rec.Middleware, ib.Middleware)
				r.AddHandler("billing", "orders", in, "invoices", nil, func(msg *message.Message) ([]*message.Message, error) {
					if err := f.writeBusinessRow(msg); err != nil {
						return nil, err
					}
					tx, _ := inbox.TxFromContext(msg.Context())
					if _, err := tx.ExecContext(msg.Context(), expand(stmt, f.business)); err != nil {
						return nil, err
					}
					if c.unlock {
						_, _ = tx.ExecContext(msg.Context(), "UNLOCK TABLES")
					}
					return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("invoice"))}, nil
				})
			})
			if in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
				t.Fatal("acked; want nacked: the handler ended the transaction")
			}
			if err := rec.last(); !errors.Is(err, inbox.ErrTransactionEnded) || errors.Is(err, inbox.ErrTxRolledBack) {
				t.Errorf("error = %v, want one wrapping ErrTransactionEnded and not ErrTxRolledBack", err)
			}
			if inbox.IsTransient(rec.last()) {
				t.Error("the error is transient; want it not: a retry cannot bring the lost output back")
			}
		})
	}
}

// A handler that commits the transaction itself and then publishes an
// output through OutboxFromContext gets ErrTransactionEnded (not
// transient), as the delivery does: it got ErrTxRolledBack, transient, which
// said the database had rolled back what the handler had committed.
func TestOutboxPublishAfterTheHandlersCommitIsRefusedAsTheHandlersEnd(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if tdb.Dialect == inbox.SQLite {
			t.Skip("modernc.org/sqlite reports no transaction status: the output is written on its own, once, beside the committed claim")
		}
		f := newFixture(t, db)
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: newBrokerStub()})
		ib := f.newInbox(inbox.Config{Outbox: ob.Publisher})
		var published error
		rec := &recorder{}
		in := newFeed()
		runRouter(t, func(r *message.Router) {
			r.AddMiddleware(rec.Middleware, ib.Middleware)
			r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
				if err := f.writeBusinessRow(msg); err != nil {
					return err
				}
				tx, _ := inbox.TxFromContext(msg.Context())
				if _, err := tx.ExecContext(msg.Context(), "COMMIT"); err != nil {
					return err
				}
				pub, _ := inbox.OutboxFromContext(msg.Context())
				published = pub.Publish("invoices", message.NewMessage(watermill.NewUUID(), []byte("invoice")))
				return nil
			})
		})
		if in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
			t.Fatal("acked; want nacked: the handler ended the transaction")
		}
		if !errors.Is(published, inbox.ErrTransactionEnded) || inbox.IsTransient(published) {
			t.Errorf("Publish after the handler's COMMIT = %v, want an error wrapping ErrTransactionEnded, not transient", published)
		}
		if n := count(t, db, ob.Table(), ""); n != 0 {
			t.Errorf("%d outputs written; want 0", n)
		}
	})
}
