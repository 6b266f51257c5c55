package inbox_test

import (
	"path/filepath"
	"slices"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// The key is the handler name, never the host or the process: billing and
// shipping share one table and both get M; the application restarts (new
// pool, new Inbox, new router: as on a new host or process) and M is
// redelivered to both. Two inbox rows, each handler ran once in total, and
// the consumer column holds exactly the handler names.
func TestConsumer_KeyIsTheHandlerNameAcrossRestarts(t *testing.T) {
	t.Parallel()
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		reopen := func() *sqlx.DB { return tdb.Open(t) }
		if tdb.Dialect == inbox.SQLite { // tdb.Open makes a new file: reopen the same one
			path := filepath.Join(t.TempDir(), "inbox.db")
			db = openSQLite(t, path)
			reopen = func() *sqlx.DB { return openSQLite(t, path) }
		}
		f := newFixture(t, db)
		var billing, shipping calls
		msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
		// run is one life of the application: its own pool, inbox and router.
		run := func(life string, db *sqlx.DB) {
			dialectOf.Store(db, tdb.Dialect)
			app := &fixture{t: t, db: db, inbox: f.inbox, business: f.business}
			ib := app.newInbox(inbox.Config{})
			billingIn, shippingIn := newFeed(), newFeed()
			r := runRouter(t, func(r *message.Router) {
				r.AddMiddleware(ib.Middleware)
				r.AddConsumerHandler("billing", "orders", billingIn, func(msg *message.Message) error {
					billing.inc(msg.UUID)
					return app.writeBusinessRow(msg)
				})
				r.AddConsumerHandler("shipping", "orders", shippingIn, func(msg *message.Message) error {
					shipping.inc(msg.UUID)
					return app.writeBusinessRow(msg)
				})
			})
			if !billingIn.deliver(t, msg) || !shippingIn.deliver(t, msg) {
				t.Fatalf("%s: nacked", life)
			}
			if err := r.Close(); err != nil {
				t.Fatal(err)
			}
			if err := ib.Close(); err != nil {
				t.Fatal(err)
			}
		}
		run("first life", db)
		run("after the restart", reopen())

		if billing.get(msg.UUID) != 1 || shipping.get(msg.UUID) != 1 {
			t.Errorf("handler calls in total: billing %d, shipping %d; want 1 and 1",
				billing.get(msg.UUID), shipping.get(msg.UUID))
		}
		var consumers []string
		if err := db.Select(&consumers, "SELECT consumer FROM "+f.inbox+" ORDER BY consumer"); err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(consumers, []string{"billing", "shipping"}) {
			t.Errorf("consumer column = %q, want exactly the handler names [billing shipping]", consumers)
		}
		if f.businessRows() != 2 {
			t.Errorf("business rows = %d, want 2", f.businessRows())
		}
	})
}
