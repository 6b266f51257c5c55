package inbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A handler runs DEALLOCATE ALL on the inbox transaction (PostgreSQL allows
// it in a transaction block) and is processed. The inbox's claim on that
// connection then fails with 26000: once under pgx's statement cache (pgx
// prepares it afresh after the error), for good under
// Config.PrepareStatements (database/sql never prepares a statement again
// on a connection that has it). Those messages did nothing wrong: they were
// failed with a non-transient error, and the poison queue the README
// recommends took them. Now each is nacked as transient, the connection is
// discarded, and its redelivery is processed, once. (The handler writes
// with a statement that has no arguments, which pgx does not prepare: its
// own statements failing so would be its own error.)
func TestMessagesAfterAHandlerDeallocatedTheStatementsAreNotPoisoned(t *testing.T) {
	t.Parallel()
	for name, cfg := range map[string]inbox.Config{"pgx statement cache": {}, "PrepareStatements": {PrepareStatements: true}} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			messagesAfterADeallocate(t, cfg)
		})
	}
}

func messagesAfterADeallocate(t *testing.T, cfg inbox.Config) {
	db := testdb.OpenPostgres(t, "")
	db.SetMaxOpenConns(1) // every message on the connection whose statements went
	dialectOf.Store(db, inbox.PostgreSQL)
	f := newFixture(t, db)
	ib := f.newInbox(cfg)
	poison, sink := poisonUnlessTransient(t)
	rec := &outcomes{}
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(rec.Middleware, poison, ib.Middleware)
		r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
			tx, _ := inbox.TxFromContext(msg.Context())
			if _, err := tx.ExecContext(msg.Context(), "INSERT INTO "+f.business+" (id, consumer) VALUES ('"+msg.UUID+"', 'billing')"); err != nil {
				return err
			}
			if msg.Metadata.Get("deallocate") == "yes" {
				if _, err := tx.ExecContext(msg.Context(), "DEALLOCATE ALL"); err != nil {
					return err
				}
			}
			return nil
		})
	})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	send := func(msg *message.Message, label string) bool {
		t.Helper()
		acked, err := in.send(ctx, delivery(msg, label))
		if err != nil {
			t.Fatalf("%s: %v", label, err)
		}
		return acked
	}
	for i := range 3 { // the statements prepared and cached
		if !send(message.NewMessage(watermill.NewUUID(), nil), "warm") {
			t.Fatalf("warm-up %d nacked: %v", i, rec.last("warm"))
		}
	}
	deallocating := message.NewMessage(watermill.NewUUID(), nil)
	deallocating.Metadata.Set("deallocate", "yes")
	if !send(deallocating, "deallocating") {
		t.Fatalf("the message whose handler deallocated nacked: %v", rec.last("deallocating"))
	}
	nacked := 0
	for i := range 5 {
		msg := message.NewMessage(watermill.NewUUID(), nil)
		for attempt := 1; !send(msg, "after"); attempt++ {
			nacked++
			if err := rec.last("after"); !inbox.IsTransient(err) || attempt == 3 {
				t.Fatalf("message %d after the DEALLOCATE, delivery %d: %v (transient %v)", i, attempt, err, inbox.IsTransient(err))
			}
		}
	}
	poisoned := len(sink.poisoned())
	if nacked+poisoned == 0 {
		t.Fatal("no message after the DEALLOCATE failed: the case did not happen")
	}

	// Another Inbox on the pool (another handler of the service), whose
	// first message checks the table before its claim: those statements,
	// cached on the connection by an Inbox before, fail so too, once each.
	handlerOf := func(consumer string) message.NoPublishHandlerFunc {
		return func(msg *message.Message) error {
			tx, _ := inbox.TxFromContext(msg.Context())
			_, err := tx.ExecContext(msg.Context(), "INSERT INTO "+f.business+" (id, consumer) VALUES ('"+msg.UUID+"', '"+consumer+"')")
			return err
		}
	}
	warm, warmIn, otherIn := f.newInbox(cfg), newFeed(), newFeed()
	// Made as a service makes it, without the fixture's InitializeSchema:
	// its first message checks the table.
	cfg.DB, cfg.Table, cfg.Dialect = db, f.inbox, inbox.PostgreSQL
	other, err := inbox.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { other.Close() })
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(rec.Middleware, poison)
		r.AddConsumerHandler("shipping", "orders", warmIn, handlerOf("shipping")).AddMiddleware(warm.Middleware)
		r.AddConsumerHandler("invoicing", "orders", otherIn, handlerOf("invoicing")).AddMiddleware(other.Middleware)
	})
	if acked, err := warmIn.send(ctx, delivery(message.NewMessage(watermill.NewUUID(), nil), "warm")); err != nil || !acked {
		t.Fatalf("warm-up: acked %v, %v, %v", acked, err, rec.last("warm"))
	}
	if _, err := db.ExecContext(ctx, "DEALLOCATE ALL"); err != nil {
		t.Fatal(err)
	}
	msg := message.NewMessage(watermill.NewUUID(), nil)
	for attempt := 1; ; attempt++ {
		acked, err := otherIn.send(ctx, delivery(msg, "other"))
		if err != nil {
			t.Fatal(err)
		}
		if acked {
			break
		}
		if err := rec.last("other"); !inbox.IsTransient(err) || attempt == 10 {
			t.Fatalf("the other Inbox's first message, delivery %d: %v (transient %v)", attempt, err, inbox.IsTransient(err))
		}
	}

	if n := len(sink.poisoned()); n != 0 {
		t.Errorf("%d message(s) poisoned, want none", n)
	}
	if b, i := f.businessRows(), f.inboxRows(); b != 11 || i != 11 {
		t.Errorf("business rows %d, inbox rows %d; want 11 and 11 (each message once)", b, i)
	}
}
