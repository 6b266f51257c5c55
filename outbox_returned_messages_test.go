package inbox_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/watermill-inbox/inbox"
)

// A handler added without a publish topic that returns messages, with
// Config.Outbox set, is a configuration mistake, not the message's: the
// delivery fails with a transient error wrapping ErrInvalidConfig and waits
// for the fix, as a publish topic without Config.Outbox does. It was not
// transient, and a poison queue filter drained the whole topic.
func TestReturnedMessagesWithoutAPublishTopicWaitForTheConfigurationFix(t *testing.T) {
	db := sqliteDB(t)
	ob := newTestOutbox(t, db, inbox.SQLite, inbox.OutboxConfig{Publisher: newBrokerStub(), PollInterval: time.Hour})
	ib := newFixture(t, db).newInbox(inbox.Config{Outbox: ob.Publisher})
	poison, sink := poisonUnlessTransient(t)
	in, out := newFeed(), &outcomes{}
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(out.Middleware, poison, ib.Middleware)
		r.AddHandler("billing", "orders", in, "", nil, func(msg *message.Message) ([]*message.Message, error) {
			return []*message.Message{message.NewMessage(msg.UUID+"-out", []byte("x"))}, nil
		})
	})
	if in.deliver(t, delivery(message.NewMessage(watermill.NewUUID(), []byte("order")), "1")) {
		t.Fatal("acked")
	}
	if err := out.last("1"); !errors.Is(err, inbox.ErrInvalidConfig) || !inbox.IsTransient(err) ||
		!strings.Contains(err.Error(), "the handler returned 1 message but has no publish topic") {
		t.Errorf("router got %v (transient %v), want ErrInvalidConfig, transient", err, inbox.IsTransient(err))
	}
	if n := len(sink.poisoned()); n != 0 {
		t.Errorf("%d messages poisoned for a configuration mistake", n)
	}
	if n := count(t, db, ob.Table(), ""); n != 0 {
		t.Errorf("%d outputs in the outbox", n)
	}
}

// Watermill's middleware.CorrelationID, added to the router before the
// inbox (outside it), sets the consumed message's correlation ID on the
// messages the handler returns; the inbox writes those to the outbox and
// returns none to it, so they reached the broker without it. The inbox
// gives it to returned messages that have none, and leaves one a handler
// (or a CorrelationID middleware inside the inbox) set.
func TestReturnedMessagesKeepTheCorrelationIDThroughTheOutbox(t *testing.T) {
	db := sqliteDB(t)
	broker := newBrokerStub()
	ob := newTestOutbox(t, db, inbox.SQLite, inbox.OutboxConfig{Publisher: broker, PollInterval: time.Hour})
	ib := newFixture(t, db).newInbox(inbox.Config{Outbox: ob.Publisher})
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(middleware.CorrelationID, ib.Middleware)
		r.AddHandler("billing", "orders", in, "documents", nil, func(msg *message.Message) ([]*message.Message, error) {
			own := message.NewMessage(msg.UUID+"-own", []byte("y"))
			middleware.SetCorrelationID("set-by-the-handler", own)
			// A message made as a struct literal has nil Metadata: giving it
			// the correlation ID panicked ("assignment to entry in nil map").
			literal := &message.Message{UUID: msg.UUID + "-literal", Payload: []byte("z")}
			return []*message.Message{message.NewMessage(msg.UUID+"-out", []byte("x")), own, literal}, nil
		})
	})
	msg := message.NewMessage(watermill.NewUUID(), []byte("order"))
	middleware.SetCorrelationID("corr-42", msg)
	if !in.deliver(t, msg) {
		t.Fatal("nacked")
	}
	relayUntilEmpty(t, ob)
	got := map[string]string{}
	broker.mu.Lock()
	for _, m := range broker.accepted["documents"] {
		got[m.UUID] = middleware.MessageCorrelationID(m)
	}
	broker.mu.Unlock()
	want := map[string]string{msg.UUID + "-out": "corr-42", msg.UUID + "-own": "set-by-the-handler", msg.UUID + "-literal": "corr-42"}
	for id, c := range want {
		if got[id] != c {
			t.Errorf("relayed %s with correlation ID %q, want %q (all: %v)", id, got[id], c, got)
		}
	}
}

// A nil message in the slice a handler returns is refused with
// ErrOutboxMessage, not transient: the outbox write panicked on it, on
// every delivery.
func TestReturnedNilMessageIsRefused(t *testing.T) {
	db := sqliteDB(t)
	ob := newTestOutbox(t, db, inbox.SQLite, inbox.OutboxConfig{Publisher: newBrokerStub(), PollInterval: time.Hour})
	ib := newFixture(t, db).newInbox(inbox.Config{Outbox: ob.Publisher})
	in, out := newFeed(), &outcomes{}
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(out.Middleware, ib.Middleware)
		r.AddHandler("billing", "orders", in, "documents", nil, func(msg *message.Message) ([]*message.Message, error) {
			return []*message.Message{message.NewMessage(msg.UUID+"-out", []byte("x")), nil}, nil
		})
	})
	msg := message.NewMessage(watermill.NewUUID(), []byte("order"))
	middleware.SetCorrelationID("corr-42", msg)
	if in.deliver(t, delivery(msg, "1")) {
		t.Fatal("acked")
	}
	if err := out.last("1"); !errors.Is(err, inbox.ErrOutboxMessage) || inbox.IsTransient(err) {
		t.Errorf("router got %v (transient %v); want ErrOutboxMessage, not transient", err, inbox.IsTransient(err))
	}
	if n := count(t, db, ob.Table(), ""); n != 0 {
		t.Errorf("%d outputs in the outbox", n)
	}
}
