package inbox_test

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
)

// An Outbox without a Logger of its own and without its RouterPlugin (the
// relay forgotten) says that no relay runs through the logger of the inbox
// that wrote its messages: it got the router's logger only from its own
// RouterPlugin, so the warning went to watermill.NopLogger, and the
// outputs stayed in the table with nothing to tell.
func TestOutboxWithoutARelayWarnsThroughTheInboxsLogger(t *testing.T) {
	db := sqliteDB(t)
	ob := newTestOutbox(t, db, inbox.SQLite, inbox.OutboxConfig{Publisher: newBrokerStub(), PollInterval: 20 * time.Millisecond})
	logger := newCaptureLogger()
	ib := newFixture(t, db).newInbox(inbox.Config{Outbox: ob.Publisher, Logger: logger})
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(ib.Middleware) // and no r.AddPlugin(ob.RouterPlugin)
		r.AddHandler("billing", "orders", in, "documents", nil, func(msg *message.Message) ([]*message.Message, error) {
			return []*message.Message{message.NewMessage(msg.UUID+"-out", []byte("invoice"))}, nil
		})
	})
	if !in.deliver(t, message.NewMessage(watermill.NewUUID(), []byte("order"))) {
		t.Fatal("nacked")
	}
	waitFor(t, func() bool { return logger.has("no relay runs in this process") })
}

// With two inboxes on one Outbox, the warning goes to the one that logs,
// whichever wrote first: it was bound to the first to write, and went
// nowhere when that one had no logger.
func TestOutboxWithoutARelayWarnsThroughAnInboxThatLogs(t *testing.T) {
	db := sqliteDB(t)
	ob := newTestOutbox(t, db, inbox.SQLite, inbox.OutboxConfig{Publisher: newBrokerStub(), PollInterval: 20 * time.Millisecond})
	logger := newCaptureLogger()
	silent := newFixture(t, db).newInbox(inbox.Config{Outbox: ob.Publisher})
	logging := newFixture(t, db).newInbox(inbox.Config{Outbox: ob.Publisher, Logger: logger})
	for _, ib := range []*inbox.Inbox{silent, logging} {
		in := newFeed()
		runRouter(t, func(r *message.Router) {
			r.AddMiddleware(ib.Middleware)
			r.AddHandler("billing", "orders", in, "documents", nil, func(msg *message.Message) ([]*message.Message, error) {
				return []*message.Message{message.NewMessage(msg.UUID+"-out", []byte("invoice"))}, nil
			})
		})
		if !in.deliver(t, message.NewMessage(watermill.NewUUID(), []byte("order"))) {
			t.Fatal("nacked")
		}
	}
	waitFor(t, func() bool { return logger.has("no relay runs in this process") })
}
