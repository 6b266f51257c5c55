package inbox_test

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// MariaDB's sql_mode EMPTY_STRING_IS_NULL (part of its Oracle mode) makes
// NULL of an empty bind parameter, which the payload column (NOT NULL)
// refused: every output without a payload (a metadata-only event, a
// tombstone) failed its delivery, one returned or published alone, and
// one among several.
func TestOutputsWithoutPayloadAreWrittenUnderEmptyStringIsNull(t *testing.T) {
	db := testdb.OpenMySQL(t, "sql_mode=%27EMPTY_STRING_IS_NULL,STRICT_TRANS_TABLES%27")
	broker := newBrokerStub()
	ob := newTestOutbox(t, db, inbox.MySQL, inbox.OutboxConfig{Publisher: broker, PollInterval: time.Hour})
	ib := newFixture(t, db).newInbox(inbox.Config{Outbox: ob.Publisher})
	in, out := newFeed(), &outcomes{}
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(out.Middleware, ib.Middleware)
		r.AddHandler("billing", "orders", in, "events", nil, func(msg *message.Message) ([]*message.Message, error) {
			ev := message.NewMessage(msg.UUID+"-confirmed", nil)
			ev.Metadata.Set("type", "order.confirmed")
			if msg.Metadata.Get("several") == "" {
				return []*message.Message{ev}, nil
			}
			return []*message.Message{ev, message.NewMessage(msg.UUID+"-invoiced", []byte{})}, nil
		})
	})
	one := message.NewMessage(watermill.NewUUID(), []byte("order"))
	several := message.NewMessage(watermill.NewUUID(), []byte("order"))
	several.Metadata.Set("several", "yes")
	for _, msg := range []*message.Message{one, several} {
		if !in.deliver(t, delivery(msg, msg.UUID)) {
			t.Fatalf("nacked: %v", out.last(msg.UUID))
		}
	}
	relayUntilEmpty(t, ob)
	if got := broker.uuids("events"); len(got) != 3 {
		t.Errorf("relayed %v, want the 3 outputs", got)
	}
}
