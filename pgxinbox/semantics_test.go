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

// An inbox inside another inbox on another table (pgx in pgx, and pgx in a
// database/sql inbox) is refused with ErrNestedInbox, nothing is written by
// either, and no connection stays checked out. (The same inbox twice: the
// conformance suite's NestedInboxIsRefused.)
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
