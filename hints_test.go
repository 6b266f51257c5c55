package inbox_test

// The mistakes users make (Retry inside the inbox, writes through the pool,
// a missing table) end in the right outcome and are named where they
// happen.

import (
	"context"
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
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// Through Inbox.Middlewares, a failed attempt is retried in a new
// transaction: its writes are rolled back, and only the successful
// attempt's row commits, with one inbox row; the message is acked.
func TestMiddlewares_RetryRunsEachAttemptInItsOwnTransaction(t *testing.T) {
	t.Parallel()
	forEachDB(t, func(t *testing.T, _ testDB, db *sqlx.DB) {
		f := newFixture(t, db)
		ib := f.newInbox(inbox.Config{})
		mws, err := ib.Middlewares(inbox.MiddlewaresConfig{Retry: middleware.Retry{InitialInterval: time.Millisecond}})
		if err != nil {
			t.Fatal(err)
		}
		var attempts atomic.Int32
		in := newFeed()
		runRouter(t, func(r *message.Router) {
			r.AddMiddleware(mws...)
			r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
				n := attempts.Add(1)
				if err := f.insertRow(msg, fmt.Sprintf("attempt-%d", n)); err != nil {
					return err
				}
				if n == 1 {
					return errors.New("downstream unavailable")
				}
				return nil
			})
		})
		if !in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
			t.Fatal("nacked: the retry should have succeeded")
		}
		if a, b, i := attempts.Load(), f.businessRows(), f.inboxRows(); a != 2 || b != 1 || i != 1 {
			t.Errorf("%d attempts, %d business rows, %d inbox rows; want 2, 1 (the second attempt's) and 1", a, b, i)
		}
		if n := count(t, db, f.business, "id = ?", "attempt-1"); n != 0 {
			t.Error("the failed attempt's row committed")
		}
	})
}

// Through Inbox.Middlewares, an attempt that hit its Timeout is retried
// with a live context: middleware.Timeout leaves its ended context on the
// message, and the retry must not start from it.
func TestMiddlewares_RetryAfterTimeoutGetsALiveContext(t *testing.T) {
	t.Parallel()
	db := sqliteDB(t)
	f := newFixture(t, db)
	ib := f.newInbox(inbox.Config{})
	mws, err := ib.Middlewares(inbox.MiddlewaresConfig{
		Retry:   middleware.Retry{MaxRetries: 1, InitialInterval: time.Millisecond},
		Timeout: 100 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	var attempts atomic.Int32
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(mws...)
		r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
			if attempts.Add(1) == 1 {
				<-msg.Context().Done() // stuck until the attempt's deadline
				return msg.Context().Err()
			}
			return f.writeBusinessRow(msg)
		})
	})
	if !in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
		t.Fatal("nacked: the retry after the timeout should have succeeded")
	}
	if a, b := attempts.Load(), f.businessRows(); a != 2 || b != 1 {
		t.Errorf("%d attempts, %d business rows; want 2 and 1", a, b)
	}
}

// Through Inbox.Middlewares with a poison queue: a handler that always
// panics and a message without an id go to the poison topic (acked, nothing
// committed); a missing table is only nacked, so that a misconfiguration
// does not drain the topic.
func TestMiddlewares_PoisonQueueTakesBadMessagesNotMisconfiguration(t *testing.T) {
	t.Parallel()
	db := sqliteDB(t)
	f := newFixture(t, db)
	ib := f.newInbox(inbox.Config{})
	sink := &poisonSink{}
	mws, err := ib.Middlewares(inbox.MiddlewaresConfig{PoisonQueue: sink, Retry: middleware.Retry{MaxRetries: 2, InitialInterval: time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int32
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(mws...)
		r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
			calls.Add(1)
			if err := f.writeBusinessRow(msg); err != nil {
				return err
			}
			panic("bug in the handler")
		})
	})
	if !in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
		t.Error("a message whose handler always panics was nacked; want it poisoned and acked")
	}
	if c := calls.Load(); c != 3 {
		t.Errorf("%d handler calls, want 3 (the first and 2 retries)", c)
	}
	if !in.deliver(t, message.NewMessage("", nil)) {
		t.Error("a message without an id was nacked; want it poisoned and acked")
	}
	if c := calls.Load(); c != 3 {
		t.Errorf("the message without an id reached the handler (%d calls)", c)
	}
	if p, b, i := len(sink.poisoned()), f.businessRows(), f.inboxRows(); p != 2 || b != 0 || i != 0 {
		t.Errorf("%d poisoned, %d business rows, %d inbox rows; want 2, 0, 0", p, b, i)
	}

	missing, err := inbox.New(inbox.Config{DB: db, Table: "never_created_" + randomSuffix()})
	if err != nil {
		t.Fatal(err)
	}
	inbox.SetTableBackoffHook(missing, func(time.Duration) {})
	mws, err = missing.Middlewares(inbox.MiddlewaresConfig{PoisonQueue: sink})
	if err != nil {
		t.Fatal(err)
	}
	rec := &recorder{}
	in2 := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(rec.Middleware)
		r.AddMiddleware(mws...)
		r.AddConsumerHandler("billing", "orders", in2, func(*message.Message) error { return nil })
	})
	if in2.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
		t.Error("acked without an inbox table")
	}
	if err := rec.last(); !errors.Is(err, inbox.ErrTableNotFound) {
		t.Errorf("error %v, want one wrapping ErrTableNotFound", err)
	}
	if p := len(sink.poisoned()); p != 2 {
		t.Errorf("a message that met a missing table was poisoned (%d poisoned, want still 2)", p)
	}
}

// A message that meets a missing inbox table is nacked with ErrTableNotFound,
// transient so that a poison filter keeps it, after a wait that doubles
// with each such delivery, so that a broker's immediate redelivery does not
// spin; once the table exists, the next delivery is processed.
func TestMiddleware_MissingTableBacksOffAndIsNotPoisoned(t *testing.T) {
	t.Parallel()
	db := sqliteDB(t)
	f := newFixture(t, db)
	ib, err := inbox.New(inbox.Config{DB: db, Table: f.inbox})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var waits []time.Duration
	inbox.SetTableBackoffHook(ib, func(d time.Duration) {
		mu.Lock()
		waits = append(waits, d)
		mu.Unlock()
	})
	poison, sink := poisonUnlessTransient(t)
	rec := &recorder{}
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(poison, rec.Middleware, ib.Middleware)
		r.AddConsumerHandler("billing", "orders", in, f.writeBusinessRow)
	})
	msg := message.NewMessage(watermill.NewUUID(), nil)
	for range 3 {
		if in.deliver(t, msg) {
			t.Fatal("acked without an inbox table")
		}
		err := rec.last()
		if !errors.Is(err, inbox.ErrTableNotFound) || !inbox.IsTransient(err) || !strings.Contains(err.Error(), "RouterPlugin") {
			t.Errorf("error %v: want a transient error wrapping ErrTableNotFound that names RouterPlugin", err)
		}
	}
	mu.Lock()
	got := fmt.Sprint(waits)
	mu.Unlock()
	if want := "[100ms 200ms 400ms]"; got != want {
		t.Errorf("waits before the nacks %s, want %s", got, want)
	}
	if p := len(sink.poisoned()); p != 0 {
		t.Errorf("%d messages poisoned for a missing table", p)
	}
	if err := ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	if !in.deliver(t, msg) || f.businessRows() != 1 {
		t.Error("after InitializeSchema: want the redelivery processed")
	}
}

// With Config.OutboxTables, RouterPlugin stops router.Run when an outbox
// table is missing (ErrTableNotFound naming it), and without the plugin the
// middleware nacks before the claim instead of failing every message at
// its outbox publish; once the table exists, messages are processed.
func TestRouterPlugin_MissingOutboxTableStopsTheRouter(t *testing.T) {
	t.Parallel()
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		f := newFixture(t, db)
		outbox := "watermill_outbox_" + randomSuffix()
		dropLater(t, db, outbox)
		cfg := inbox.Config{
			Outbox:       func(tx *sqlx.Tx) (message.Publisher, error) { return &txPublisher{tx: tx, table: outbox}, nil },
			OutboxTables: []string{outbox},
		}
		ib := f.newInbox(cfg)
		r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		in := newFeed()
		r.AddHandler("billing", "orders", in, "invoices", &recordingPublisher{}, func(msg *message.Message) ([]*message.Message, error) {
			return []*message.Message{message.NewMessage(watermill.NewUUID(), nil)}, f.writeBusinessRow(msg)
		})
		r.AddMiddleware(ib.Middleware)
		r.AddPlugin(ib.RouterPlugin)
		err = runUntilRunning(r)
		if !errors.Is(err, inbox.ErrTableNotFound) || !strings.Contains(err.Error(), "outbox table \""+outbox+"\"") {
			t.Errorf("router.Run = %v, want ErrTableNotFound naming the outbox table %s", err, outbox)
		}

		// Without the plugin: nacked before anything is written.
		ib = f.newInbox(cfg)
		inbox.SetTableBackoffHook(ib, func(time.Duration) {})
		rec := &recorder{}
		runRouter(t, func(r *message.Router) {
			r.AddMiddleware(rec.Middleware, ib.Middleware)
			r.AddHandler("billing", "orders", in, "invoices", &recordingPublisher{}, func(msg *message.Message) ([]*message.Message, error) {
				return []*message.Message{message.NewMessage(watermill.NewUUID(), nil)}, f.writeBusinessRow(msg)
			})
		})
		msg := message.NewMessage(watermill.NewUUID(), nil)
		if in.deliver(t, msg) {
			t.Fatal("acked without an outbox table")
		}
		if err := rec.last(); !errors.Is(err, inbox.ErrTableNotFound) || !inbox.IsTransient(err) || !strings.Contains(err.Error(), outbox) {
			t.Errorf("error %v: want a transient error wrapping ErrTableNotFound that names %s", err, outbox)
		}
		if b, i := f.businessRows(), f.inboxRows(); b != 0 || i != 0 {
			t.Errorf("%d business rows, %d inbox rows, want none", b, i)
		}

		exec(t, db, "CREATE TABLE "+outbox+" (uuid VARCHAR(64) NOT NULL PRIMARY KEY, topic VARCHAR(255) NOT NULL)")
		if !in.deliver(t, msg) || f.businessRows() != 1 || count(t, db, outbox, "") != 1 {
			t.Error("with the outbox table: want the message processed and its output in the outbox")
		}
		if err := ib.Verify(context.Background()); err != nil {
			t.Errorf("Verify with both tables: %v", err)
		}
	})
}

// With Retry inside the inbox on PostgreSQL, an attempt whose statement
// failed aborts the shared transaction and the next attempt fails with
// SQLSTATE 25P02: the error that reaches the router says why and names the
// fix, and still matches the driver's error; nothing commits.
func TestMiddleware_FailedTransactionNamesRetryInsideTheInbox(t *testing.T) {
	t.Parallel()
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if !isPostgres(tdb.Dialect) {
			t.Skip("only PostgreSQL aborts a transaction after a failed statement (25P02)")
		}
		f := newFixture(t, db)
		ib := f.newInbox(inbox.Config{})
		rec := &recorder{}
		var attempts atomic.Int32
		in := newFeed()
		runRouter(t, func(r *message.Router) {
			// The mistake: Retry added after (inside) the inbox.
			r.AddMiddleware(rec.Middleware, ib.Middleware, middleware.Retry{MaxRetries: 1, InitialInterval: time.Millisecond}.Middleware)
			r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
				attempts.Add(1)
				// The same id each attempt: the first fails on the NOT
				// NULL constraint, the second on the aborted transaction.
				tx, _ := inbox.TxFromContext(msg.Context())
				_, err := tx.ExecContext(msg.Context(), "INSERT INTO "+f.business+" (id, consumer) VALUES ($1, NULL)", msg.UUID)
				return err
			})
		})
		if in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
			t.Fatal("acked a message whose every attempt failed")
		}
		err := rec.last()
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "25P02" {
			t.Fatalf("error %v, want the driver's 25P02", err)
		}
		if !strings.Contains(err.Error(), "Retry") || !strings.Contains(err.Error(), "an earlier statement failed in this transaction") {
			t.Errorf("error %q: want the hint that an earlier statement failed, as with Retry inside the inbox", err)
		}
		if a, b, i := attempts.Load(), f.businessRows(), f.inboxRows(); a != 2 || b != 0 || i != 0 {
			t.Errorf("%d attempts, %d business rows, %d inbox rows; want 2, 0, 0", a, b, i)
		}
	})
}

// A handler's own statement that fails with a prepared statement missing
// or already there on the server connection (26000, 42P05: pgx's default
// statement cache behind PgBouncer in transaction mode) reaches the router
// with the fix named, as the inbox's own statements do, and still matches
// the driver's error: a message poisoned so said nothing of the pooler.
func TestMiddleware_HandlersPreparedStatementErrorNamesThePoolerFix(t *testing.T) {
	t.Parallel()
	db := testdb.OpenPostgres(t, "")
	f := newFixture(t, db)
	ib := f.newInbox(inbox.Config{})
	rec := &recorder{}
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(rec.Middleware, ib.Middleware)
		r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
			tx, _ := inbox.TxFromContext(msg.Context())
			name := "inbox_hint_" + randomSuffix()
			for range 2 { // the second PREPARE finds it there: 42P05
				if _, err := tx.ExecContext(msg.Context(), "PREPARE "+name+" AS SELECT 1"); err != nil {
					return err
				}
			}
			return nil
		})
	})
	if in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
		t.Fatal("acked a message whose handler failed")
	}
	err := rec.last()
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "42P05" {
		t.Fatalf("error %v, want the driver's 42P05", err)
	}
	if !strings.Contains(err.Error(), "default_query_exec_mode") {
		t.Errorf("error %q: want the hint that names pgx's query exec mode behind a transaction-mode pooler", err)
	}
}

// A handler that writes through the pool instead of the transaction, with
// a pool of one connection that its own transaction holds, waits until the
// Timeout outside the inbox: the error still matches
// context.DeadlineExceeded and says that the handler probably writes
// through db; nothing commits.
func TestMiddleware_DeadlineOnAnExhaustedPoolNamesPoolWrites(t *testing.T) {
	t.Parallel()
	forEachDB(t, func(t *testing.T, _ testDB, db *sqlx.DB) {
		db.SetMaxOpenConns(1)
		f := newFixture(t, db)
		ib := f.newInbox(inbox.Config{})
		rec := &recorder{}
		in := newFeed()
		runRouter(t, func(r *message.Router) {
			r.AddMiddleware(rec.Middleware, middleware.Timeout(300*time.Millisecond), ib.Middleware)
			r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
				// The mistake: db, not the transaction.
				_, err := db.ExecContext(msg.Context(), db.Rebind("INSERT INTO "+f.business+" (id, consumer) VALUES (?, ?)"), msg.UUID, "billing")
				return err
			})
		})
		if in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
			t.Fatal("acked a message whose handler timed out")
		}
		err := rec.last()
		if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "writing through the pool (db) instead of the transaction") {
			t.Errorf("error %q: want context.DeadlineExceeded with the hint about writes through db", err)
		}
		if b, i := f.businessRows(), f.inboxRows(); b != 0 || i != 0 {
			t.Errorf("%d business rows, %d inbox rows, want none", b, i)
		}
	})
}

// runUntilRunning runs r and returns router.Run's error, or nil (after
// closing r) once r is running.
func runUntilRunning(r *message.Router) error {
	errc := make(chan error, 1)
	go func() { errc <- r.Run(context.Background()) }()
	select {
	case err := <-errc:
		return err
	case <-r.Running():
		r.Close()
		return nil
	}
}

// Inbox.Middlewares refuses a poison topic or filter without a poison
// queue publisher, which would otherwise be ignored in silence.
func TestMiddlewares_PoisonSettingsWithoutAPublisherAreInvalid(t *testing.T) {
	t.Parallel()
	ib, err := inbox.New(inbox.Config{DB: sqliteDB(t)})
	if err != nil {
		t.Fatal(err)
	}
	for _, cfg := range []inbox.MiddlewaresConfig{
		{PoisonTopic: "orders.poison"},
		{ShouldPoison: func(error) bool { return true }},
	} {
		if _, err := ib.Middlewares(cfg); !errors.Is(err, inbox.ErrInvalidConfig) {
			t.Errorf("Middlewares(%+v) = %v, want ErrInvalidConfig", cfg, err)
		}
	}
}
