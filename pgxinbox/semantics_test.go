package pgxinbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// Two consumers (handlers) that receive the same message id each process it
// once, in the same inbox table.
func TestSemantics_TwoConsumersEachProcessOnce(t *testing.T) {
	forEachDialect(t, func(t *testing.T, d inbox.Dialect) {
		pool := testdb.OpenPgxPool(t, "")
		f := newFixture(t, pool)
		ib := f.newInbox(pgxinbox.Config{Dialect: d})
		var c calls
		feeds := map[string]*feed{"billing": newFeed(), "shipping": newFeed()}
		runRouter(t, func(r *message.Router) {
			r.AddMiddleware(ib.Middleware)
			for name, in := range feeds {
				r.AddConsumerHandler(name, "orders", in, func(msg *message.Message) error {
					msg.Metadata.Set("delivery", name)
					c.inc(msg)
					return f.writeEffect(msg)
				})
			}
		})
		msg := message.NewMessage(watermill.NewUUID(), nil)
		for range 2 {
			for name, in := range feeds {
				if !in.deliver(t, msg) {
					t.Fatalf("%s nacked", name)
				}
			}
		}
		for name := range feeds {
			if n := c.get(name); n != 1 {
				t.Errorf("%s handler calls %d, want 1", name, n)
			}
		}
		f.expectRows(2, 2)
		var consumers []string
		rows, err := pool.Query(context.Background(), "SELECT consumer FROM "+f.table+" ORDER BY consumer")
		if err != nil {
			t.Fatal(err)
		}
		for rows.Next() {
			var s string
			if err := rows.Scan(&s); err != nil {
				t.Fatal(err)
			}
			consumers = append(consumers, s)
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		if strings.Join(consumers, ",") != "billing,shipping" {
			t.Errorf("inbox consumers %v, want billing and shipping", consumers)
		}
		expectNoConnHeld(t, pool)
	})
}

// A second delivery of a key in flight waits on the first's transaction:
// when the first commits, the second is skipped as a duplicate; when the
// first rolls back, the second claims the key and runs the handler.
func TestSemantics_ConcurrentDeliveryWaitsForTheFirst(t *testing.T) {
	forEachDialect(t, func(t *testing.T, d inbox.Dialect) {
		for _, first := range []struct {
			name             string
			fails            bool
			wantFirstAcked   bool
			wantSecondCalled bool
		}{
			{name: "FirstCommits", wantFirstAcked: true},
			{name: "FirstRollsBack", fails: true, wantSecondCalled: true},
		} {
			t.Run(first.name, func(t *testing.T) {
				t.Parallel()
				app := "pgxinbox_wait_" + testdb.RandomSuffix()
				pool := openPool(t, "", app, nil)
				f := newFixture(t, pool)
				ib := f.newInbox(pgxinbox.Config{Dialect: d})
				var c calls
				rec := &recorder{}
				in := consume(t, ib, func(msg *message.Message) error {
					c.inc(msg)
					if err := f.writeEffect(msg); err != nil {
						return err
					}
					if msg.Metadata.Get("delivery") != "first" {
						return nil
					}
					// Hold the transaction until the second delivery waits on the key.
					waitFor(t, "second delivery waiting on the key", func() bool { return lockWaiters(t, pool, app) == 1 })
					if first.fails {
						return errors.New("first delivery fails")
					}
					return nil
				}, rec.Middleware)
				msg := message.NewMessage(watermill.NewUUID(), nil)
				firstAcked := in.deliverAsync(t, labelled(msg, "first"))
				waitFor(t, "first delivery claimed", func() bool { return c.get("first") == 1 })
				secondAcked := in.deliverAsync(t, labelled(msg, "second"))
				if got := <-firstAcked; got != first.wantFirstAcked {
					t.Errorf("first acked %v, want %v (%v)", got, first.wantFirstAcked, rec.lastOf("first"))
				}
				if !<-secondAcked {
					t.Errorf("second nacked: %v", rec.lastOf("second"))
				}
				if got := c.get("second") == 1; got != first.wantSecondCalled {
					t.Errorf("second delivery's handler called %v, want %v", got, first.wantSecondCalled)
				}
				f.expectRows(1, 1)
				expectNoConnHeld(t, pool)
			})
		}
	})
}

// ctxRecorder is a middleware outside the inbox that checks that the
// message's context is, once the inner handler returned, the context the
// message came in with, and that it no longer carries the transaction.
type ctxRecorder struct {
	t                 *testing.T
	restored, txAfter int
}

func (c *ctxRecorder) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		before := msg.Context()
		msgs, err := h(msg)
		if msg.Context() == before {
			c.restored++
		}
		if _, ok := pgxinbox.TxFromContext(msg.Context()); ok {
			c.txAfter++
		}
		return msgs, err
	}
}

// After the middleware returns, processed, duplicate or failed, the
// message's context is the one it came in with: a Retry outside sees no
// finished transaction.
func TestSemantics_MessageContextIsRestored(t *testing.T) {
	t.Parallel()
	pool := testdb.OpenPgxPool(t, "")
	f := newFixture(t, pool)
	ib := f.newInbox(pgxinbox.Config{})
	cr := &ctxRecorder{t: t}
	var c calls
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		// The router runs each delivery in one goroutine: cr's counters are
		// read after the acks, which happen after the middleware returned.
		r.AddMiddleware(cr.Middleware, ib.Middleware)
		r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
			c.inc(msg)
			if _, ok := pgxinbox.TxFromContext(msg.Context()); !ok {
				t.Error("handler: no pgx transaction in the message context")
			}
			if c.get("") == 1 {
				return errors.New("fail once")
			}
			return f.writeEffect(msg)
		})
	})
	msg := message.NewMessage(watermill.NewUUID(), nil)
	in.deliver(t, msg) // fails
	in.deliver(t, msg) // processed
	in.deliver(t, msg) // duplicate
	if cr.restored != 3 || cr.txAfter != 0 {
		t.Errorf("context restored %d of 3 times, transaction visible after return %d times", cr.restored, cr.txAfter)
	}
	f.expectRows(1, 1)
}

// An inbox inside another inbox (pgx in pgx, and pgx in a database/sql
// inbox) is refused with ErrNestedInbox, nothing is written by either, and
// no connection stays checked out.
func TestSemantics_NestedInboxIsRefused(t *testing.T) {
	t.Parallel()
	for _, outer := range []string{"pgx", "database/sql"} {
		t.Run(strings.ReplaceAll(outer, "/", "-"), func(t *testing.T) {
			t.Parallel()
			pool := testdb.OpenPgxPool(t, "")
			f := newFixture(t, pool)
			inner := f.newInbox(pgxinbox.Config{})
			outerTable := "pgx_outer_" + f.sfx
			f.dropLater(outerTable)
			var outerMW message.HandlerMiddleware
			if outer == "pgx" {
				outerMW = f.newInbox(pgxinbox.Config{Table: outerTable}).Middleware
			} else {
				db := testdb.OpenPostgres(t, "")
				ib, err := inbox.New(inbox.Config{DB: db, Table: outerTable})
				if err != nil {
					t.Fatal(err)
				}
				if err := ib.InitializeSchema(context.Background()); err != nil {
					t.Fatal(err)
				}
				outerMW = ib.Middleware
			}
			rec := &recorder{}
			var c calls
			in := consume(t, inner, func(msg *message.Message) error { c.inc(msg); return f.writeEffect(msg) },
				rec.Middleware, outerMW)
			if in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
				t.Error("acked a message handled by nested inboxes")
			}
			if err := rec.last(); !errors.Is(err, inbox.ErrNestedInbox) {
				t.Errorf("router got %v, want ErrNestedInbox", err)
			}
			if c.get("") != 0 {
				t.Error("handler called")
			}
			f.expectRows(0, 0)
			if n := f.count(outerTable); n != 0 {
				t.Errorf("outer inbox rows %d, want 0", n)
			}
			expectNoConnHeld(t, pool)
		})
	}
}
