package inbox_test

import (
	"context"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A Config.Outbox that panics fails the delivery before the handler runs:
// OnFailed's Event.Err names the code that panicked, not the handler, which
// was never called, as it does for Config.Fingerprint and Config.MessageID.
func TestOutboxFactoryPanicIsReportedAsTheOutboxsNotTheHandlers(t *testing.T) {
	t.Parallel()
	db := testdb.OpenSQLite(t, filepath.Join(t.TempDir(), "inbox.db"))
	var mu sync.Mutex
	var failed []error
	ib, err := inbox.New(inbox.Config{DB: db, Dialect: inbox.SQLite, Table: "inbox_table",
		Outbox: func(*sqlx.Tx) (message.Publisher, error) { panic("bug in the outbox factory") },
		OnFailed: func(e inbox.Event) {
			mu.Lock()
			failed = append(failed, e.Err)
			mu.Unlock()
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ib.Close() })
	if err := ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	var c calls
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(middleware.Recoverer, ib.Middleware)
		r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
			c.inc(msg.UUID)
			return nil
		})
	})
	msg := message.NewMessage(watermill.NewUUID(), []byte("order 1"))
	if in.deliver(t, msg) {
		t.Fatal("a delivery whose Outbox factory panicked was acked")
	}
	mu.Lock()
	defer mu.Unlock()
	if len(failed) != 1 || c.get(msg.UUID) != 0 {
		t.Fatalf("OnFailed %d times, handler calls %d; want 1 and 0", len(failed), c.get(msg.UUID))
	}
	if got := failed[0].Error(); strings.Contains(got, "handler panicked") {
		t.Errorf("OnFailed's Event.Err is %q for a panic in Config.Outbox (the handler was never called); want it to name the Outbox", got)
	}
}
