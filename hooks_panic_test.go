package inbox_test

import (
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// An outcome hook that panics (a bug in the metrics code) changes
// no outcome: the panic is logged and the delivery ends as it would have.
// OnProcessed runs after COMMIT, and its panic went through Watermill's
// Recoverer: a message whose transaction had committed was nacked, and with
// a poison queue and no retries published to the poison topic as failed for
// good. The delivery's other hooks still run (OnReusedID's panic skipped
// OnFailed).
func TestOutcomeHookThatPanicsChangesNoOutcome(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		f := newFixture(t, db)
		var failed atomic.Int32
		ib := f.newInbox(inbox.Config{
			Dialect:     tdb.Dialect,
			OnProcessed: func(inbox.Event) { panic("bug in the processed counter") },
			OnDuplicate: func(inbox.Event) { panic("bug in the duplicate counter") },
			OnReusedID:  func(inbox.Event) { panic("bug in the reused-id counter") },
			OnFailed:    func(inbox.Event) { failed.Add(1); panic("bug in the failure counter") },
		})
		sink := &poisonSink{}
		mws, err := ib.Middlewares(inbox.MiddlewaresConfig{PoisonQueue: sink, Retry: middleware.Retry{MaxRetries: -1}})
		if err != nil {
			t.Fatal(err)
		}
		in := newFeed()
		runRouter(t, func(r *message.Router) {
			r.AddMiddleware(mws...)
			r.AddConsumerHandler("billing", "orders", in, f.writeBusinessRow)
		})
		msg := message.NewMessage(watermill.NewUUID(), []byte("invoice 1"))
		if !in.deliver(t, msg) {
			t.Fatal("a processed message whose OnProcessed hook panicked was nacked")
		}
		if !in.deliver(t, msg.Copy()) {
			t.Error("a duplicate whose OnDuplicate hook panicked was nacked")
		}
		if p, b, i := len(sink.poisoned()), f.businessRows(), f.inboxRows(); p != 0 || b != 1 || i != 1 {
			t.Fatalf("%d poisoned, %d business rows, %d inbox rows; want 0, 1, 1", p, b, i)
		}
		reused := message.NewMessage(msg.UUID, []byte("another invoice"))
		if !in.deliver(t, reused) {
			t.Error("a reused id whose hooks panicked was nacked; want it poisoned and acked")
		}
		if p := len(sink.poisoned()); p != 1 || failed.Load() != 1 {
			t.Errorf("after a reused id whose hooks panicked: %d poisoned, OnFailed called %d times; want 1 and 1", p, failed.Load())
		}
	})
}
