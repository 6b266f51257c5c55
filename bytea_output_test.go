package inbox_test

import (
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A PostgreSQL session whose bytea_output is 'escape' (a role's or a
// database's setting kept for old clients, or one a handler left on its
// pooled connection) read through pgx's simple protocol, the mode PgBouncer
// needs, gives bytea columns as text pgx cannot read: every relay round
// failed ("invalid hex format") and its messages waited for good, and a
// duplicate's stored fingerprint could not be read, so the duplicate was
// nacked again and again. The relay's read and the fingerprint's read now
// ask for hex in their own transaction.
func TestByteaOutputEscapeChangesNothing(t *testing.T) {
	t.Parallel()
	db := testdb.OpenPostgres(t, "bytea_output=escape&default_query_exec_mode=simple_protocol")

	broker := newBrokerStub()
	ob := newTestOutbox(t, db, inbox.PostgreSQL, inbox.OutboxConfig{Publisher: broker})
	ids := writeOutbox(t, db, ob, "payments", 3)
	relayUntilEmpty(t, ob)
	got := broker.messages("payments")
	if len(got) != 3 {
		t.Fatalf("relayed %d messages, want 3", len(got))
	}
	for i, m := range got {
		if m.UUID != ids[i] || string(m.Payload) != fmt.Sprintf("payload %d", i) || m.Metadata.Get("n") != fmt.Sprint(i) {
			t.Errorf("message %d: %s %q %v, want %s %q n=%d", i, m.UUID, m.Payload, m.Metadata, ids[i], fmt.Sprintf("payload %d", i), i)
		}
	}
	assertOutboxEmpty(t, ob)

	// Two inboxes on one table: the second meets the first's message as
	// a duplicate it did not commit, and reads its stored fingerprint.
	f := newFixture(t, db)
	first, second := f.newInbox(inbox.Config{}), f.newInbox(inbox.Config{})
	var calls int
	for _, ib := range []*inbox.Inbox{first, second} {
		in := newFeed()
		runRouter(t, func(r *message.Router) {
			r.AddMiddleware(ib.Middleware)
			r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
				calls++
				return f.writeBusinessRow(msg)
			})
		})
		if !in.deliver(t, message.NewMessage("order-1", []byte("payload"))) {
			t.Fatal("the message, or its duplicate, was nacked")
		}
	}
	if calls != 1 || count(t, db, f.business, "") != 1 {
		t.Errorf("handler calls %d, business rows %d; want the message processed once", calls, count(t, db, f.business, ""))
	}
}
