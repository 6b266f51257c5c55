package inbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/watermill-inbox/inbox"
)

// On SQLite this process's write transactions (the inbox's, the relay's)
// queue for the database's write lock instead of polling for it, and every
// way a delivery ends gives its place to the next: processed with an
// output, duplicate, handler error, handler panic, handler that ended the
// transaction itself, and the relay's rounds. A place left held would make
// every later transaction wait the queue's bound before it begins.
func TestSQLiteWriteTransactionsLeaveTheirPlaceHoweverTheyEnd(t *testing.T) {
	t.Parallel()
	db := sqliteDB(t)
	f := newFixture(t, db)
	broker := newBrokerStub()
	ob := newTestOutbox(t, db, inbox.SQLite, inbox.OutboxConfig{Publisher: broker})
	ib := f.newInbox(inbox.Config{Outbox: ob.Publisher})
	in := newFeed()
	var handled calls
	runRouter(t, func(r *message.Router) {
		// No relay runs beside the deliveries (a round of it may hold the
		// queue when one is checked); relay rounds run below, after them.
		r.AddMiddleware(middleware.Recoverer, ib.Middleware)
		r.AddHandler("billing", "orders", in, "invoices", broker, func(msg *message.Message) ([]*message.Message, error) {
			handled.inc(msg.UUID)
			if err := f.writeBusinessRow(msg); err != nil {
				return nil, err
			}
			switch msg.Metadata.Get("do") {
			case "fail":
				return nil, errors.New("payment service unavailable")
			case "panic":
				panic("handler bug")
			case "end":
				tx, _ := inbox.TxFromContext(msg.Context())
				if err := tx.Rollback(); err != nil {
					return nil, err
				}
			}
			return []*message.Message{message.NewMessage(msg.UUID+"-invoice", []byte("invoice"))}, nil
		})
	})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	processed := message.NewMessage(watermill.NewUUID(), nil)
	for _, c := range []struct {
		do    string
		msg   *message.Message
		acked bool
	}{
		{"", processed, true},
		{"", delivery(processed, "again"), true}, // duplicate
		{"fail", nil, false},
		{"panic", nil, false},
		{"end", nil, false},
		{"", processed.Copy(), true}, // duplicate once more, after the failures
	} {
		msg := c.msg
		if msg == nil {
			msg = message.NewMessage(watermill.NewUUID(), nil)
			msg.Metadata.Set("do", c.do)
		}
		if acked, err := in.send(ctx, msg.Copy()); err != nil || acked != c.acked {
			t.Fatalf("delivery %q: acked %v (%v), want %v", c.do, acked, err, c.acked)
		}
		if n := inbox.SQLiteWritersQueued(db.DB); n != 0 {
			t.Fatalf("after a delivery that did %q: %d write transactions hold or wait for the write lock, want 0", c.do, n)
		}
	}
	relayUntilNothingPending(t, ob)
	if got := broker.uuids("invoices"); len(got) != 1 || got[0] != processed.UUID+"-invoice" {
		t.Errorf("invoices sent: %v, want [%s-invoice]", got, processed.UUID)
	}
	if n := f.businessRows(); n != 1 {
		t.Errorf("business rows: %d, want 1 (the failed, panicked and ended deliveries rolled back)", n)
	}
	if n := handled.get(processed.UUID); n != 1 {
		t.Errorf("handler calls for the processed message: %d, want 1", n)
	}
	if n := inbox.SQLiteWritersQueued(db.DB); n != 0 {
		t.Errorf("after the relay's rounds: %d write transactions hold or wait for the write lock, want 0", n)
	}
}
