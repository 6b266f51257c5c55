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

// A Config.Fingerprint that panics fails the delivery before the handler
// runs: OnFailed's Event.Err names the fingerprint, the code that
// panicked, not the handler, which was never called (an operator reading
// the event, or a span's status, looks for the bug where it is).
func TestFingerprintPanicIsReportedAsTheFingerprintsNotTheHandlers(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		f := newFixture(t, db)
		var mu sync.Mutex
		var failed []error
		ib := f.newInbox(inbox.Config{
			Fingerprint: func(*message.Message) []byte { panic("bug in the fingerprint") },
			OnFailed: func(e inbox.Event) {
				mu.Lock()
				failed = append(failed, e.Err)
				mu.Unlock()
			},
		})
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
			t.Fatal("a delivery whose fingerprint panicked was acked")
		}
		mu.Lock()
		defer mu.Unlock()
		if len(failed) != 1 || c.get(msg.UUID) != 0 {
			t.Fatalf("OnFailed %d times, handler calls %d; want 1 and 0", len(failed), c.get(msg.UUID))
		}
		if got := failed[0].Error(); strings.Contains(got, "handler panicked") || !strings.Contains(got, "ingerprint") {
			t.Errorf("OnFailed's Event.Err is %q for a panic in Config.Fingerprint (the handler was never called); want it to name the fingerprint", got)
		}
	})
}
