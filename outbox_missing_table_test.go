package inbox_test

import (
	"context"
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// An outbox table not yet created (a migration not run, while the relay
// runs in another process or with ob.Run, so that no RouterPlugin refused
// to start) is a misconfiguration, not the message's fault, on every
// database: the delivery fails with a transient error wrapping
// ErrTableNotFound, a poison queue does not take it, nothing is acked,
// and the relay's round says ErrTableNotFound too. On MariaDB and SQLite
// the driver's "doesn't exist" / "no such table" went out as it was, not
// transient, and every message went to the poison queue.
func TestMissingOutboxTableIsTransientOnEveryDatabase(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		for _, how := range []string{"returned", "OutboxFromContext"} {
			t.Run(how, func(t *testing.T) {
				ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Dialect: tdb.Dialect, Table: "outbox_missing_" + randomSuffix(), Publisher: newBrokerStub()})
				if err != nil {
					t.Fatal(err)
				}
				f := newFixture(t, db)
				ib := f.newInbox(inbox.Config{Outbox: ob.Publisher})
				poison := newBrokerStub()
				mws, err := ib.Middlewares(inbox.MiddlewaresConfig{PoisonQueue: poison, Retry: middleware.Retry{MaxRetries: -1}})
				if err != nil {
					t.Fatal(err)
				}
				rec := &recorder{}
				in := newFeed()
				runRouter(t, func(r *message.Router) {
					r.AddMiddleware(rec.Middleware)
					r.AddMiddleware(mws...)
					r.AddHandler("billing", "orders", in, "invoices", nil, func(msg *message.Message) ([]*message.Message, error) {
						out := message.NewMessage(watermill.NewUUID(), []byte("invoice"))
						if how == "returned" {
							return []*message.Message{out}, nil
						}
						pub, ok := inbox.OutboxFromContext(msg.Context())
						if !ok {
							return nil, errors.New("no outbox in the message's context")
						}
						return nil, pub.Publish("invoices", out)
					})
				})
				if in.deliver(t, message.NewMessage(watermill.NewUUID(), []byte("order"))) {
					t.Fatal("acked although the outbox table is missing")
				}
				if err := rec.last(); !errors.Is(err, inbox.ErrTableNotFound) || !inbox.IsTransient(err) {
					t.Errorf("router got %v (transient %v), want ErrTableNotFound, transient", err, inbox.IsTransient(err))
				}
				if n := len(poison.uuids("poison")); n != 0 {
					t.Errorf("%d messages went to the poison queue for a missing outbox table", n)
				}
				if b, i := f.businessRows(), f.inboxRows(); b != 0 || i != 0 {
					t.Errorf("%d business rows, %d inbox rows; want none", b, i)
				}
				if r := ob.RelayOnce(context.Background()); !errors.Is(r.Err, inbox.ErrTableNotFound) {
					t.Errorf("relay round on the missing table: %v, want ErrTableNotFound", r.Err)
				}
			})
		}
	})
}
