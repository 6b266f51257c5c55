package sqliteoutboxv4_test

import (
	"slices"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox/internal/testdb"
)

// publishThree publishes three messages to topic's outbox through the
// forwarder's envelope, for the destination topic "invoices", and returns
// their UUIDs in order.
func publishThree(t *testing.T, db *sqlx.DB, topic string) []string {
	t.Helper()
	pub := outboxPublisher(t, wsql.BeginnerFromStdSQL(db.DB), topic)
	var sent []string
	for range 3 {
		msg := message.NewMessage(watermill.NewUUID(), []byte("invoice"))
		if err := pub.Publish("invoices", msg); err != nil {
			t.Fatal(err)
		}
		sent = append(sent, msg.UUID)
	}
	return sent
}

// With DeleteOnAck, a row leaves the outbox only after the forwarder
// published it to the destination and acked it: a forwarder stopped while
// a destination publish hangs (the destination got the message but never
// confirmed) leaves that row and the rest of its batch in the table. A new
// forwarder sends them again, in order, and then the table is empty.
func TestQueueDeleteOnAck_keeps_rows_of_a_stopped_forwarder(t *testing.T) {
	t.Parallel()
	db := testdb.OpenSQLite(t, newDBFile(t))
	topic := outboxTopic()
	dest := newDestination(t)
	next := receive(t, dest, "invoices")
	first := queueSubscriber(t, db, topic, 10) // one batch holds all three
	sent := publishThree(t, db, topic)

	stalling := newStallingPublisher(t, dest, sent[1])
	fwd := startForwarder(t, first, stalling, topic)
	if got := next(); got != sent[0] {
		t.Fatalf("forwarded %s first, want %s", got, sent[0])
	}
	<-stalling.stalled
	fwd.stop() // closes the subscriber while the publish of sent[1] hangs
	stalling.unblock()

	// The batch's transaction did not commit its ack (the subscriber's
	// context ends with it), or committed it up to sent[0]: sent[0] may be
	// sent again (at least once), the others must be there.
	left := queuedUUIDs(t, db, topic)
	if len(left) == 3 && left[0] == sent[0] {
		left = left[1:]
	}
	if len(left) != 2 || left[0] != sent[1] || left[1] != sent[2] {
		t.Fatalf("after the forwarder stopped while publishing %s, the outbox holds %v; want %v, possibly after %s",
			sent[1], queuedUUIDs(t, db, topic), sent[1:], sent[0])
	}

	startForwarder(t, queueSubscriber(t, db, topic, 10), dest, topic)
	// At least once: sent[0] may come again, and so may sent[1], whose
	// stalled publish can still reach the destination once unblocked. What
	// must hold: sent[1] arrives before sent[2], and nothing else comes.
	var got []string
	for len(got) == 0 || got[len(got)-1] != sent[2] {
		got = append(got, next())
	}
	if i := slices.Index(got, sent[1]); i < 0 || slices.ContainsFunc(got, func(id string) bool { return !slices.Contains(sent, id) }) {
		t.Fatalf("the new forwarder sent %v; want %v in order, possibly after %s or a repeat of %s", got, sent[1:], sent[0], sent[1])
	}
	waitEmpty(t, db, topic)
}

// With DeleteOnAck, a message whose destination publish outlives the
// subscriber's ack deadline is not deleted: the subscriber's ack covers the
// batch's messages up to the last one acked, not the ones it read after it
// (watermill-sql v4.1.2 passes those too). Once the destination answers,
// the rest is forwarded in order and the table is empty.
func TestQueueDeleteOnAck_keeps_rows_past_the_ack_deadline(t *testing.T) {
	t.Parallel()
	db := testdb.OpenSQLite(t, newDBFile(t))
	topic := outboxTopic()
	dest := newDestination(t)
	next := receive(t, dest, "invoices")
	sub := queueSubscriberWithDeadline(t, db, topic, 10, 50*time.Millisecond)
	sent := publishThree(t, db, topic)

	stalling := newStallingPublisher(t, dest, sent[1])
	startForwarder(t, sub, stalling, topic)
	if got := next(); got != sent[0] {
		t.Fatalf("forwarded %s first, want %s", got, sent[0])
	}
	<-stalling.stalled
	// Past the deadline the subscriber gives up on sent[1] and commits the
	// ack of sent[0].
	left := queuedUUIDs(t, db, topic)
	for deadline := time.Now().Add(time.Minute); len(left) == 3 && time.Now().Before(deadline); left = queuedUUIDs(t, db, topic) {
		time.Sleep(10 * time.Millisecond)
	}
	if len(left) != 2 || left[0] != sent[1] || left[1] != sent[2] {
		t.Fatalf("after the ack deadline of %s passed, the outbox holds %v; want %v", sent[1], left, sent[1:])
	}

	stalling.unblock()
	// sent[1] may come twice (its stalled publish, then the redelivery).
	var got []string
	for len(got) == 0 || got[len(got)-1] != sent[2] {
		got = append(got, next())
	}
	if slices.Index(got, sent[1]) < 0 || slices.ContainsFunc(got, func(id string) bool { return id != sent[1] && id != sent[2] }) {
		t.Fatalf("then forwarded %v; want %v in order, possibly with %s twice", got, sent[1:], sent[1])
	}
	waitEmpty(t, db, topic)
}
