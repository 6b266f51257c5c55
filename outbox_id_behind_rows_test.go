package inbox_test

import (
	"context"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// An outbox table whose id an operator restarted (ALTER TABLE … ALTER
// COLUMN id RESTART, setval) while messages are still pending hands the next
// handlers' outputs ids that those rows hold: the INSERT fails (23505 on the
// primary key). Nothing is wrong with the messages, so the delivery fails
// with a transient error that names the fix, which a poison filter on
// IsTransient (Inbox.Middlewares) keeps on its topic; each try takes the
// next id, and the messages go through once the ids pass the held ones.
// Whatever the key is called: a table made after the old one was renamed
// aside (whose index keeps <table>_pkey) has <table>_pkey1.
func TestOutboxWriteOnAnIDTheTableStillHoldsIsNotPoisoned(t *testing.T) {
	for _, tc := range []struct {
		name          string
		renamedBefore bool // the outbox tables were renamed aside and made again
	}{
		{"key <table>_pkey", false},
		{"key <table>_pkey1", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			db := testdb.OpenPostgres(t, "")
			ctx := context.Background()
			s := randomSuffix()
			table, inboxTable := "outbox_seq_"+s, "inbox_seq_"+s
			for _, name := range []string{inboxTable, table, table + "_dead", table + "_old", table + "_dead_old"} {
				dropLater(t, db, name)
			}
			newOutbox := func() *inbox.Outbox {
				ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Dialect: inbox.PostgreSQL, Table: table, Publisher: newBrokerStub()})
				if err != nil {
					t.Fatal(err)
				}
				if err := ob.InitializeSchema(ctx); err != nil {
					t.Fatal(err)
				}
				return ob
			}
			if tc.renamedBefore {
				newOutbox()
				exec(t, db, "ALTER TABLE "+table+" RENAME TO "+table+"_old")
				exec(t, db, "ALTER TABLE "+table+"_dead RENAME TO "+table+"_dead_old")
			}
			ob := newOutbox()
			ib, err := inbox.New(inbox.Config{DB: db, Dialect: inbox.PostgreSQL, Table: inboxTable, Consumer: "billing", Outbox: ob.Publisher})
			if err != nil {
				t.Fatal(err)
			}
			if err := ib.InitializeSchema(ctx); err != nil {
				t.Fatal(err)
			}
			writeOutbox(t, db, ob, "invoices", 3) // pending: ids 1 to 3
			exec(t, db, "ALTER TABLE "+table+" ALTER COLUMN id RESTART")

			handler := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				pub, ok := inbox.OutboxFromContext(msg.Context())
				if !ok {
					t.Fatal("no outbox in the message context")
				}
				return nil, pub.Publish("invoices", message.NewMessage(watermill.NewUUID(), []byte("invoice")))
			})
			msg := message.NewMessage(watermill.NewUUID(), []byte("order"))
			_, err = handler(msg)
			if err == nil {
				t.Fatal("the handler's output was written on id 1, which a pending row holds")
			}
			if !inbox.IsTransient(err) || !strings.Contains(err.Error(), "setval") {
				t.Errorf("output on an id the outbox table still holds: %v (transient: %v), want a transient error that"+
					" names the fix (setval), so that a poison filter on IsTransient keeps the message", err, inbox.IsTransient(err))
			}
			// Ids 1 to 3 are held: the redelivery that takes id 4 goes through.
			for try := 2; err != nil; try++ {
				if try > 4 {
					t.Fatalf("the output failed %d times, the last with %v; want it written once the ids pass the held ones", try-1, err)
				}
				_, err = handler(msg)
			}
		})
	}
}
