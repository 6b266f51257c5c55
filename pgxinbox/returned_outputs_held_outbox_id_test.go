package pgxinbox_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// An outbox table whose id an operator restarted while rows are pending
// hands the next outputs ids those rows hold (23505 on its primary key).
// Nothing is wrong with the message: the messages a handler returns, which
// pgxinbox writes by an INSERT sent with the COMMIT, fail transient with the
// setval that fixes it, as the same INSERT through Publish does, so that a
// poison filter on IsTransient keeps the message.
func TestReturnedOutputsOnAnIDTheOutboxStillHoldsAreTransient(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := openPool(t, "", "returned_held_id", nil)
	sfx := testdb.RandomSuffix()
	inboxTable, outboxTable := "inbox_held_"+sfx, "outbox_held_"+sfx
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		for _, tbl := range []string{inboxTable, outboxTable, outboxTable + "_dead"} {
			if _, err := pool.Exec(ctx, "DROP TABLE IF EXISTS "+tbl+" CASCADE"); err != nil {
				t.Logf("drop %s: %v", tbl, err)
			}
		}
	})
	db := pgxinbox.DB(pool)
	t.Cleanup(func() { db.Close() })
	ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Table: outboxTable, Publisher: &countingBroker{}, PollInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.InitializeSchema(ctx); err != nil {
		t.Fatal(err)
	}
	ib, err := pgxinbox.New(pgxinbox.Config{Pool: pool, Table: inboxTable, Outbox: pgxinbox.OutboxPublisher(ob)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ib.Close() })
	if err := ib.InitializeSchema(ctx); err != nil {
		t.Fatal(err)
	}
	rec, in := &recorder{}, newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(rec.Middleware, ib.Middleware)
		r.AddHandler("billing", "orders", in, "invoices", refusingPublisher{}, func(msg *message.Message) ([]*message.Message, error) {
			return outputs(msg, 1), nil
		})
	})
	// Three outputs pending (ids 1 to 3), then the id starts again.
	for range 3 {
		if !in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
			t.Fatalf("nacked: %v", rec.last())
		}
	}
	if _, err := pool.Exec(ctx, "ALTER TABLE "+outboxTable+" ALTER COLUMN id RESTART"); err != nil {
		t.Fatal(err)
	}
	if in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
		t.Fatal("acked a message whose output was written on id 1, which a pending row holds")
	}
	if err := rec.last(); !inbox.IsTransient(err) || !strings.Contains(err.Error(), "setval") {
		t.Errorf("returned output on an id the outbox table still holds: %v (transient: %v); want a transient error"+
			" that names the fix (setval), as the same INSERT through Publish gives", err, inbox.IsTransient(err))
	}
}
