package inbox_test

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// An inbox table that goes missing while the service runs (dropped or
// renamed by a migration after the inbox checked it at startup) is a
// configuration fault, not the message's: the claim's error is transient and
// wraps ErrTableNotFound, so the default poison filter (!IsTransient) nacks
// the message instead of publishing it to the poison queue. README: "a
// missing inbox table and the inbox's own errors of setup are transient
// (nacked, never poisoned), so a misconfigured inbox does not drain the
// topic".
func TestTableDroppedAfterTheStartupCheckIsNotPoisoned(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if tdb.Dialect == inbox.PostgreSQLPartitioned {
			t.Skip("the plain dialects only: a partitioned table's claim function would be left behind")
		}
		table := "inbox_" + randomSuffix()
		dropLater(t, db, table)
		var mu sync.Mutex
		var failures []error
		ib, err := inbox.New(inbox.Config{DB: db, Dialect: tdb.Dialect, Table: table, OnFailed: func(e inbox.Event) {
			mu.Lock()
			defer mu.Unlock()
			failures = append(failures, e.Err)
		}})
		if err != nil {
			t.Fatal(err)
		}
		if err := ib.InitializeSchema(context.Background()); err != nil {
			t.Fatal(err)
		}
		poison := &recordingPublisher{}
		mws, err := ib.Middlewares(inbox.MiddlewaresConfig{PoisonQueue: poison})
		if err != nil {
			t.Fatal(err)
		}
		in := newFeed()
		calls := 0
		runRouter(t, func(r *message.Router) {
			r.AddMiddleware(mws...)
			r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
				calls++
				return nil
			})
		})
		// The startup check passes on the first message.
		if !in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
			t.Fatal("first message nacked with the table in place")
		}
		exec(t, db, "DROP TABLE "+table)

		acked := in.deliver(t, message.NewMessage(watermill.NewUUID(), nil))
		poison.mu.Lock()
		poisoned := poison.published
		poison.mu.Unlock()
		mu.Lock()
		defer mu.Unlock()
		var last error
		if len(failures) > 0 {
			last = failures[len(failures)-1]
		}
		if acked || poisoned != 0 {
			t.Errorf("message after the table was dropped: acked %v, poisoned %d; want nacked and not poisoned (the topic is drained"+
				" into the poison queue otherwise); its error: %v (transient %v, ErrTableNotFound %v)",
				acked, poisoned, last, inbox.IsTransient(last), errors.Is(last, inbox.ErrTableNotFound))
		}
	})
}
