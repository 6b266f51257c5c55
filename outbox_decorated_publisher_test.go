package inbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// decorated is Config.Outbox with the Outbox's writer behind Watermill's
// MessageTransformPublisherDecorator (as a tracing or correlation
// decorator wraps it), which sets correlation_id on every message.
func decorated(ob *inbox.Outbox) func(*sqlx.Tx) (message.Publisher, error) {
	return func(tx *sqlx.Tx) (message.Publisher, error) {
		p, err := ob.Publisher(tx)
		if err != nil {
			return nil, err
		}
		return message.MessageTransformPublisherDecorator(func(m *message.Message) {
			m.Metadata.Set("correlation_id", "c-1")
		})(p)
	}
}

// A decorated outbox publisher is bound to the delivery as the Outbox's own
// is: a handler that ignored a deadlock and returned its invoice writes
// nothing (on MySQL/MariaDB the write went through in autocommit, was
// relayed although the delivery was nacked, and the redelivery wrote a
// second invoice under a new UUID: two invoices for one order), and the
// invoice its redelivery returns goes through the decorator.
func TestDecoratedOutboxPublisherWritesNothingAfterADeadlockTheHandlerIgnored(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if tdb.Dialect == inbox.SQLite {
			t.Skip("one writer at a time: no deadlock")
		}
		broker := newBrokerStub()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, PollInterval: time.Hour})
		f := newFixture(t, db)
		ib := f.newInbox(inbox.Config{Outbox: decorated(ob)})
		victim := deadlockVictim(t, tdb.Dialect, db)
		deadlock := true
		in, out := newFeed(), &outcomes{}
		runRouter(t, func(r *message.Router) {
			r.AddMiddleware(out.Middleware, ib.Middleware)
			r.AddHandler("billing", "orders", in, "invoices", nil, func(msg *message.Message) ([]*message.Message, error) {
				if deadlock {
					tx, _ := inbox.TxFromContext(msg.Context())
					_ = victim(msg, tx) // a sloppy handler ignores the deadlock
				}
				return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("invoice of "+msg.UUID))}, nil
			})
		})
		msg := message.NewMessage(watermill.NewUUID(), []byte("order"))
		if in.deliver(t, delivery(msg, "first")) {
			t.Fatal("the delivery whose transaction the deadlock rolled back was acked")
		}
		if st, err := ob.Stats(context.Background()); err != nil || st.Pending != 0 {
			t.Errorf("outbox after the nacked delivery: %+v, %v; want nothing written", st, err)
		}
		deadlock = false
		if !in.deliver(t, delivery(msg, "redelivery")) {
			t.Fatalf("redelivery nacked: %v", out.last("redelivery"))
		}
		relayUntilEmpty(t, ob)
		broker.mu.Lock()
		defer broker.mu.Unlock()
		if got := broker.accepted["invoices"]; len(got) != 1 || got[0].Metadata.Get("correlation_id") != "c-1" {
			t.Errorf("one order processed once sent %d invoices (%v), want 1 with the decorator's correlation_id", len(got), got)
		}
	})
}

// A commit whose outputs went through a decorated outbox publisher wakes the
// relay, as the Outbox's own publisher's does: they were left for the next
// poll (PollInterval, an hour here).
func TestDecoratedOutboxPublisherWakesTheRelay(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		broker := newBrokerStub()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, PollInterval: time.Hour})
		ib := newFixture(t, db).newInbox(inbox.Config{Outbox: decorated(ob)})
		in := newFeed()
		runRouter(t, func(r *message.Router) {
			r.AddPlugin(ob.RouterPlugin)
			r.AddMiddleware(ib.Middleware)
			r.AddHandler("billing", "orders", in, "invoices", nil, func(msg *message.Message) ([]*message.Message, error) {
				return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("invoice"))}, nil
			})
		})
		waitFor(t, func() bool { st, err := ob.Stats(context.Background()); return err == nil && st.Pending == 0 }) // a first round ran
		time.Sleep(100 * time.Millisecond)
		if !in.deliver(t, message.NewMessage(watermill.NewUUID(), []byte("order"))) {
			t.Fatal("nacked")
		}
		deadline := time.Now().Add(10 * time.Second)
		for len(broker.uuids("invoices")) == 0 && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		if n := len(broker.uuids("invoices")); n != 1 {
			t.Errorf("10 s after the commit the relay had sent %d invoices, want 1: not woken, left for its next poll in an hour", n)
		}
	})
}

// An outbox factory that panics after it made the Outbox's writer (a
// decorator misconfigured) leaves nothing behind in the registry of the
// writers made during factory calls: every delivery of a message that
// kept being redelivered left its transaction there, held for good.
func TestPanickingOutboxFactoryLeavesNoWriterBehind(t *testing.T) {
	db := sqliteDB(t)
	ob := newTestOutbox(t, db, inbox.SQLite, inbox.OutboxConfig{Publisher: newBrokerStub(), PollInterval: time.Hour})
	ib := newFixture(t, db).newInbox(inbox.Config{Outbox: func(tx *sqlx.Tx) (message.Publisher, error) {
		p, err := ob.Publisher(tx)
		if err != nil {
			return nil, err
		}
		var decorate func(message.Publisher) (message.Publisher, error) // never set
		return decorate(p)
	}})
	before := inbox.OutboxFactoryCalls()
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(middleware.Recoverer, ib.Middleware)
		r.AddHandler("billing", "orders", in, "invoices", nil, func(*message.Message) ([]*message.Message, error) { return nil, nil })
	})
	for range 5 {
		if in.deliver(t, message.NewMessage(watermill.NewUUID(), []byte("order"))) {
			t.Fatal("acked a delivery whose outbox factory panicked")
		}
	}
	if n := inbox.OutboxFactoryCalls() - before; n != 0 {
		t.Errorf("after 5 deliveries whose outbox factory panicked, the registry holds %d entries more, want none", n)
	}
}
