package inbox_test

import (
	"context"
	"errors"
	"path/filepath"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/go-sql-driver/mysql"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// On MariaDB, an outbox publisher of Outbox.PublisherOn that writes
// through the inbox's own transaction (Config.Outbox returning
// ob.PublisherOn(tx's Exec): an exec wrapped for tracing, as the
// documentation of PublisherOn's MySQL limits allows) writes nothing after
// a deadlock the handler ignored. The writer checks no claim in its
// INSERT (only Outbox.Publisher's do), the connection still reports a
// transaction open, and the INSERT ran in autocommit: the output was
// committed for a delivery that was nacked (ErrTxRolledBack), the relay
// sent it, and the redelivery wrote another under a new UUID.
func TestOutboxPublisherOnWritesNothingAfterADeadlockTheHandlerIgnored(t *testing.T) {
	db := testdb.OpenMySQL(t, "")
	broker := newBrokerStub()
	ob := newTestOutbox(t, db, inbox.MySQL, inbox.OutboxConfig{Publisher: broker, PollInterval: time.Hour})
	f := newFixture(t, db)
	ib := f.newInbox(inbox.Config{Dialect: inbox.MySQL, Outbox: publisherOnInboxTx(ob)})
	victim := deadlockVictim(t, inbox.MySQL, db)
	var ignored, publishErr error
	out := &outcomes{}
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(out.Middleware, ib.Middleware)
		r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
			if err := f.writeBusinessRow(msg); err != nil {
				return err
			}
			if msg.Metadata.Get("delivery") == "first" {
				tx, _ := inbox.TxFromContext(msg.Context())
				ignored = victim(msg, tx) // a sloppy handler: the error is ignored
			}
			pub, _ := inbox.OutboxFromContext(msg.Context())
			publishErr = pub.Publish("invoices", message.NewMessage(watermill.NewUUID(), []byte("invoice")))
			if msg.Metadata.Get("delivery") == "first" {
				return nil // and ignores this error too
			}
			return publishErr
		})
	})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	msg := message.NewMessage(watermill.NewUUID(), nil)
	if acked, err := in.send(ctx, delivery(msg, "first")); err != nil || acked {
		t.Fatalf("delivery after the ignored deadlock: acked %v (%v), want a nack", acked, err)
	}
	var myErr *mysql.MySQLError
	if !errors.As(ignored, &myErr) || myErr.Number != 1213 {
		t.Fatalf("the handler's statement failed with %v, want a deadlock", ignored)
	}
	if !errors.Is(out.last("first"), inbox.ErrTxRolledBack) {
		t.Errorf("delivery nacked with %v, want ErrTxRolledBack", out.last("first"))
	}
	if publishErr == nil {
		t.Errorf("Publish after the deadlock returned nil")
	}
	if n := count(t, db, ob.Table(), ""); n != 0 {
		t.Errorf("%d outbox rows written in autocommit for a delivery that was rolled back, want 0", n)
	}
	if acked, err := in.send(ctx, delivery(msg, "redelivery")); err != nil || !acked {
		t.Fatalf("redelivery: acked %v (%v), last error %v", acked, err, out.last("redelivery"))
	}
	relayUntilEmpty(t, ob)
	if got := broker.uuids("invoices"); len(got) != 1 {
		t.Errorf("sent %v for one processed message, want its one output", got)
	}
}

// On SQLite, the same writer (Outbox.PublisherOn through the inbox's own
// transaction) writes nothing after SQLite rolled the transaction back on
// its own (a trigger's RAISE(ROLLBACK) whose error the handler ignored):
// Outbox.Publisher's INSERT reads the claim in its statement, this one does
// not, and it ran in autocommit, committed and relayed for a delivery that
// was nacked (TestSQLiteOutboxWritesNothingAfterTheTransactionWasRolledBack
// holds for Outbox.Publisher).
func TestOutboxPublisherOnWritesNothingAfterSQLitesOwnRollback(t *testing.T) {
	db := testdb.OpenSQLite(t, filepath.Join(t.TempDir(), "inbox.db"))
	customers := "customers_" + randomSuffix()
	exec(t, db, "CREATE TABLE "+customers+" (k TEXT NOT NULL)")
	exec(t, db, "CREATE TRIGGER "+customers+"_once BEFORE INSERT ON "+customers+
		" WHEN EXISTS (SELECT 1 FROM "+customers+" WHERE k = NEW.k) BEGIN SELECT RAISE(ROLLBACK, 'duplicate customer'); END")
	exec(t, db, "INSERT INTO "+customers+" (k) VALUES ('customer-1')")
	ob := newTestOutbox(t, db, inbox.SQLite, inbox.OutboxConfig{Publisher: newBrokerStub(), PollInterval: time.Hour})
	f := newFixture(t, db)
	ib := f.newInbox(inbox.Config{Dialect: inbox.SQLite, Outbox: publisherOnInboxTx(ob)})
	var publishErr error
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(ib.Middleware)
		r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
			tx, _ := inbox.TxFromContext(msg.Context())
			_, _ = tx.ExecContext(msg.Context(), "INSERT INTO "+customers+" (k) VALUES ('customer-1')") // "already there": ignored
			pub, _ := inbox.OutboxFromContext(msg.Context())
			publishErr = pub.Publish("invoices", message.NewMessage(watermill.NewUUID(), []byte("invoice")))
			return nil // ignored too
		})
	})
	if in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
		t.Fatal("acked; want nacked: SQLite rolled the transaction back")
	}
	if publishErr == nil {
		t.Errorf("Publish after SQLite's rollback returned nil")
	}
	if n := count(t, db, ob.Table(), ""); n != 0 {
		t.Errorf("%d outbox rows written in autocommit for a delivery that was rolled back, want 0", n)
	}
}

// publisherOnInboxTx is an outbox factory (Config.Outbox) that returns
// ob.PublisherOn writing through the inbox's own transaction, as an
// application that wraps the exec (for tracing) would.
func publisherOnInboxTx(ob *inbox.Outbox) func(tx *sqlx.Tx) (message.Publisher, error) {
	return func(tx *sqlx.Tx) (message.Publisher, error) {
		return ob.PublisherOn(func(ctx context.Context, query string, args ...any) error {
			_, err := tx.ExecContext(ctx, query, args...)
			return err
		}), nil
	}
}
