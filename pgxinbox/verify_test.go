package pgxinbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// pgxinbox's dialect choice is checked against the table as package
// inbox's is: PostgreSQLPartitioned on a plain table, and PostgreSQL on a
// partitioned one, are refused by Verify and by RouterPlugin with
// inbox.ErrIncompatibleTable naming the mismatch, and the first message is
// nacked without calling the handler.
func TestVerify_dialectDoesNotMatchTheTablesPartitioning(t *testing.T) {
	t.Parallel()
	pool := openPool(t, "", "pgx-verify-dialect", nil)
	for _, tc := range []struct {
		name      string
		made, use inbox.Dialect // the dialect that creates the table, and the one configured
		mention   string
	}{
		{"partitioned dialect on a plain table", inbox.PostgreSQL, inbox.PostgreSQLPartitioned, "not partitioned"},
		{"plain dialect on a partitioned table", inbox.PostgreSQLPartitioned, inbox.PostgreSQL, "PostgreSQLPartitioned"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, pool)
			f.newInbox(pgxinbox.Config{Dialect: tc.made}) // creates the table
			ib, err := pgxinbox.New(pgxinbox.Config{Pool: pool, Table: f.table, Dialect: tc.use})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { ib.Close() })

			err = ib.Verify(context.Background())
			if !errors.Is(err, inbox.ErrIncompatibleTable) || !strings.Contains(err.Error(), tc.mention) {
				t.Fatalf("Verify: %v, want inbox.ErrIncompatibleTable saying %q", err, tc.mention)
			}

			var called bool
			rec := &recorder{}
			in := consume(t, ib, func(*message.Message) error { called = true; return nil }, rec.Middleware)
			if in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
				t.Fatal("acked")
			}
			if err := rec.last(); !errors.Is(err, inbox.ErrIncompatibleTable) {
				t.Errorf("first message: %v, want inbox.ErrIncompatibleTable", err)
			}
			if called {
				t.Error("the handler was called")
			}

			r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
			if err != nil {
				t.Fatal(err)
			}
			r.AddPlugin(ib.RouterPlugin)
			if err := r.Run(context.Background()); !errors.Is(err, inbox.ErrIncompatibleTable) {
				t.Errorf("router.Run with RouterPlugin: %v, want inbox.ErrIncompatibleTable", err)
			}
		})
	}
}
