package inbox_test

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// Through instrumentation drivers (XSAM/otelsql, and one that keeps the
// wrapped connection unexported, as ngrok/sqlmw and instrumentedsql do) a
// message is processed once and its duplicate skipped: the status read
// through the wrapper, or the claim's read before COMMIT where there is
// none, never takes a live transaction for an ended one.
func TestInstrumentedDriversProcessEachMessageOnce(t *testing.T) {
	t.Parallel()
	for name, open := range map[string]func(t *testing.T) *sqlx.DB{
		"postgres-otelsql": func(t *testing.T) *sqlx.DB {
			return sqlx.NewDb(testdb.OpenPostgresWith(t, otelsqlPgx(t), "").DB, "pgx")
		},
		"postgres-hidden-conn": func(t *testing.T) *sqlx.DB {
			return sqlx.NewDb(testdb.OpenPostgresWith(t, hiddenConnPgx(), "").DB, "pgx")
		},
		"mysql-otelsql": func(t *testing.T) *sqlx.DB {
			return sqlx.NewDb(testdb.OpenMySQLWith(t, otelsqlMySQL(t), "").DB, "mysql")
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db := open(t)
			f := newFixture(t, db)
			ib := f.newInbox(inbox.Config{})
			var calls int
			in := newFeed()
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(ib.Middleware)
				r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
					calls++
					return f.writeBusinessRow(msg)
				})
			})
			msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
			for i := range 2 {
				if !in.deliver(t, msg) {
					t.Fatalf("delivery %d nacked", i+1)
				}
			}
			if calls != 1 || f.businessRows() != 1 || f.inboxRows() != 1 {
				t.Errorf("handler calls %d, business rows %d, inbox rows %d; want 1 each", calls, f.businessRows(), f.inboxRows())
			}
		})
	}
}

// Through a driver wrapper that hides the transaction status, a handler
// that ran ROLLBACK and then emits outputs (published through
// OutboxFromContext, or returned) writes nothing to the outbox and is
// nacked: the outbox INSERT ran outside any transaction and committed on
// its own, so the outputs of a message that was not processed were sent,
// and sent again under new UUIDs by the redelivery.
func TestOutboxWritesNothingAfterARollbackThroughAHiddenStatusWrapper(t *testing.T) {
	t.Parallel()
	for _, emit := range []string{"published", "returned"} {
		t.Run(emit, func(t *testing.T) {
			t.Parallel()
			db := sqlx.NewDb(testdb.OpenPostgresWith(t, hiddenConnPgx(), "").DB, "pgx")
			broker := newBrokerStub()
			ob := newTestOutbox(t, db, inbox.PostgreSQL, inbox.OutboxConfig{Publisher: broker, PollInterval: time.Hour})
			f := newFixture(t, db)
			ib := f.newInbox(inbox.Config{Outbox: ob.Publisher})
			var publishErr error
			in := newFeed()
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(ib.Middleware)
				r.AddHandler("billing", "orders", in, "invoices", &recordingPublisher{fail: true}, func(msg *message.Message) ([]*message.Message, error) {
					if err := f.writeBusinessRow(msg); err != nil {
						return nil, err
					}
					tx, _ := inbox.TxFromContext(msg.Context())
					if _, err := tx.ExecContext(msg.Context(), "ROLLBACK"); err != nil {
						return nil, err
					}
					out := message.NewMessage(msg.UUID+"-invoice", nil)
					if emit == "published" {
						pub, _ := inbox.OutboxFromContext(msg.Context())
						publishErr = pub.Publish("invoices", out)
						return nil, nil // and ignores that error
					}
					return []*message.Message{out}, nil
				})
			})
			if in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
				t.Error("acked a message whose handler rolled its transaction back")
			}
			if emit == "published" && publishErr == nil {
				t.Error("the outbox took a message after the handler's ROLLBACK")
			}
			if n := count(t, db, relayTable(t, ob), ""); n != 0 {
				t.Errorf("%d outbox rows written for a message that was rolled back, want 0", n)
			}
		})
	}
}

// Through a driver wrapper that hides the transaction status, a handler
// may publish to the outbox from several goroutines at once, and may change
// its transaction's search_path (a tenant's schema): every output is
// written and the message is acked. The check before each write read rows,
// and another goroutine's statement came between the query and its row
// (pgx panicked); and it read the inbox table by its unqualified name,
// which the handler's search_path no longer found, aborting the
// transaction: every delivery was nacked.
func TestHiddenStatusWrapperTakesConcurrentPublishesAndASearchPath(t *testing.T) {
	t.Parallel()
	for _, searchPath := range []bool{false, true} {
		t.Run(map[bool]string{false: "concurrent publishes", true: "search_path"}[searchPath], func(t *testing.T) {
			t.Parallel()
			db := sqlx.NewDb(testdb.OpenPostgresWith(t, hiddenConnPgx(), "").DB, "pgx")
			schema := "tenant_" + randomSuffix()
			exec(t, db, "CREATE SCHEMA "+schema)
			t.Cleanup(func() { db.Exec("DROP SCHEMA IF EXISTS " + schema + " CASCADE") })
			broker := newBrokerStub()
			ob := newTestOutbox(t, db, inbox.PostgreSQL, inbox.OutboxConfig{Publisher: broker, PollInterval: time.Hour})
			f := newFixture(t, db)
			ib := f.newInbox(inbox.Config{Outbox: ob.Publisher})
			outputs := 8
			if searchPath {
				outputs = 0 // the outbox table's name is unqualified too
			}
			var publishErrs atomic.Int32
			in := newFeed()
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(ib.Middleware)
				r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
					if err := f.writeBusinessRow(msg); err != nil {
						return err
					}
					if searchPath {
						tx, _ := inbox.TxFromContext(msg.Context())
						if _, err := tx.ExecContext(msg.Context(), "SET LOCAL search_path TO "+schema); err != nil {
							return err
						}
					}
					pub, _ := inbox.OutboxFromContext(msg.Context())
					var wg sync.WaitGroup
					for i := range outputs {
						wg.Go(func() {
							if err := pub.Publish("invoices", message.NewMessage(fmt.Sprintf("%s-%d", msg.UUID, i), nil)); err != nil {
								publishErrs.Add(1)
							}
						})
					}
					wg.Wait()
					return nil
				})
			})
			if !in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
				t.Fatal("nacked")
			}
			if n := count(t, db, relayTable(t, ob), ""); publishErrs.Load() != 0 || n != outputs || f.businessRows() != 1 {
				t.Errorf("publish errors %d, outbox rows %d, business rows %d; want 0, %d, 1", publishErrs.Load(), n, f.businessRows(), outputs)
			}
		})
	}
}
