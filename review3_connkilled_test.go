package inbox_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// TestReview3MySQLConnectionKilledIsTransient: the MySQL server closes the
// handler's connection (a restart, a failover, KILL, wait_timeout). The
// handler's next statement fails with go-sql-driver's plain
// "invalid connection" (mysql.ErrInvalidConn), and so does the inbox's
// ROLLBACK. Nothing was committed and the redelivery succeeds, but
// IsTransient said false: the README's poison queue took every message in
// flight during a failover.
func TestReview3MySQLConnectionKilledIsTransient(t *testing.T) {
	t.Parallel()
	db := testdb.OpenMySQL(t, "")
	f := newFixture(t, db)
	ib := f.newInbox(inbox.Config{})
	poison, sink := poisonUnlessTransient(t)
	out := &outcomes{}
	in := newFeed()
	defer in.Close()
	var kill atomic.Bool
	kill.Store(true)
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(poison, out.Middleware, ib.Middleware)
		r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
			if kill.Load() {
				tx, _ := inbox.TxFromContext(msg.Context())
				var id int
				if err := tx.GetContext(msg.Context(), &id, `SELECT CONNECTION_ID()`); err != nil {
					return err
				}
				if _, err := db.ExecContext(msg.Context(), `KILL `+fmt.Sprint(id)); err != nil {
					return err
				}
			}
			return f.writeBusinessRow(msg)
		})
	})
	ctx, cancel := context.WithTimeout(context.Background(), caseTimeout)
	defer cancel()
	msg := message.NewMessage(watermill.NewUUID(), nil)
	acked, err := in.send(ctx, delivery(msg, "first"))
	if err != nil {
		t.Fatal(err)
	}
	first := out.last("first")
	if acked || len(sink.poisoned()) != 0 || !inbox.IsTransient(first) {
		t.Fatalf("connection killed: acked %v, poisoned %d, error %v (IsTransient %v); want a nack, nothing poisoned, a transient error",
			acked, len(sink.poisoned()), first, inbox.IsTransient(first))
	}
	kill.Store(false)
	if acked, err := in.send(ctx, delivery(msg, "redelivery")); err != nil || !acked {
		t.Fatalf("redelivery: acked %v (%v), error %v", acked, err, out.last("redelivery"))
	}
	if f.businessRows() != 1 || f.inboxRows() != 1 {
		t.Errorf("business rows %d, inbox rows %d, want 1 and 1", f.businessRows(), f.inboxRows())
	}
}
