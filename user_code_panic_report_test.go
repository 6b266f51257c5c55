package inbox_test

import (
	"strings"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// A Config function that panics before the handler runs (Fingerprint,
// MessageID, the Outbox factory) fails the delivery: OnFailed's Event.Err
// names the code that panicked, not the handler, which was never called
// (an operator reading the event, or a span's status, looks for the bug
// where it is).
func TestUserCodePanicBeforeTheHandlerIsReportedAsItsOwn(t *testing.T) {
	for _, tc := range []struct {
		name   string // as Event.Err names it
		config inbox.Config
	}{
		{"Fingerprint", inbox.Config{Fingerprint: func(*message.Message) []byte { panic("bug in the fingerprint") }}},
		{"MessageID", inbox.Config{MessageID: func(*message.Message) (string, error) { panic("bug in the message id") }}},
		{"Outbox", inbox.Config{Outbox: func(*sqlx.Tx) (message.Publisher, error) { panic("bug in the outbox factory") }}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
				f := newFixture(t, db)
				var mu sync.Mutex
				var failed []error
				cfg := tc.config
				cfg.OnFailed = func(e inbox.Event) {
					mu.Lock()
					failed = append(failed, e.Err)
					mu.Unlock()
				}
				ib := f.newInbox(cfg)
				var c calls
				in := newFeed()
				runRouter(t, func(r *message.Router) {
					r.AddMiddleware(middleware.Recoverer, ib.Middleware)
					r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
						c.inc(msg.UUID)
						return f.writeBusinessRow(msg)
					})
				})
				msg := message.NewMessage(watermill.NewUUID(), []byte("order 1"))
				if in.deliver(t, msg) {
					t.Fatalf("a delivery whose Config.%s panicked was acked", tc.name)
				}
				mu.Lock()
				defer mu.Unlock()
				if len(failed) != 1 || c.get(msg.UUID) != 0 {
					t.Fatalf("OnFailed %d times, handler calls %d; want 1 and 0", len(failed), c.get(msg.UUID))
				}
				if got := failed[0].Error(); strings.Contains(got, "handler panicked") || !strings.Contains(got, "Config."+tc.name) {
					t.Errorf("OnFailed's Event.Err is %q for a panic in Config.%s (the handler was never called); want it to name Config.%[2]s", got, tc.name)
				}
			})
		})
	}
}
