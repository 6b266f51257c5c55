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

// A handler that ends the transaction through database/sql (tx.Rollback,
// tx.Commit) and returns an output, written through a watermill-sql outbox
// (Config.Outbox) or the library's own, is nacked with ErrTransactionEnded,
// not transient, as without an output (the handler ends the transaction
// again on a redelivery, so the poison filter takes it). After tx.Rollback
// through watermill-sql on MariaDB it was ErrTxRolledBack, transient: the
// check's read on the connection, which outlives the Tx, found the claim
// gone as after a deadlock, and the message was retried for ever.
func TestOutputAfterTheHandlersTxRollbackOrCommitIsTheHandlersEnd(t *testing.T) {
	for _, end := range []string{"tx.Rollback", "tx.Commit"} {
		for _, be := range []struct {
			name string
			pg   bool
			own  bool
			open func(t *testing.T) *sqlx.DB
		}{
			{"mariadb/watermill-sql", false, false, func(t *testing.T) *sqlx.DB { return testdb.OpenMySQL(t, "") }},
			{"mariadb/own-outbox", false, true, func(t *testing.T) *sqlx.DB { return testdb.OpenMySQL(t, "") }},
			{"pgx/watermill-sql", true, false, func(t *testing.T) *sqlx.DB { return testdb.OpenPostgres(t, "") }},
		} {
			t.Run(end+"/"+be.name, func(t *testing.T) {
				db := be.open(t)
				f := newFixture(t, db)
				var cfg inbox.Config
				var rows func() int
				if be.own {
					d := inbox.MySQL
					ob := newTestOutbox(t, db, d, inbox.OutboxConfig{Publisher: newBrokerStub()})
					cfg = inbox.Config{Dialect: d, Outbox: ob.Publisher}
					rows = func() int { return count(t, db, ob.Table(), "") }
				} else {
					o := newSQLOutbox(t, outboxV4, db, be.pg)
					cfg = inbox.Config{Outbox: o.factory, OutboxTables: []string{o.table}}
					rows = func() int { return o.rows(t) }
				}
				ib := f.newInbox(cfg)
				rec := &recorder{}
				in := newFeed()
				calls := 0
				runRouter(t, func(r *message.Router) {
					r.AddMiddleware(rec.Middleware, ib.Middleware)
					r.AddHandler("billing", "orders", in, "invoices", nil, func(msg *message.Message) ([]*message.Message, error) {
						calls++
						if err := f.writeBusinessRow(msg); err != nil {
							return nil, err
						}
						tx, _ := inbox.TxFromContext(msg.Context())
						var err error
						if end == "tx.Rollback" {
							err = tx.Rollback()
						} else {
							err = tx.Commit()
						}
						if err != nil {
							return nil, err
						}
						return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("invoice"))}, nil
					})
				})
				if acked := in.deliver(t, message.NewMessage(watermill.NewUUID(), []byte("order"))); acked {
					t.Fatalf("acked; want nacked")
				}
				got := rec.last()
				if !errors.Is(got, inbox.ErrTransactionEnded) || inbox.IsTransient(got) {
					t.Errorf("router got %v (transient %v), want ErrTransactionEnded, not transient", got, inbox.IsTransient(got))
				}
				if n := rows(); n != 0 {
					t.Errorf("%d outputs written; want 0", n)
				}
			})
		}
	}
}
