package sqliteoutboxv4_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A watermill-sql outbox on SQLite (Config.Outbox) writes nothing after the
// handler's ROLLBACK, whether the output is returned or published: the
// inbox reads the claim before each publish through another package's
// publisher, since modernc.org/sqlite reports no transaction status; the
// output was written in autocommit, once more per redelivery (268 rows for
// an order never processed).
func TestWatermillSQLOutboxOnSQLiteWritesNothingAfterTheHandlersRollback(t *testing.T) {
	for _, how := range []string{"returned", "published"} {
		t.Run(how, func(t *testing.T) {
			path := newDBFile(t)
			db := testdb.OpenSQLite(t, path)
			topic := outboxTopic()
			_ = queueSubscriber(t, testdb.OpenSQLite(t, path), topic, 10) // creates the outbox table
			if _, err := db.Exec("CREATE TABLE business (id TEXT NOT NULL PRIMARY KEY)"); err != nil {
				t.Fatal(err)
			}
			inboxTable := "inbox_" + testdb.RandomSuffix()
			ib, err := inbox.New(inbox.Config{
				DB:    db,
				Table: inboxTable,
				Outbox: func(tx *sqlx.Tx) (message.Publisher, error) {
					return outboxPublisher(t, wsql.TxFromStdSQL(tx.Tx), topic), nil
				},
			})
			if err != nil {
				t.Fatal(err)
			}
			if err := ib.InitializeSchema(context.Background()); err != nil {
				t.Fatal(err)
			}
			var calls atomic.Int64
			var pubErr atomic.Value
			orders := newGoChannel(t, gochannel.Config{})
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(ib.Middleware)
				r.AddHandler("billing", "orders", orders, "invoices", newDestination(t), func(msg *message.Message) ([]*message.Message, error) {
					calls.Add(1)
					tx, _ := inbox.TxFromContext(msg.Context())
					if _, err := tx.ExecContext(msg.Context(), "INSERT INTO business (id) VALUES (?)", msg.UUID); err != nil {
						return nil, err
					}
					if _, err := tx.ExecContext(msg.Context(), "ROLLBACK"); err != nil {
						return nil, err
					}
					out := message.NewMessage(watermill.NewUUID(), []byte("invoice"))
					if how == "returned" {
						return []*message.Message{out}, nil
					}
					pub, _ := inbox.OutboxFromContext(msg.Context())
					if err := pub.Publish("invoices", out); err != nil {
						pubErr.Store(err)
					}
					return nil, nil
				})
			})
			if err := orders.Publish("orders", message.NewMessage(watermill.NewUUID(), []byte("order"))); err != nil {
				t.Fatal(err)
			}
			deadline := time.Now().Add(10 * time.Second)
			for calls.Load() < 4 && time.Now().Before(deadline) {
				time.Sleep(10 * time.Millisecond)
			}
			time.Sleep(100 * time.Millisecond)
			if how == "published" {
				if err, _ := pubErr.Load().(error); !errors.Is(err, inbox.ErrTxRolledBack) {
					t.Errorf("Publish after the ROLLBACK = %v, want an error wrapping ErrTxRolledBack", err)
				}
			}
			if left := queuedUUIDs(t, db, topic); len(left) != 0 {
				t.Errorf("%d outputs in the watermill-sql outbox for an order whose transaction was rolled back (business rows %d, inbox rows %d); want 0",
					len(left), rows(t, db, "business"), rows(t, db, inboxTable))
			}
		})
	}
}
