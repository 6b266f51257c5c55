package pgxinbox_test

// The mistakes users make are named where they happen, on pgx as on
// database/sql.

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// A handler that writes through the pool instead of the transaction, with
// a pool of one connection that its own transaction holds, waits until the
// Timeout outside the inbox: the error matches context.DeadlineExceeded
// and says that the handler probably writes through the pool.
func TestMiddleware_DeadlineOnAnExhaustedPoolNamesPoolWrites(t *testing.T) {
	t.Parallel()
	pool := openPool(t, "", "hints-exhausted", func(c *pgxpool.Config) { c.MaxConns = 1 })
	f := newFixture(t, pool)
	ib := f.newInbox(pgxinbox.Config{})
	rec := &recorder{}
	in := consume(t, ib, func(msg *message.Message) error {
		// The mistake: the pool, not the transaction.
		_, err := pool.Exec(msg.Context(), "INSERT INTO "+f.effect+" (message_id) VALUES ($1)", msg.UUID)
		return err
	}, rec.Middleware, middleware.Timeout(300*time.Millisecond))
	if in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
		t.Fatal("acked a message whose handler timed out")
	}
	err := rec.last()
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "writing through the pool (db) instead of the transaction") {
		t.Errorf("error %q: want context.DeadlineExceeded with the hint about writes through the pool", err)
	}
	f.expectRows(0, 0)
}

// With Retry inside the inbox, the second attempt runs in the transaction
// the first one's failed statement aborted: the 25P02 that reaches the
// router names the mistake and still matches the driver's error.
func TestMiddleware_FailedTransactionNamesRetryInsideTheInbox(t *testing.T) {
	t.Parallel()
	f := newFixture(t, testdb.OpenPgxPool(t, ""))
	ib := f.newInbox(pgxinbox.Config{})
	rec := &recorder{}
	var attempts atomic.Int32
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		// The mistake: Retry added after (inside) the inbox.
		r.AddMiddleware(rec.Middleware, ib.Middleware, middleware.Retry{MaxRetries: 1, InitialInterval: time.Millisecond}.Middleware)
		r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
			attempts.Add(1)
			tx, _ := pgxinbox.TxFromContext(msg.Context())
			_, err := tx.Exec(msg.Context(), "INSERT INTO "+f.effect+" (message_id) VALUES (NULL)")
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
	if a := attempts.Load(); a != 2 {
		t.Errorf("%d attempts, want 2", a)
	}
	f.expectRows(0, 0)
}

// Behind a transaction-mode PgBouncer with pgx's default statement cache,
// Verify (and so RouterPlugin) and InitializeSchema fail at startup with
// 42P05 or 26000 that say how to configure the pool.
func TestPooler_StartupErrorsOfTheStatementCacheNameTheFix(t *testing.T) {
	t.Parallel()
	f := newFixture(t, testdb.OpenPgxPool(t, ""))
	f.newInbox(pgxinbox.Config{}) // the table, made without the pooler
	failed := 0
	for i := 0; i < 20 && failed < 3; i++ {
		pool := testdb.OpenPgxPoolBouncer(t, "")
		ib, err := pgxinbox.New(pgxinbox.Config{Pool: pool, Table: f.table})
		if err != nil {
			t.Fatal(err)
		}
		for _, err := range []error{ib.Verify(context.Background()), ib.InitializeSchema(context.Background())} {
			if err == nil {
				continue
			}
			var pgErr *pgconn.PgError
			if !errors.As(err, &pgErr) || (pgErr.Code != "42P05" && pgErr.Code != "26000") {
				t.Fatalf("%v, want nil or a prepared-statement error", err)
			}
			failed++
			if !strings.Contains(err.Error(), "default_query_exec_mode=exec or simple_protocol") {
				t.Errorf("%v: without the pooler hint", err)
			}
		}
		ib.Close()
		pool.Close()
	}
	if failed == 0 {
		t.Fatal("never met 42P05/26000 behind the pooler: the case did not happen")
	}
}
