package inbox_test

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// The same through Watermill's GoChannel pub/sub: the message is published
// three times, as an outbox relay retry would.
func TestDuplicatePublishGoChannel(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		f := newFixture(t, db)
		var handled atomic.Int32
		ib := f.newInbox(inbox.Config{
			OnProcessed: func(inbox.Event) { handled.Add(1) },
			OnDuplicate: func(inbox.Event) { handled.Add(1) },
		})
		pubsub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
		t.Cleanup(func() { pubsub.Close() })
		var c calls
		runRouter(t, func(r *message.Router) {
			r.AddMiddleware(ib.Middleware)
			r.AddConsumerHandler("billing", "orders", pubsub, func(msg *message.Message) error {
				c.inc(msg.UUID)
				return f.writeBusinessRow(msg)
			})
		})
		msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
		for range 3 {
			if err := pubsub.Publish("orders", msg.Copy()); err != nil {
				t.Fatal(err)
			}
		}
		waitFor(t, func() bool { return handled.Load() == 3 })
		if got := c.get(msg.UUID); got != 1 {
			t.Errorf("handler calls = %d, want 1", got)
		}
		if got := f.businessRows(); got != 1 {
			t.Errorf("business rows = %d, want 1", got)
		}
	})
}

// Rule 1, concurrency: two workers (two routers, one consumer name) receive
// the same message at the same moment. The second waits on the key while the
// first holds it; if the first commits, the second skips; if the first rolls
// back, the second processes.
func TestConcurrentDeliveryTwoWorkers(t *testing.T) {
	for _, firstFails := range []bool{false, true} {
		t.Run(fmt.Sprintf("firstFails=%v", firstFails), func(t *testing.T) {
			forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
				f := newFixture(t, db)
				ib := f.newInbox(inbox.Config{})
				var c calls
				entered := make(chan struct{})
				release := make(chan struct{})
				var first atomic.Bool
				handler := func(msg *message.Message) error {
					c.inc(msg.UUID)
					if err := f.writeBusinessRow(msg); err != nil {
						return err
					}
					if first.CompareAndSwap(false, true) {
						close(entered)
						<-release
						if firstFails {
							return errors.New("first worker fails")
						}
					}
					return nil
				}
				workerA, workerB := newFeed(), newFeed()
				for _, in := range []*feed{workerA, workerB} {
					runRouter(t, func(r *message.Router) {
						r.AddMiddleware(ib.Middleware)
						r.AddConsumerHandler("billing", "orders", in, handler)
					})
				}

				msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
				ackedA := make(chan bool, 1)
				go func() { ackedA <- workerA.deliver(t, msg) }()
				<-entered // A holds the claim, inside its handler
				ackedB := make(chan bool, 1)
				go func() { ackedB <- workerB.deliver(t, msg) }()
				select {
				case <-ackedB:
					t.Fatal("worker B finished while worker A still held the key")
				case <-time.After(300 * time.Millisecond):
				}
				close(release)

				if a := <-ackedA; a == firstFails {
					t.Errorf("worker A acked = %v, want %v", a, !firstFails)
				}
				if b := <-ackedB; !b {
					t.Errorf("worker B nacked, want ack")
				}
				wantCalls := 1
				if firstFails {
					wantCalls = 2
				}
				if got := c.get(msg.UUID); got != wantCalls {
					t.Errorf("handler calls = %d, want %d", got, wantCalls)
				}
				if got := f.businessRows(); got != 1 {
					t.Errorf("business rows = %d, want 1", got)
				}
				if got := f.inboxRows(); got != 1 {
					t.Errorf("inbox rows = %d, want 1", got)
				}
			})
		})
	}
}

// Rule 4: a panicking handler is rolled back and leaves no connection checked
// out, with Watermill's Recoverer outside the inbox and with only the
// router's own recovery. The pool has one connection, so a leaked one would
// hang the next message.
func TestHandlerPanicRollsBack(t *testing.T) {
	for _, withRecoverer := range []bool{true, false} {
		t.Run(fmt.Sprintf("recoverer=%v", withRecoverer), func(t *testing.T) {
			forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
				f := newFixture(t, db)
				ib := f.newInbox(inbox.Config{})
				db.SetMaxOpenConns(1)
				var panics atomic.Bool
				panics.Store(true)
				in := newFeed()
				runRouter(t, func(r *message.Router) {
					if withRecoverer {
						r.AddMiddleware(middleware.Recoverer)
					}
					r.AddMiddleware(ib.Middleware)
					r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
						if err := f.writeBusinessRow(msg); err != nil {
							return err
						}
						if panics.Load() {
							panic("handler bug")
						}
						return nil
					})
				})

				msgs := []*message.Message{}
				for range 3 {
					msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
					msgs = append(msgs, msg)
					if in.deliver(t, msg) {
						t.Fatal("panicking delivery was acked")
					}
					if inUse := db.Stats().InUse; inUse != 0 {
						t.Fatalf("connections in use after panic = %d, want 0", inUse)
					}
				}
				if f.businessRows() != 0 || f.inboxRows() != 0 {
					t.Fatalf("after panics: business rows %d, inbox rows %d, want 0 and 0", f.businessRows(), f.inboxRows())
				}
				panics.Store(false)
				for _, msg := range msgs {
					if !in.deliver(t, msg) {
						t.Fatal("redelivery after the panics was nacked")
					}
				}
				if f.businessRows() != 3 || f.inboxRows() != 3 {
					t.Errorf("after redelivery: business rows %d, inbox rows %d, want 3 and 3", f.businessRows(), f.inboxRows())
				}
			})
		})
	}
}

// Rule 5: a failed commit is a nack, never an ack, and nothing is kept. Each
// database gets the commit failure it really produces: PostgreSQL turns
// COMMIT into ROLLBACK after a failed statement the handler swallowed;
// SQLite and PostgreSQL check a deferred foreign key at COMMIT; on MySQL the
// connection is killed between the handler and the commit.
func TestCommitFailureNacks(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		f := newFixture(t, db)
		var processed, failed atomic.Int32
		ib := f.newInbox(inbox.Config{
			OnProcessed: func(inbox.Event) { processed.Add(1) },
			OnFailed:    func(inbox.Event) { failed.Add(1) },
		})
		var breakCommit func(msg *message.Message, tx *sqlx.Tx) error
		switch tdb.Dialect {
		case inbox.PostgreSQL, inbox.PostgreSQLPartitioned:
			breakCommit = func(msg *message.Message, tx *sqlx.Tx) error {
				_, err := tx.ExecContext(msg.Context(), "SELECT 1/0")
				if err == nil {
					return errors.New("SELECT 1/0 succeeded")
				}
				return nil // swallowed: the transaction is aborted, COMMIT becomes ROLLBACK
			}
		case inbox.SQLite:
			parent, child := "parent_"+randomSuffix(), "child_"+randomSuffix()
			exec(t, db, "CREATE TABLE "+parent+" (id INTEGER PRIMARY KEY)")
			exec(t, db, "CREATE TABLE "+child+" (parent_id INTEGER REFERENCES "+parent+"(id) DEFERRABLE INITIALLY DEFERRED)")
			dropLater(t, db, parent)
			dropLater(t, db, child)
			breakCommit = func(msg *message.Message, tx *sqlx.Tx) error {
				_, err := tx.ExecContext(msg.Context(), "INSERT INTO "+child+" (parent_id) VALUES (42)")
				return err // the foreign key fails at COMMIT
			}
		case inbox.MySQL:
			breakCommit = func(msg *message.Message, tx *sqlx.Tx) error {
				var id int64
				if err := tx.GetContext(msg.Context(), &id, "SELECT CONNECTION_ID()"); err != nil {
					return err
				}
				_, err := db.ExecContext(msg.Context(), fmt.Sprintf("KILL %d", id))
				return err // the database went away before COMMIT
			}
		}
		var broken atomic.Bool
		broken.Store(true)
		var c calls
		rec := &recorder{}
		in := newFeed()
		runRouter(t, func(r *message.Router) {
			r.AddMiddleware(rec.Middleware, ib.Middleware)
			r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
				c.inc(msg.UUID)
				if err := f.writeBusinessRow(msg); err != nil {
					return err
				}
				if broken.Load() {
					tx, _ := inbox.TxFromContext(msg.Context())
					return breakCommit(msg, tx)
				}
				return nil
			})
		})

		msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
		if in.deliver(t, msg) {
			t.Fatal("message whose commit failed was acked")
		}
		if err := rec.last(); err == nil || !strings.Contains(err.Error(), `inbox: commit "billing"/"`+msg.UUID+`"`) {
			t.Errorf("router got %v, want the commit error", err)
		}
		// Whether a poison-queue filter built on IsTransient keeps it: the
		// deferred foreign key (SQLite) is the message's own fault; a COMMIT
		// PostgreSQL turned into ROLLBACK (pgx's plain ErrTxCommitRollback)
		// says nothing about why the statement failed, so it is not taken
		// for a lost connection; a killed MySQL session is transient.
		if got, want := inbox.IsTransient(rec.last()), tdb.Dialect == inbox.MySQL; got != want {
			t.Errorf("IsTransient(%v) = %v, want %v", rec.last(), got, want)
		}
		if processed.Load() != 0 || failed.Load() != 1 {
			t.Errorf("hooks: processed=%d failed=%d, want 0 and 1", processed.Load(), failed.Load())
		}
		if f.businessRows() != 0 || f.inboxRows() != 0 {
			t.Errorf("after failed commit: business rows %d, inbox rows %d, want 0 and 0", f.businessRows(), f.inboxRows())
		}

		broken.Store(false)
		for range 2 {
			if !in.deliver(t, msg) {
				t.Fatalf("redelivery nacked: %v", rec.last())
			}
		}
		if c.get(msg.UUID) != 2 || f.businessRows() != 1 || f.inboxRows() != 1 {
			t.Errorf("after redeliveries: calls %d, business rows %d, inbox rows %d, want 2, 1, 1",
				c.get(msg.UUID), f.businessRows(), f.inboxRows())
		}
		waitFor(t, func() bool { return db.Stats().InUse == 0 })
	})
}

// Rule 8: a configured Consumer overrides the handler name, so a renamed
// handler keeps its key space; an empty consumer outside a router is an error.
func TestConsumerName(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		f := newFixture(t, db)
		fixed := f.newInbox(inbox.Config{Consumer: "billing"})
		var c calls
		oldName, newName := newFeed(), newFeed()
		runRouter(t, func(r *message.Router) {
			r.AddMiddleware(fixed.Middleware)
			h := func(msg *message.Message) error { c.inc(msg.UUID); return nil }
			r.AddConsumerHandler("billing_v1", "orders", oldName, h)
			r.AddConsumerHandler("billing_v2", "orders", newName, h)
		})
		msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
		if !oldName.deliver(t, msg) || !newName.deliver(t, msg) {
			t.Fatal("nacked")
		}
		if c.get(msg.UUID) != 1 {
			t.Errorf("handler calls = %d, want 1: both handlers share consumer %q", c.get(msg.UUID), "billing")
		}
		if got := count(t, db, f.inbox, "consumer = ?", "billing"); got != 1 {
			t.Errorf("inbox rows for billing = %d, want 1", got)
		}

		byHandler := f.newInbox(inbox.Config{})
		called := false
		_, err := byHandler.Middleware(func(*message.Message) ([]*message.Message, error) {
			called = true
			return nil, nil
		})(message.NewMessage(watermill.NewUUID(), nil))
		if !errors.Is(err, inbox.ErrEmptyConsumer) || !errors.Is(err, inbox.ErrInvalidConsumer) {
			t.Errorf("outside a router: err = %v, want ErrEmptyConsumer", err)
		}
		if called || f.inboxRows() != 1 {
			t.Errorf("outside a router: handler called %v, inbox rows %d, want false and 1", called, f.inboxRows())
		}
	})
}

// Rule 7: bad message ids are refused before anything is written; distinct
// ids that a collation could fold together stay distinct.
func TestMessageIDValidation(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		f := newFixture(t, db)
		ib := f.newInbox(inbox.Config{MessageID: func(msg *message.Message) (string, error) {
			return msg.Metadata.Get("event_id"), nil
		}})
		var c calls
		rec := &recorder{}
		in := newFeed()
		runRouter(t, func(r *message.Router) {
			r.AddMiddleware(rec.Middleware, ib.Middleware)
			r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
				c.inc(msg.Metadata.Get("event_id"))
				return nil
			})
		})
		deliver := func(id string) (bool, error) {
			msg := message.NewMessage(watermill.NewUUID(), nil)
			msg.Metadata.Set("event_id", id)
			acked := in.deliver(t, msg)
			return acked, rec.last()
		}

		bad := []struct {
			name string
			id   string
			want error
		}{
			{"empty", "", inbox.ErrEmptyMessageID},
			{"256 bytes", strings.Repeat("a", 256), inbox.ErrMessageIDTooLong},
			{"256 bytes of 2-byte runes", strings.Repeat("é", 128), inbox.ErrMessageIDTooLong},
			{"invalid UTF-8", "order-\xff\xfe", inbox.ErrInvalidMessageID},
			{"NUL byte", "order\x001", inbox.ErrInvalidMessageID},
		}
		for _, tc := range bad {
			acked, err := deliver(tc.id)
			if acked {
				t.Errorf("%s: acked, want nack", tc.name)
			}
			if !errors.Is(err, tc.want) || !errors.Is(err, inbox.ErrInvalidMessageID) {
				t.Errorf("%s: err = %v, want %v", tc.name, err, tc.want)
			}
			if c.get(tc.id) != 0 {
				t.Errorf("%s: handler called", tc.name)
			}
		}
		if got := f.inboxRows(); got != 0 {
			t.Fatalf("inbox rows after bad ids = %d, want 0", got)
		}

		good := []string{
			strings.Repeat("a", 255), strings.Repeat("é", 127) + "a", "order-1", "ORDER-1", "order-1 ", " order-1",
			"Straße", "Strasse", "ｏｒｄｅｒ", "order-1\t", "😀",
		}
		for _, id := range good {
			for range 2 {
				if acked, err := deliver(id); !acked {
					t.Errorf("id %q: nacked: %v", id, err)
				}
			}
			if c.get(id) != 1 {
				t.Errorf("id %q: handler calls = %d, want 1", id, c.get(id))
			}
		}
		if got := f.inboxRows(); got != len(good) {
			t.Errorf("inbox rows = %d, want %d (one per distinct id)", got, len(good))
		}
		var stored []string
		if err := db.Select(&stored, "SELECT message_id FROM "+f.inbox); err != nil {
			t.Fatal(err)
		}
		seen := map[string]bool{}
		for _, s := range stored {
			seen[s] = true
		}
		for _, id := range good {
			if !seen[id] {
				t.Errorf("id %q not stored byte for byte", id)
			}
		}
	})
}

// An error from Config.MessageID is returned wrapped; nothing is written.
func TestMessageIDFuncError(t *testing.T) {
	db := openSQLite(t, t.TempDir()+"/x.db")
	f := newFixture(t, db)
	errNoID := errors.New("no event_id header")
	ib := f.newInbox(inbox.Config{Consumer: "billing", MessageID: func(*message.Message) (string, error) { return "", errNoID }})
	_, err := ib.Middleware(func(*message.Message) ([]*message.Message, error) {
		t.Error("handler called")
		return nil, nil
	})(message.NewMessage(watermill.NewUUID(), nil))
	if !errors.Is(err, errNoID) {
		t.Errorf("err = %v, want it to wrap %v", err, errNoID)
	}
	if f.inboxRows() != 0 {
		t.Error("inbox row written")
	}
}

// A handler's returned messages reach the router only after the commit.
func TestProducedMessagesReturnedAfterCommit(t *testing.T) {
	db := openSQLite(t, t.TempDir()+"/x.db")
	f := newFixture(t, db)
	ib := f.newInbox(inbox.Config{Consumer: "billing"})
	out := message.NewMessage(watermill.NewUUID(), nil)
	produced, err := ib.Middleware(func(*message.Message) ([]*message.Message, error) {
		return []*message.Message{out}, nil
	})(message.NewMessage(watermill.NewUUID(), nil))
	if err != nil || len(produced) != 1 || produced[0] != out {
		t.Errorf("got %v, %v; want the handler's message", produced, err)
	}
	produced, err = ib.Middleware(func(*message.Message) ([]*message.Message, error) {
		return []*message.Message{out}, errors.New("fail")
	})(message.NewMessage(watermill.NewUUID(), nil))
	if err == nil || produced != nil {
		t.Errorf("on handler error got %v, %v; want no messages and the error", produced, err)
	}
}

// The wrong order, documented: Retry inside the inbox runs every attempt in
// one transaction, so the failed attempt's write commits with the successful
// one; PoisonQueue inside the inbox commits the inbox row of a poisoned
// message, so its replay is skipped. The README warns about both.
func TestWrongOrderRetryInsideInbox(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		f := newFixture(t, db)
		ib := f.newInbox(inbox.Config{})
		var attempts atomic.Int32
		in := newFeed()
		runRouter(t, func(r *message.Router) {
			r.AddMiddleware(ib.Middleware, middleware.Retry{MaxRetries: 3, InitialInterval: time.Millisecond}.Middleware)
			r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
				n := attempts.Add(1)
				tx, _ := inbox.TxFromContext(msg.Context())
				if _, err := tx.ExecContext(msg.Context(), tx.Rebind("INSERT INTO "+f.business+" (id, consumer) VALUES (?, ?)"),
					fmt.Sprintf("%s:%d", msg.UUID, n), "billing"); err != nil {
					return err
				}
				if n == 1 {
					return errors.New("transient")
				}
				return nil
			})
		})
		if !in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
			t.Fatal("nacked")
		}
		if got := f.businessRows(); got != 2 {
			t.Errorf("business rows = %d; the documented outcome of this wrong order is 2 (the failed attempt's write kept)", got)
		}
	})
}

func TestWrongOrderPoisonQueueInsideInbox(t *testing.T) {
	db := sqliteDB(t)
	f := newFixture(t, db)
	ib := f.newInbox(inbox.Config{})
	pubsub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { pubsub.Close() })
	poison, err := middleware.PoisonQueue(pubsub, "orders_poison")
	if err != nil {
		t.Fatal(err)
	}
	var c calls
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(ib.Middleware, poison)
		r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
			c.inc(msg.UUID)
			return errors.New("cannot process")
		})
	})
	msg := message.NewMessage(watermill.NewUUID(), nil)
	in.deliver(t, msg)
	in.deliver(t, msg) // the replay from the poison queue
	if c.get(msg.UUID) != 1 || f.inboxRows() != 1 {
		t.Errorf("calls %d, inbox rows %d; the documented outcome of this wrong order is 1 and 1 (replay skipped)",
			c.get(msg.UUID), f.inboxRows())
	}
}

// OnFailed sees every failure the router nacks: a handler error, a panic,
// an invalid id, and a claim that fails (here: no table).
func TestOnFailedHook(t *testing.T) {
	db := sqliteDB(t)
	f := newFixture(t, db)
	var failures []error
	var mu sync.Mutex
	ib := f.newInbox(inbox.Config{
		Consumer:  "billing",
		MessageID: func(msg *message.Message) (string, error) { return msg.Metadata.Get("id"), nil },
		OnFailed:  func(e inbox.Event) { mu.Lock(); failures = append(failures, e.Err); mu.Unlock() },
	})
	call := func(id string, h message.HandlerFunc) {
		defer func() { _ = recover() }()
		msg := message.NewMessage(watermill.NewUUID(), nil)
		msg.Metadata.Set("id", id)
		_, _ = ib.Middleware(h)(msg)
	}
	call("a", func(*message.Message) ([]*message.Message, error) { return nil, errors.New("handler failed") })
	call("b", func(*message.Message) ([]*message.Message, error) { panic("boom") })
	call("", func(*message.Message) ([]*message.Message, error) { return nil, nil })
	exec(t, db, "DROP TABLE "+f.inbox)
	call("c", func(*message.Message) ([]*message.Message, error) { return nil, nil })
	want := []string{"handler failed", "handler panicked", "empty message id", "no such table"}
	if len(failures) != len(want) {
		t.Fatalf("OnFailed got %v, want %d failures", failures, len(want))
	}
	for i, w := range want {
		if !strings.Contains(failures[i].Error(), w) {
			t.Errorf("failure %d = %v, want it to mention %q", i, failures[i], w)
		}
	}
}
