package inbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A handler that sets its transaction's search_path (SET LOCAL: a schema
// per tenant) to a schema that holds a table named like the outbox table
// has its returned messages written to the outbox the relay reads, and
// sent: the inbox writes them after the handler returned, in its
// transaction, and an unqualified table name resolved to the tenant's
// table, where the outputs were committed and never sent. RouterPlugin's
// Verify (or InitializeSchema) pins the name to the schema it resolves to
// at startup.
func TestOutboxWritesToItsTableWhateverTheHandlersSearchPath(t *testing.T) {
	t.Parallel()
	db := testdb.OpenPostgres(t, "")
	broker := newBrokerStub()
	ob, table := newNamedTestOutbox(t, db, inbox.PostgreSQL, inbox.OutboxConfig{Publisher: broker, PollInterval: time.Hour})
	tenant := "tenant_" + randomSuffix()
	exec(t, db, "CREATE SCHEMA "+tenant)
	t.Cleanup(func() { _, _ = db.Exec("DROP SCHEMA " + tenant + " CASCADE") })
	exec(t, db, "CREATE TABLE "+tenant+"."+table+" (LIKE "+table+" INCLUDING ALL)")
	f := newFixture(t, db)
	middleware := f.newInbox(inbox.Config{Outbox: ob.Publisher}).Middleware
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddPlugin(ob.RouterPlugin)
		r.AddMiddleware(middleware)
		r.AddHandler("billing", "orders", in, "invoices", broker, func(msg *message.Message) ([]*message.Message, error) {
			tx, _ := inbox.TxFromContext(msg.Context())
			if _, err := tx.ExecContext(msg.Context(), "SET LOCAL search_path TO "+tenant+", public"); err != nil {
				return nil, err
			}
			return []*message.Message{message.NewMessage(msg.UUID+"-invoice", []byte("invoice"))}, nil
		})
	})
	order := message.NewMessage(watermill.NewUUID(), nil)
	if !in.deliver(t, order) {
		t.Fatal("the message was nacked")
	}
	waitFor(t, func() bool { return len(broker.uuids("invoices")) == 1 })
	if n := count(t, db, tenant+"."+table, ""); n != 0 {
		t.Errorf("the tenant's table named like the outbox holds %d rows, want none", n)
	}
	if stats, err := ob.Stats(context.Background()); err != nil || stats.Pending != 0 {
		t.Errorf("outbox: %+v (%v), want nothing pending", stats, err)
	}
}
