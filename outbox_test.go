package inbox_test

import (
	"errors"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// The messages a handler returns go to the outbox inside the inbox
// transaction, to the handler's publish topic, not to the router; a rolled
// back message leaves no outbox row; a failed outbox publish is a nack that
// the redelivery repairs, and a duplicate after it is acked without a
// second outbox row.
func TestReturnedMessagesGoThroughOutbox(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		f := newFixture(t, db)
		outbox := outboxTable(t, db)
		var failPublish, failHandler atomic.Bool
		ib := f.newInbox(inbox.Config{Outbox: func(tx *sqlx.Tx) (message.Publisher, error) {
			return &txPublisher{tx: tx, table: outbox, failing: failPublish.Load()}, nil
		}})
		routerPub := &recordingPublisher{fail: true} // would lose the messages if used
		in := newFeed()
		runRouter(t, func(r *message.Router) {
			r.AddMiddleware(ib.Middleware)
			r.AddHandler("billing", "orders", in, "invoices", routerPub, func(msg *message.Message) ([]*message.Message, error) {
				if err := f.writeBusinessRow(msg); err != nil {
					return nil, err
				}
				pub, ok := inbox.OutboxFromContext(msg.Context())
				if !ok {
					return nil, errors.New("no outbox in context")
				}
				if err := pub.Publish("audit", message.NewMessage(watermill.NewUUID(), nil)); err != nil {
					return nil, err
				}
				if failHandler.Load() {
					return nil, errors.New("handler failed after publishing")
				}
				return []*message.Message{message.NewMessage(watermill.NewUUID(), nil), message.NewMessage(watermill.NewUUID(), nil)}, nil
			})
		})
		outboxRows := func(topic string) int { return count(t, db, outbox, "topic = ?", topic) }

		failHandler.Store(true)
		if in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
			t.Fatal("failed handler acked")
		}
		if outboxRows("audit") != 0 {
			t.Fatal("a rolled-back message left an outbox row")
		}
		failHandler.Store(false)

		failPublish.Store(true)
		msg := message.NewMessage(watermill.NewUUID(), nil)
		if in.deliver(t, msg) {
			t.Fatal("acked although the outbox publish failed")
		}
		if f.inboxRows() != 0 || f.businessRows() != 0 {
			t.Fatalf("failed outbox publish left inbox rows %d, business rows %d", f.inboxRows(), f.businessRows())
		}
		failPublish.Store(false)
		wantRows := func(after string) {
			t.Helper()
			if outboxRows("invoices") != 2 || outboxRows("audit") != 1 || f.businessRows() != 1 || f.inboxRows() != 1 {
				t.Errorf("after the %s: outbox invoices %d, audit %d, business %d, inbox %d; want 2, 1, 1, 1",
					after, outboxRows("invoices"), outboxRows("audit"), f.businessRows(), f.inboxRows())
			}
		}
		if !in.deliver(t, msg) {
			t.Fatal("redelivery nacked")
		}
		wantRows("redelivery")
		if !in.deliver(t, msg) {
			t.Fatal("duplicate nacked")
		}
		wantRows("duplicate")
		if routerPub.published != 0 {
			t.Errorf("router published %d messages, want 0", routerPub.published)
		}
	})
}

// With watermill-sql v3 (its publisher on the inbox's *sqlx.Tx, its
// subscriber on the *sqlx.DB), the messages a handler returns and those it
// publishes through OutboxFromContext reach the broker if and only if the
// inbox transaction commits: a handler error, a panic or a failed COMMIT
// forwards nothing, a success forwards each message exactly once, and a
// duplicate delivery forwards nothing again. On PostgreSQL and MariaDB,
// through a real router and Watermill's forwarder.
func TestOutboxV3PublishesIffCommitted(t *testing.T) {
	testOutboxPublishesIffCommitted(t, outboxV3)
}

// Without an outbox, the router publishes returned messages after the
// commit; if that publish fails the message is nacked, and its redelivery is
// skipped as a duplicate: the returned messages are lost. This documents why
// Config.Outbox exists.
func TestReturnedMessagesLostWithoutOutbox(t *testing.T) {
	db := sqliteDB(t)
	f := newFixture(t, db)
	ib := f.newInbox(inbox.Config{})
	routerPub := &recordingPublisher{fail: true}
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(ib.Middleware)
		r.AddHandler("billing", "orders", in, "invoices", routerPub, func(msg *message.Message) ([]*message.Message, error) {
			return []*message.Message{message.NewMessage(watermill.NewUUID(), nil)}, nil
		})
	})
	msg := message.NewMessage(watermill.NewUUID(), nil)
	first := in.deliver(t, msg)
	routerPub.mu.Lock()
	routerPub.fail = false
	routerPub.mu.Unlock()
	second := in.deliver(t, msg)
	if first || !second || routerPub.published != 0 {
		t.Errorf("acked %v then %v, published %d; the documented loss is: nack, then ack as duplicate, 0 published",
			first, second, routerPub.published)
	}
}

// A handler that returns messages, added with a nil publisher
// (router.AddHandler(…, "invoices", nil, …), as for the outbox) to an inbox
// with no Config.Outbox: the messages have nowhere to go. The router
// refused them after the commit, and the redelivery was skipped as a
// duplicate: lost for good. The inbox refuses them before the commit: the
// transaction rolls back, the error is transient and wraps ErrInvalidConfig
// (a poison filter keeps the message until the inbox is configured).
func TestReturnedMessagesWithNeitherOutboxNorPublisherAreRefusedBeforeTheCommit(t *testing.T) {
	db := sqliteDB(t)
	f := newFixture(t, db)
	ib := f.newInbox(inbox.Config{})
	rec := &recorder{}
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(rec.Middleware, ib.Middleware)
		r.AddHandler("billing", "orders", in, "invoices", nil, func(msg *message.Message) ([]*message.Message, error) {
			if err := f.writeBusinessRow(msg); err != nil {
				return nil, err
			}
			return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("invoice"))}, nil
		})
	})
	if in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
		t.Fatal("acked: the returned message is lost")
	}
	if err := rec.last(); !errors.Is(err, inbox.ErrInvalidConfig) || !inbox.IsTransient(err) ||
		!strings.Contains(err.Error(), "the handler returned 1 message, but") {
		t.Errorf("error %v: want ErrInvalidConfig, transient, saying the handler returned 1 message", err)
	}
	if f.businessRows() != 0 || f.inboxRows() != 0 {
		t.Errorf("business rows %d, inbox rows %d; want none: the transaction rolls back", f.businessRows(), f.inboxRows())
	}
}

// A handler added with neither a publish topic nor a publisher
// (AddHandler(…, "", nil, h)) whose returned messages a router middleware
// outside the inbox publishes itself (routing by metadata) is not refused:
// only a publish topic without a publisher says they have nowhere to go.
func TestReturnedMessagesRoutedByAMiddlewareWithoutAPublishTopicAreNotRefused(t *testing.T) {
	db := sqliteDB(t)
	f := newFixture(t, db)
	ib := f.newInbox(inbox.Config{})
	rec := &recorder{}
	out := &recordingPublisher{}
	route := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			produced, err := h(msg)
			if err != nil {
				return nil, err
			}
			for _, m := range produced {
				if err := out.Publish(m.Metadata.Get("topic"), m); err != nil {
					return nil, err
				}
			}
			return nil, nil
		}
	}
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(rec.Middleware, route, ib.Middleware)
		r.AddHandler("billing", "orders", in, "", nil, func(msg *message.Message) ([]*message.Message, error) {
			m := message.NewMessage(watermill.NewUUID(), []byte("invoice"))
			m.Metadata.Set("topic", "invoices-eu")
			return []*message.Message{m}, nil
		})
	})
	if !in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
		t.Fatalf("nacked (%v), want acked and the invoice published by the routing middleware", rec.last())
	}
	if out.published != 1 {
		t.Errorf("published %d, want 1", out.published)
	}
}
