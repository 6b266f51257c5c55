package inbox_test

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// An Outbox made on another database handle than the inbox's that writes
// its messages has its rows written in the inbox's database while its
// relay reads its own: on two databases (two SQLite files here) they were
// committed and never sent, with nothing said, since a relay ran. The
// inbox's logger says so, once, at Info (two handles on one database, as
// the PostgreSQL case here, are right: said, not refused).
func TestOutboxOnAnotherDatabaseHandleThanTheInboxIsSaid(t *testing.T) {
	dir := t.TempDir()
	for _, c := range []struct {
		name              string
		dialect           inbox.Dialect
		inboxDB, outboxDB func(t *testing.T) *sqlx.DB
	}{
		{"sqlite-two-files", inbox.SQLite,
			func(t *testing.T) *sqlx.DB { return testdb.OpenSQLite(t, filepath.Join(dir, "inbox.db")) },
			func(t *testing.T) *sqlx.DB { return testdb.OpenSQLite(t, filepath.Join(dir, "outbox.db")) }},
		{"postgres-two-handles", inbox.PostgreSQL,
			func(t *testing.T) *sqlx.DB { return testdb.OpenPostgres(t, "") },
			func(t *testing.T) *sqlx.DB { return testdb.OpenPostgres(t, "") }},
	} {
		t.Run(c.name, func(t *testing.T) {
			inboxDB, outboxDB := c.inboxDB(t), c.outboxDB(t)
			ob := newTestOutbox(t, outboxDB, c.dialect, inbox.OutboxConfig{Publisher: newBrokerStub(), PollInterval: time.Hour})
			// The table the inbox's transaction writes to, on its database.
			twin, err := inbox.NewOutbox(inbox.OutboxConfig{DB: inboxDB, Dialect: c.dialect, Table: relayTable(t, ob), Publisher: newBrokerStub()})
			if err != nil {
				t.Fatal(err)
			}
			if err := twin.InitializeSchema(context.Background()); err != nil {
				t.Fatal(err)
			}
			logs := newCaptureLogger()
			ib := newFixture(t, inboxDB).newInbox(inbox.Config{Outbox: ob.Publisher, Logger: logs})
			in, out := newFeed(), &outcomes{}
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(out.Middleware, ib.Middleware)
				r.AddHandler("billing", "orders", in, "documents", nil, func(msg *message.Message) ([]*message.Message, error) {
					return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("invoice"))}, nil
				})
			})
			for i := range 2 {
				if !in.deliver(t, delivery(message.NewMessage(watermill.NewUUID(), []byte("order")), "1")) {
					t.Fatalf("delivery %d nacked: %v", i, out.last("1"))
				}
			}
			said := 0
			for _, line := range *logs.lines {
				if line.level == "info" && line.fields["outbox_table"] != nil {
					said++
				}
			}
			if said != 1 || !logs.has("OutboxConfig.DB") {
				t.Errorf("an Outbox on another database handle than the inbox's: %d Info lines naming the outbox table (%v);"+
					" want one that names OutboxConfig.DB", said, *logs.lines)
			}
		})
	}
}
