package pgxinbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// Purge, NewPurger, Stats and CountExpired work on the inbox's pool through
// ib.DB() (pgxinbox.DB, the one-line adapter): they see and delete the rows
// the middleware wrote, by the database clock, and leave no connection
// checked out.
func TestMaintenance_PurgeAndStatsThroughDB(t *testing.T) {
	t.Parallel()
	pool := testdb.OpenPgxPool(t, "")
	f := newFixture(t, pool)
	ib := f.newInbox(pgxinbox.Config{})
	in := consume(t, ib, f.writeEffect)
	for range 5 {
		if !in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
			t.Fatal("nacked")
		}
	}
	f.exec("UPDATE " + f.table + " SET processed_at = now() - interval '2 hours' WHERE message_id IN (SELECT message_id FROM " + f.table + " LIMIT 3)")
	ctx := context.Background()
	cfg := inbox.PurgeConfig{DB: ib.DB(), Dialect: inbox.PostgreSQL, Table: f.table, OlderThan: time.Hour, BatchSize: 2}
	st, err := inbox.Stats(ctx, ib.DB(), inbox.PostgreSQL, f.table)
	if err != nil || st.Rows != 5 || st.Consumers["billing"] != 5 {
		t.Errorf("Stats: %+v, %v; want 5 rows of billing", st, err)
	}
	if n, err := inbox.CountExpired(ctx, cfg); err != nil || n != 3 {
		t.Errorf("CountExpired: %d, %v; want 3", n, err)
	}
	if n, err := inbox.Purge(ctx, cfg); err != nil || n != 3 {
		t.Errorf("Purge: %d, %v; want 3", n, err)
	}
	f.exec("UPDATE " + f.table + " SET processed_at = now() - interval '2 hours' WHERE message_id IN (SELECT message_id FROM " + f.table + " LIMIT 1)")
	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: cfg, Interval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if r := p.RunOnce(ctx); r.Err != nil || r.Deleted != 1 {
		t.Errorf("Purger.RunOnce: %+v, want 1 deleted", r)
	}
	f.expectRows(5, 1)
	expectNoConnHeld(t, pool)
}

// InitializeSchema is idempotent and safe to run at once from several
// inboxes; Verify passes on the table it made and reports a missing one
// with ErrTableNotFound; RouterPlugin makes router.Run fail on a missing
// table before any handler starts.
func TestMaintenance_SchemaVerifyAndRouterPlugin(t *testing.T) {
	forEachDialect(t, func(t *testing.T, d inbox.Dialect) {
		pool := testdb.OpenPgxPool(t, "")
		f := newFixture(t, pool)
		ctx := context.Background()
		errs := make(chan error, 3)
		for range 3 {
			ib, err := pgxinbox.New(pgxinbox.Config{Pool: pool, Dialect: d, Table: f.table})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { ib.Close() })
			go func() { errs <- ib.InitializeSchema(ctx) }()
		}
		for range 3 {
			if err := <-errs; err != nil {
				t.Errorf("concurrent InitializeSchema: %v", err)
			}
		}
		ib := f.newInbox(pgxinbox.Config{Dialect: d}) // once more, on the existing table
		if err := ib.Verify(ctx); err != nil {
			t.Errorf("Verify: %v", err)
		}
		missing, err := pgxinbox.New(pgxinbox.Config{Pool: pool, Dialect: d, Table: "pgx_missing_" + f.sfx})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { missing.Close() })
		if err := missing.Verify(ctx); !errors.Is(err, inbox.ErrTableNotFound) {
			t.Errorf("Verify on a missing table: %v, want ErrTableNotFound", err)
		}
		r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		r.AddPlugin(missing.RouterPlugin)
		r.AddMiddleware(missing.Middleware)
		r.AddConsumerHandler("billing", "orders", newFeed(), f.writeEffect)
		if err := r.Run(ctx); !errors.Is(err, inbox.ErrTableNotFound) {
			t.Errorf("router.Run with RouterPlugin on a missing table: %v, want ErrTableNotFound", err)
		}
		expectNoConnHeld(t, pool)
	})
}
