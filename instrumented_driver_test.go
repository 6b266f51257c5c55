package inbox_test

import (
	"testing"

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
