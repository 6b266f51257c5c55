package inbox_test

import (
	"context"
	"errors"
	"net/url"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// openSlowCommitDB opens PostgreSQL's "postgres" database through driver:
// the slow COMMITs of these tests hold a snapshot for up to seconds, and
// DETACH PARTITION ... FINALIZE in the "test" database waits for every
// older snapshot there (the partition tests give it a statement_timeout).
func openSlowCommitDB(t *testing.T, driver string) *sqlx.DB {
	t.Helper()
	u, err := url.Parse(testdb.PostgresDSN())
	if err != nil || u.Scheme == "" {
		t.Skipf("needs a URL-form %s to open the postgres database: %v", testdb.PostgresDSNEnv, err)
	}
	u.Path = "/postgres"
	db, err := sqlx.Open(driver, u.String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	testdb.OpenPostgresWith(t, driver, "") // skips, or fails in CI, without a server
	return db
}

// slowCommit makes every COMMIT of a transaction that inserted into table
// take d: a deferred constraint trigger sleeps at COMMIT (PostgreSQL).
func slowCommit(t *testing.T, db *sqlx.DB, table string, d time.Duration) {
	t.Helper()
	fn := table + "_slow_commit"
	exec(t, db, "CREATE FUNCTION "+fn+"() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep("+
		strconv.FormatFloat(d.Seconds(), 'f', 3, 64)+"); RETURN NULL; END $$")
	t.Cleanup(func() { db.Exec("DROP FUNCTION IF EXISTS " + fn + " CASCADE") })
	exec(t, db, "CREATE CONSTRAINT TRIGGER "+fn+" AFTER INSERT ON "+table+
		" DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION "+fn+"()")
}

// committedOutcome is what a user checks after one delivery.
type committedOutcome struct {
	acked, afterCommit bool
	business, inbox    int
	published          int
}

// cancelKey holds, in a message's context, the function that cancels it.
type cancelKey struct{}

// cancellable is a middleware outside the inbox that makes the message's
// context cancellable from the handler, as middleware.Timeout's deadline or
// a router shutdown would end it.
func cancellable(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx, cancel := context.WithCancel(msg.Context())
		defer cancel()
		msg.SetContext(context.WithValue(ctx, cancelKey{}, cancel))
		return h(msg)
	}
}

// deliverCancelledAfterReturn runs one message through a router with the
// inbox inside cancellable, and a handler that writes its business row,
// registers an AfterCommit function, returns one message for its publish
// topic, and has the message's context cancelled 20 ms after it returned:
// during what follows the handler (the outbox publish, COMMIT). It reports
// what the user would see.
func deliverCancelledAfterReturn(t *testing.T, db *sqlx.DB, cfg inbox.Config, prepare func(f *fixture)) committedOutcome {
	t.Helper()
	f := newFixture(t, db)
	if prepare != nil {
		prepare(f)
	}
	ib := f.newInbox(cfg)
	pubsub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { pubsub.Close() })
	var afterCommit atomic.Bool
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(cancellable, ib.Middleware)
		r.AddHandler("billing", "orders", in, "invoices", pubsub, func(msg *message.Message) ([]*message.Message, error) {
			if err := f.writeBusinessRow(msg); err != nil {
				return nil, err
			}
			inbox.AfterCommit(msg.Context(), func() { afterCommit.Store(true) })
			time.AfterFunc(20*time.Millisecond, msg.Context().Value(cancelKey{}).(context.CancelFunc))
			return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("invoice"))}, nil
		})
	})
	out := committedOutcome{acked: in.deliver(t, message.NewMessage(watermill.NewUUID(), nil))}
	out.afterCommit = afterCommit.Load()
	out.business, out.inbox = f.businessRows(), f.inboxRows()
	invoices, err := pubsub.Subscribe(context.Background(), "invoices")
	if err != nil {
		t.Fatal(err)
	}
	for {
		select {
		case m := <-invoices:
			m.Ack()
			out.published++
			continue
		case <-time.After(200 * time.Millisecond):
		}
		break
	}
	return out
}

// A message context that ends (a deadline, a router shutdown) while COMMIT
// is on the wire does not make the committed message look failed: it is
// acked, its AfterCommit function ran and the message it returned is
// published, with pgx (whose COMMIT takes the BeginTx context) and lib/pq.
func TestCommit_ContextEndingDuringCommitStillAcks(t *testing.T) {
	t.Parallel()
	for _, drv := range []struct{ name, driver string }{{"pgx", "pgx"}, {"lib/pq", "postgres"}} {
		t.Run(drv.name, func(t *testing.T) {
			t.Parallel()
			db := openSlowCommitDB(t, drv.driver)
			got := deliverCancelledAfterReturn(t, db, inbox.Config{}, func(f *fixture) {
				slowCommit(t, db, f.business, 500*time.Millisecond)
			})
			want := committedOutcome{acked: true, afterCommit: true, business: 1, inbox: 1, published: 1}
			if got != want {
				t.Errorf("context ended during COMMIT: %+v, want %+v", got, want)
			}
		})
	}
}

// middleware.Timeout outside the inbox, as the README places it, with a
// deadline that passes during COMMIT: the committed message is acked.
func TestCommit_TimeoutMiddlewareDeadlineDuringCommitStillAcks(t *testing.T) {
	t.Parallel()
	db := openSlowCommitDB(t, "pgx")
	f := newFixture(t, db)
	slowCommit(t, db, f.business, 1500*time.Millisecond)
	ib := f.newInbox(inbox.Config{})
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(middleware.Timeout(time.Second), ib.Middleware)
		r.AddConsumerHandler("billing", "orders", in, f.writeBusinessRow)
	})
	if !in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
		t.Error("nacked a message whose transaction committed")
	}
	if b, i := f.businessRows(), f.inboxRows(); b != 1 || i != 1 {
		t.Errorf("business rows %d, inbox rows %d, want 1 and 1", b, i)
	}
}

// slowOutbox is an outbox publisher that takes d to write, in the inbox
// transaction, each message into table.
type slowOutbox struct {
	tx    *sqlx.Tx
	table string
	d     time.Duration
}

func (o slowOutbox) Publish(_ string, msgs ...*message.Message) error {
	time.Sleep(o.d)
	for _, m := range msgs {
		if _, err := o.tx.Exec(o.tx.Rebind("INSERT INTO "+o.table+" (id, consumer) VALUES (?, 'outbox')"), m.UUID); err != nil {
			return err
		}
	}
	return nil
}
func (slowOutbox) Close() error { return nil }

// A message context that ends after the handler returned nil, while its
// messages are written to the outbox before COMMIT, does not roll the
// transaction back: the handler's outcome stands, on every database.
func TestCommit_ContextEndingAfterTheHandlerReturnedStillCommits(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		var f *fixture
		cfg := inbox.Config{Outbox: func(tx *sqlx.Tx) (message.Publisher, error) {
			return slowOutbox{tx: tx, table: f.business, d: 300 * time.Millisecond}, nil
		}}
		got := deliverCancelledAfterReturn(t, db, cfg, func(fx *fixture) { f = fx })
		// The returned message went to the outbox (a business-table row
		// here), not to the router.
		want := committedOutcome{acked: true, afterCommit: true, business: 2, inbox: 1, published: 0}
		if got != want {
			t.Errorf("context ended during the outbox publish: %+v, want %+v", got, want)
		}
	})
}

// CommitTimeout bounds the work after the handler returned: past it the
// message is nacked with ErrCommitTimeout, which IsTransient accepts,
// nothing is committed, and the redelivery processes the message.
func TestCommit_TimeoutBoundsTheCommitPhase(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		f := newFixture(t, db)
		var slow atomic.Bool
		slow.Store(true)
		ib := f.newInbox(inbox.Config{CommitTimeout: 300 * time.Millisecond, Outbox: func(tx *sqlx.Tx) (message.Publisher, error) {
			d := time.Duration(0)
			if slow.Load() {
				d = 1500 * time.Millisecond
			}
			return slowOutbox{tx: tx, table: f.business, d: d}, nil
		}})
		rec := &recorder{}
		in := newFeed()
		runRouter(t, func(r *message.Router) {
			r.AddMiddleware(rec.Middleware, ib.Middleware)
			r.AddHandler("billing", "orders", in, "invoices", gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{}),
				func(msg *message.Message) ([]*message.Message, error) {
					if err := f.writeBusinessRow(msg); err != nil {
						return nil, err
					}
					return []*message.Message{message.NewMessage(watermill.NewUUID(), nil)}, nil
				})
		})
		msg := message.NewMessage(watermill.NewUUID(), nil)
		if in.deliver(t, msg) {
			t.Fatal("acked although the commit phase outlived CommitTimeout")
		}
		if err := rec.last(); !errors.Is(err, inbox.ErrCommitTimeout) || !inbox.IsTransient(err) {
			t.Errorf("error %v: want ErrCommitTimeout, transient", err)
		}
		if b, i := f.businessRows(), f.inboxRows(); b != 0 || i != 0 {
			t.Errorf("after the timeout: business rows %d, inbox rows %d, want 0 and 0", b, i)
		}
		slow.Store(false)
		// A loaded machine may still need more than the bound: a
		// redelivery that timed out too is redelivered again.
		for attempt := 1; !in.deliver(t, msg); attempt++ {
			if err := rec.last(); !errors.Is(err, inbox.ErrCommitTimeout) || attempt == 5 {
				t.Fatalf("redelivery %d nacked: %v", attempt, err)
			}
		}
		if b, i := f.businessRows(), f.inboxRows(); b != 2 || i != 1 {
			t.Errorf("after the redelivery: business rows %d, inbox rows %d, want 2 and 1", b, i)
		}
	})
}
