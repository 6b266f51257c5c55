package inbox_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
)

// SQLite rolls the whole transaction back by itself on SQLITE_FULL (a full
// disk; here PRAGMA max_page_count) and on an interrupted statement. A
// handler that ignores the failure of a best-effort write and goes on is
// then where a MySQL handler that ignored a deadlock is: the database ended
// the transaction, and a redelivery (the disk freed) succeeds. The delivery
// fails with ErrTxRolledBack, transient, with or without outputs, and is
// not poisoned: without outputs it was ErrTransactionEnded (the COMMIT
// found no transaction), with them too for a while.
func TestSQLiteRollbackOfItsOwnIsTransient(t *testing.T) {
	for _, c := range []struct{ cause, output string }{
		{"full", "none"}, {"full", "returned"}, {"full", "published"},
		{"interrupted", "none"}, {"interrupted", "returned"}, {"interrupted", "published"},
	} {
		t.Run(c.cause+"/"+c.output, func(t *testing.T) {
			db := sqliteDB(t)
			exec(t, db, "CREATE TABLE audit (x TEXT)")
			broker := newBrokerStub()
			ob := newTestOutbox(t, db, inbox.SQLite, inbox.OutboxConfig{Publisher: broker, PollInterval: time.Hour})
			ib := newFixture(t, db).newInbox(inbox.Config{Outbox: ob.Publisher})
			poison, sink := poisonUnlessTransient(t)
			in, out := newFeed(), &outcomes{}
			var failing atomic.Bool
			failing.Store(true)
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(poison, out.Middleware, ib.Middleware)
				r.AddHandler("billing", "orders", in, "invoices", nil, func(msg *message.Message) ([]*message.Message, error) {
					tx, _ := inbox.TxFromContext(msg.Context())
					ctx := msg.Context()
					switch {
					case failing.Load() && c.cause == "interrupted":
						// A best-effort write under a short timeout of its own:
						// modernc.org/sqlite interrupts it, and SQLite rolls the
						// whole transaction back.
						qctx, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
						_, _ = tx.ExecContext(qctx, "INSERT INTO audit WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL"+
							" SELECT i+1 FROM n WHERE i < 100000000) SELECT i FROM n") // its error ignored
						cancel()
					case failing.Load():
						var pages int
						if err := tx.QueryRowContext(ctx, "PRAGMA page_count").Scan(&pages); err != nil {
							return nil, err
						}
						if _, err := tx.ExecContext(ctx, "PRAGMA max_page_count = "+strconv.Itoa(pages+1)); err != nil {
							return nil, err
						}
						_, _ = tx.ExecContext(ctx, "INSERT INTO audit VALUES (?)", strings.Repeat("z", 1<<20)) // SQLITE_FULL, ignored
						if _, err := tx.ExecContext(ctx, "PRAGMA max_page_count = 1073741823"); err != nil {
							return nil, err
						}
					}
					invoice := message.NewMessage(msg.UUID+"-invoice", []byte("invoice"))
					switch c.output {
					case "returned":
						return []*message.Message{invoice}, nil
					case "published":
						pub, _ := inbox.OutboxFromContext(ctx)
						return nil, pub.Publish("invoices", invoice)
					}
					return nil, nil
				})
			})
			msg := message.NewMessage(watermill.NewUUID(), []byte("order"))
			if in.deliver(t, delivery(msg, "1")) {
				t.Fatalf("the first delivery was acked (router got %v); its transaction was rolled back", out.last("1"))
			}
			if err := out.last("1"); !errors.Is(err, inbox.ErrTxRolledBack) || !inbox.IsTransient(err) || len(sink.poisoned()) != 0 {
				t.Fatalf("first delivery: %v (transient %v), %d poisoned; want ErrTxRolledBack, transient, not poisoned",
					err, inbox.IsTransient(err), len(sink.poisoned()))
			}
			failing.Store(false)
			if !in.deliver(t, delivery(msg, "2")) {
				t.Fatalf("the redelivery: %v; want it processed", out.last("2"))
			}
			relayUntilEmpty(t, ob)
			if want := map[string]int{"none": 0, "returned": 1, "published": 1}[c.output]; len(broker.uuids("invoices")) != want {
				t.Errorf("relayed %v, want %d", broker.uuids("invoices"), want)
			}
		})
	}
}

// When the claim cannot be read after a COMMIT that found no transaction
// (here: the handler rolled back and renamed the inbox table), the
// delivery fails with ErrTxRolledBack, transient: nothing is lost either
// way, where ErrTransactionEnded poisoned a message a retry would process.
func TestSQLiteCommitThatFindsNoTransactionAndCannotReadTheClaimIsTransient(t *testing.T) {
	db := sqliteDB(t)
	f := newFixture(t, db)
	ib := f.newInbox(inbox.Config{})
	in, out := newFeed(), &outcomes{}
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(out.Middleware, ib.Middleware)
		r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
			tx, _ := inbox.TxFromContext(msg.Context())
			if _, err := tx.ExecContext(msg.Context(), "ROLLBACK"); err != nil {
				return err
			}
			_, err := tx.ExecContext(msg.Context(), "ALTER TABLE "+f.inbox+" RENAME TO "+f.inbox+"_away")
			dropLater(t, db, f.inbox+"_away")
			return err
		})
	})
	if in.deliver(t, delivery(message.NewMessage(watermill.NewUUID(), []byte("order")), "1")) {
		t.Fatal("acked")
	}
	if err := out.last("1"); !errors.Is(err, inbox.ErrTxRolledBack) || !inbox.IsTransient(err) {
		t.Errorf("router got %v (transient %v); want ErrTxRolledBack, transient", err, inbox.IsTransient(err))
	}
}
