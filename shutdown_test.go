package inbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"path/filepath"
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

// A message that arrives after the service closed its *sql.DB (a deploy
// shutting down) is nacked with an error IsTransient accepts, so that a
// poison filter (!IsTransient) leaves it for a redelivery; nothing is written.
func TestShutdown_ClosedDBIsTransient(t *testing.T) {
	t.Parallel()
	for _, tdb := range testDBs {
		t.Run(tdb.Name, func(t *testing.T) {
			t.Parallel()
			closedDBCase(t, tdb)
		})
	}
}

// closedDBCase is one database's case of TestShutdown_ClosedDBIsTransient.
func closedDBCase(t *testing.T, tdb testDB) {
	var db, inboxDB *sqlx.DB // inboxDB: the inbox's own, closed below
	if tdb.Dialect == inbox.SQLite {
		path := filepath.Join(t.TempDir(), "inbox.db")
		db, inboxDB = openSQLite(t, path), openSQLite(t, path)
	} else {
		db, inboxDB = tdb.Open(t), tdb.Open(t)
	}
	f := newFixture(t, db)
	ib, err := inbox.New(inbox.Config{DB: inboxDB, Dialect: tdb.Dialect, Table: f.inbox})
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	out := &outcomes{}
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(out.Middleware, ib.Middleware)
		r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error { return f.writeBusinessRow(msg) })
	})
	ctx, cancel := context.WithTimeout(context.Background(), caseTimeout)
	defer cancel()
	if acked, err := in.send(ctx, delivery(message.NewMessage(watermill.NewUUID(), nil), "before")); err != nil || !acked {
		t.Fatalf("before the close: acked %v (%v), router got %v", acked, err, out.last("before"))
	}
	inboxDB.Close()
	if acked, err := in.send(ctx, delivery(message.NewMessage(watermill.NewUUID(), nil), "after")); err != nil || acked {
		t.Fatalf("after the close: acked %v (%v), want a nack", acked, err)
	}
	if err := out.last("after"); err == nil || !inbox.IsTransient(err) {
		t.Errorf("router got %v (transient %v), want a transient error", err, inbox.IsTransient(err))
	}
	if f.businessRows() != 1 || f.inboxRows() != 1 {
		t.Errorf("business rows %d, inbox rows %d; want 1 and 1", f.businessRows(), f.inboxRows())
	}
}

// A message in its handler when the router closes: its context ends (the
// GoChannel subscriber's messages live on the router's context), the
// transaction rolls back, and the error the router gets is transient, with
// context.Canceled reachable by errors.Is; nothing is written.
func TestShutdown_RouterCloseIsTransient(t *testing.T) {
	t.Parallel()
	db := sqliteDB(t)
	f := newFixture(t, db)
	ib := f.newInbox(inbox.Config{})
	pubsub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	t.Cleanup(func() { pubsub.Close() })
	rec := &recorder{}
	inHandler := make(chan struct{})
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: caseTimeout}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r.AddMiddleware(rec.Middleware, ib.Middleware)
	r.AddConsumerHandler("billing", "orders", pubsub, func(msg *message.Message) error {
		if err := f.writeBusinessRow(msg); err != nil {
			return err
		}
		close(inHandler)
		<-msg.Context().Done()
		return nil // the handler does not check its context: the inbox does
	})
	closeWhileInHandler(t, r, pubsub, inHandler)
	err = rec.last()
	if !errors.Is(err, context.Canceled) || !inbox.IsTransient(err) {
		t.Errorf("router got %v (transient %v), want context.Canceled, transient", err, inbox.IsTransient(err))
	}
	if f.businessRows() != 0 || f.inboxRows() != 0 {
		t.Errorf("business rows %d, inbox rows %d; want 0 and 0", f.businessRows(), f.inboxRows())
	}
}

// A handler that does not watch its context (an API call, a computation)
// when the router closes, and then writes through the transaction with a
// statement that takes no context (sqlx's Exec): database/sql rolled the
// transaction back when the message context ended, so the statement fails
// with sql.ErrTxDone, which the handler returns. The router's error still
// matches the handler's, and it is transient (context.Canceled reachable):
// behind the poison queue the README recommends, with no Retry to replace
// the error, the message was poisoned by the shutdown.
func TestShutdown_HandlerErrorAfterTheRouterClosedIsTransientNotPoisoned(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		f := newFixture(t, db)
		ib := f.newInbox(inbox.Config{})
		pubsub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
		t.Cleanup(func() { pubsub.Close() })
		poison, sink := poisonUnlessTransient(t)
		rec := &recorder{}
		inHandler := make(chan struct{})
		r, err := message.NewRouter(message.RouterConfig{CloseTimeout: caseTimeout}, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		r.AddMiddleware(rec.Middleware, poison, ib.Middleware)
		r.AddConsumerHandler("billing", "orders", pubsub, func(msg *message.Message) error {
			if err := f.writeBusinessRow(msg); err != nil {
				return err
			}
			close(inHandler)
			<-msg.Context().Done()
			tx, _ := inbox.TxFromContext(msg.Context())
			// database/sql rolls the transaction back on a goroutine of
			// its own once the context ended; the handler's work takes
			// longer than that.
			for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
				if _, err := tx.Exec("SELECT 1"); errors.Is(err, sql.ErrTxDone) {
					break
				}
			}
			if _, err := tx.Exec(tx.Rebind("INSERT INTO "+f.business+" (id, consumer) VALUES (?, ?)"), "line-"+msg.UUID, "billing"); err != nil {
				return fmt.Errorf("save order line: %w", err)
			}
			return nil
		})
		closeWhileInHandler(t, r, pubsub, inHandler)
		// The first outcome is the delivery whose handler ran: gochannel may
		// send the nacked message again while the router closes, and that
		// delivery's BEGIN finds its context ended (transient too).
		outcomes := rec.All()
		if len(outcomes) == 0 {
			t.Fatal("no delivery ended")
		}
		err = outcomes[0]
		if !errors.Is(err, sql.ErrTxDone) || !errors.Is(err, context.Canceled) || !inbox.IsTransient(err) {
			t.Errorf("router got %v (transient %v), want the handler's sql.ErrTxDone and context.Canceled, transient", err, inbox.IsTransient(err))
		}
		if n := len(sink.poisoned()); n != 0 {
			t.Errorf("%d message(s) poisoned by the shutdown, want none", n)
		}
		if f.businessRows() != 0 || f.inboxRows() != 0 {
			t.Errorf("business rows %d, inbox rows %d; want 0 and 0", f.businessRows(), f.inboxRows())
		}
	})
}

// A handler that rejects a message for good after a Timeout middleware's
// deadline passed (a slow check that does not watch its context, then a
// refusal that has nothing to do with the deadline) keeps its own error:
// the poison queue the README recommends takes the message, once. Wrapping
// every handler error returned after the context ended made it transient,
// and the same payload was redelivered and refused for ever.
func TestPermanentHandlerErrorAfterATimeoutIsStillPoisoned(t *testing.T) {
	errRefused := errors.New("order amount is negative")
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		f := newFixture(t, db)
		ib := f.newInbox(inbox.Config{})
		pubsub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
		t.Cleanup(func() { pubsub.Close() })
		poison, sink := poisonUnlessTransient(t)
		var runs atomic.Int32
		rec := &recorder{}
		r, err := message.NewRouter(message.RouterConfig{CloseTimeout: caseTimeout}, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		r.AddMiddleware(poison, rec.Middleware, middleware.Timeout(50*time.Millisecond), ib.Middleware)
		r.AddConsumerHandler("billing", "orders", pubsub, func(msg *message.Message) error {
			runs.Add(1)
			<-msg.Context().Done() // a slow check that does not watch its context
			return errRefused
		})
		done := make(chan struct{})
		go func() { _ = r.Run(context.Background()); close(done) }()
		t.Cleanup(func() { r.Close(); <-done })
		<-r.Running()
		if err := pubsub.Publish("orders", message.NewMessage(watermill.NewUUID(), nil)); err != nil {
			t.Fatal(err)
		}
		for deadline := time.Now().Add(10 * time.Second); len(sink.poisoned()) == 0; time.Sleep(10 * time.Millisecond) {
			if time.Now().After(deadline) {
				err := rec.last()
				t.Fatalf("not poisoned after %d runs; the router got %v (transient %v)", runs.Load(), err, inbox.IsTransient(err))
			}
		}
		if n := runs.Load(); n != 1 {
			t.Errorf("handler ran %d times, want once: %v", n, rec.Failures())
		}
		if err := rec.last(); !errors.Is(err, errRefused) {
			t.Errorf("router got %v, want the handler's error", err)
		}
	})
}

// closeWhileInHandler runs r, publishes one message to its "orders" topic
// on pubsub, closes r once the handler has said so on inHandler (a message
// in its handler when the process shuts down), and returns when r.Run has
// returned.
func closeWhileInHandler(t *testing.T, r *message.Router, pubsub message.Publisher, inHandler <-chan struct{}) {
	t.Helper()
	done := make(chan struct{})
	go func() { _ = r.Run(context.Background()); close(done) }()
	<-r.Running()
	if err := pubsub.Publish("orders", message.NewMessage(watermill.NewUUID(), nil)); err != nil {
		t.Fatal(err)
	}
	select {
	case <-inHandler:
	case <-done:
		t.Fatal("the router stopped before the handler ran")
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	<-done
}
