package inbox_test

import (
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A handler that runs ROLLBACK through the inbox transaction gets the same
// error whether or not it has outputs: on PostgreSQL, which never ends a
// transaction on its own, ErrTransactionEnded, not transient, which the
// poison filter takes; on MySQL/MariaDB and SQLite, where it looks like a
// rollback the database made after an error the handler ignored (a
// deadlock, a full disk), ErrTxRolledBack. With an output returned, or
// published after the ROLLBACK and its error returned, it was
// ErrTxRolledBack on PostgreSQL too, transient: redelivered for ever, the
// handler rolling back each time; without one on SQLite,
// ErrTransactionEnded. Nothing is written to the outbox either way.
func TestHandlersRollbackIsItsEndWhetherOrNotItHasOutputs(t *testing.T) {
	dbs := append([]testDB{{Name: "postgres-libpq", Dialect: inbox.PostgreSQL, Open: func(tb testing.TB) *sqlx.DB {
		return testdb.OpenPostgresWith(tb, "postgres", "")
	}}}, testDBs...)
	for _, tdb := range dbs {
		for _, output := range []string{"none", "returned", "published"} {
			t.Run(tdb.Name+"/"+output, func(t *testing.T) {
				db := tdb.Open(t)
				dialectOf.Store(db, tdb.Dialect)
				ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: newBrokerStub(), PollInterval: time.Hour})
				ib := newFixture(t, db).newInbox(inbox.Config{Outbox: ob.Publisher})
				poison, sink := poisonUnlessTransient(t)
				in, out := newFeed(), &outcomes{}
				runRouter(t, func(r *message.Router) {
					r.AddMiddleware(out.Middleware, poison, ib.Middleware)
					r.AddHandler("billing", "orders", in, "invoices", nil, func(msg *message.Message) ([]*message.Message, error) {
						tx, _ := inbox.TxFromContext(msg.Context())
						if _, err := tx.ExecContext(msg.Context(), "ROLLBACK"); err != nil {
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
				in.deliver(t, delivery(message.NewMessage(watermill.NewUUID(), []byte("order")), "1"))
				got := out.last("1")
				want, poisoned := inbox.ErrTransactionEnded, 1
				if tdb.Dialect == inbox.MySQL || tdb.Dialect == inbox.SQLite {
					// The database rolls back by itself there too, which a
					// ROLLBACK statement looks the same as.
					want, poisoned = inbox.ErrTxRolledBack, 0
				}
				if n := len(sink.poisoned()); n != poisoned {
					t.Errorf("%d messages poisoned, want %d", n, poisoned)
				}
				if got != nil && !errors.Is(got, want) || got == nil && poisoned == 0 {
					t.Errorf("router got %v, want an error wrapping %v", got, want)
				}
				if n := count(t, db, ob.Table(), ""); n != 0 {
					t.Errorf("%d outputs in the outbox", n)
				}
			})
		}
	}
}
