package inbox_test

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A claim the database refuses for a privilege the session lacks (a GRANT
// missing on the inbox table, a role changed, a SET ROLE a handler left on
// its pooled connection) nacks each message as transient, its handler not
// called: nothing about the message is wrong, and a poison filter built on
// IsTransient keeps the topic. PostgreSQL's 42501 was not transient, and
// the messages went to the poison queue unprocessed. Once the privilege is
// granted, they are processed.
func TestClaimRefusedForAPrivilegeIsTransient(t *testing.T) {
	t.Parallel()
	plain := testdb.OpenPostgres(t, "")
	f := newFixture(t, plain)
	f.newInbox(inbox.Config{}) // the table, made by a user who may
	role := "inbox_noprivs_" + randomSuffix()
	if _, err := plain.Exec("CREATE ROLE " + role + " NOLOGIN"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = plain.Exec("REVOKE ALL ON " + f.inbox + " FROM " + role)
		_, _ = plain.Exec("DROP ROLE " + role)
	})
	// Every connection of this pool runs as that role (a startup parameter:
	// what SET ROLE does).
	db := testdb.OpenPostgres(t, "role="+role)
	ib, err := inbox.New(inbox.Config{DB: db, Table: f.inbox})
	if err != nil {
		t.Fatal(err)
	}
	var calls int
	rec := &recorder{}
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(rec.Middleware, ib.Middleware)
		r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
			calls++
			return nil
		})
	})
	msg := message.NewMessage(watermill.NewUUID(), []byte("payload"))
	for range 2 {
		if in.deliver(t, msg.Copy()) {
			t.Fatal("a message was acked by an inbox whose database user may not write its table")
		}
		if err := rec.last(); !inbox.IsTransient(err) {
			t.Fatalf("nacked with %v, want a transient error", err)
		}
	}
	if calls != 0 {
		t.Fatalf("handler called %d times, want none", calls)
	}
	if _, err := plain.ExecContext(context.Background(), "GRANT SELECT, INSERT ON "+f.inbox+" TO "+role); err != nil {
		t.Fatal(err)
	}
	if !in.deliver(t, msg.Copy()) || calls != 1 || count(t, plain, f.inbox, "") != 1 {
		t.Errorf("after the GRANT: handler calls %d, inbox rows %d; want the message processed once", calls, count(t, plain, f.inbox, ""))
	}
}
