package inbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// An outbox table not yet created (a migration not run, while the relay
// runs in another process or with ob.Run, so that no RouterPlugin refused
// to start) is a misconfiguration, not the message's fault, on every
// database: the delivery fails with a transient error wrapping
// ErrTableNotFound, a poison queue does not take it, nothing is acked,
// and the relay's round says ErrTableNotFound too. On MariaDB and SQLite
// the driver's "doesn't exist" / "no such table" went out as it was, not
// transient, and every message went to the poison queue.
//
// Also on a pool of one connection, which the message's transaction (or the
// relay's round) holds: telling the missing table runs in that transaction,
// where a read on another connection of the pool stalled (PublisherOn: a
// second, then the driver's error, and a poisoned message) or hung the
// relay's round for good on MySQL/MariaDB.
func TestMissingOutboxTableIsTransientOnEveryDatabase(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		for _, how := range []string{"returned", "OutboxFromContext", "PublisherOn", "PublisherOn/pool of one", "returned/pool of one"} {
			t.Run(how, func(t *testing.T) {
				if strings.HasSuffix(how, "/pool of one") {
					if isPostgres(tdb.Dialect) {
						// PublisherOn looks the schema up on a connection
						// of its own until the table is found (Outbox.PublisherOn).
						t.Skip("MySQL/MariaDB and SQLite, which tell the missing table after the INSERT")
					}
					db = tdb.Open(t)
					db.SetMaxOpenConns(1)
					how = strings.TrimSuffix(how, "/pool of one")
				}
				ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Dialect: tdb.Dialect, Table: "outbox_missing_" + randomSuffix(), Publisher: newBrokerStub()})
				if err != nil {
					t.Fatal(err)
				}
				f := newFixture(t, db)
				ib := f.newInbox(inbox.Config{Outbox: ob.Publisher})
				poison := newBrokerStub()
				mws, err := ib.Middlewares(inbox.MiddlewaresConfig{PoisonQueue: poison, Retry: middleware.Retry{MaxRetries: -1}})
				if err != nil {
					t.Fatal(err)
				}
				rec := &recorder{}
				in := newFeed()
				runRouter(t, func(r *message.Router) {
					r.AddMiddleware(rec.Middleware)
					r.AddMiddleware(mws...)
					r.AddHandler("billing", "orders", in, "invoices", nil, func(msg *message.Message) ([]*message.Message, error) {
						out := message.NewMessage(watermill.NewUUID(), []byte("invoice"))
						switch how {
						case "returned":
							return []*message.Message{out}, nil
						case "PublisherOn":
							tx, _ := inbox.TxFromContext(msg.Context())
							pub := ob.PublisherOn(func(ctx context.Context, q string, args ...any) error {
								_, err := tx.ExecContext(ctx, q, args...)
								return err
							})
							return nil, pub.Publish("invoices", out)
						}
						pub, ok := inbox.OutboxFromContext(msg.Context())
						if !ok {
							return nil, errors.New("no outbox in the message's context")
						}
						return nil, pub.Publish("invoices", out)
					})
				})
				if in.deliver(t, message.NewMessage(watermill.NewUUID(), []byte("order"))) {
					t.Fatal("acked although the outbox table is missing")
				}
				if err := rec.last(); !errors.Is(err, inbox.ErrTableNotFound) || !inbox.IsTransient(err) {
					t.Errorf("router got %v (transient %v), want ErrTableNotFound, transient", err, inbox.IsTransient(err))
				}
				if n := len(poison.uuids("poison")); n != 0 {
					t.Errorf("%d messages went to the poison queue for a missing outbox table", n)
				}
				if b, i := f.businessRows(), f.inboxRows(); b != 0 || i != 0 {
					t.Errorf("%d business rows, %d inbox rows; want none", b, i)
				}
				rounds := make(chan inbox.OutboxRound, 1)
				go func() { rounds <- ob.RelayOnce(context.Background()) }()
				select {
				case r := <-rounds:
					if !errors.Is(r.Err, inbox.ErrTableNotFound) {
						t.Errorf("relay round on the missing table: %v, want ErrTableNotFound", r.Err)
					}
				case <-time.After(30 * time.Second):
					t.Fatal("the relay's round on the missing table has not returned in 30 s")
				}
			})
		}
	})
}

// A trigger on the outbox table that writes to a table that is missing
// fails the outbox INSERT with the same code as a missing outbox table
// (42P01, 1146): the error is the driver's, not ErrTableNotFound about the
// outbox table, whose InitializeSchema would fix nothing.
func TestOutboxTriggerOnAMissingTableIsNotAMissingOutboxTable(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if tdb.Name != "postgres" && tdb.Name != "mysql" && tdb.Name != "sqlite" {
			t.Skip("one of each database")
		}
		sfx := randomSuffix()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: newBrokerStub(), PollInterval: time.Hour})
		missing := "audit_missing_" + sfx
		switch tdb.Name {
		case "postgres":
			fn := "audit_fn_" + sfx
			exec(t, db, "CREATE FUNCTION "+fn+"() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN INSERT INTO "+missing+" VALUES (NEW.id); RETURN NEW; END $$")
			t.Cleanup(func() { _, _ = db.Exec("DROP FUNCTION IF EXISTS " + fn + "() CASCADE") })
			exec(t, db, "CREATE TRIGGER audit_"+sfx+" AFTER INSERT ON "+ob.Table()+" FOR EACH ROW EXECUTE FUNCTION "+fn+"()")
		case "mysql":
			exec(t, db, "CREATE TRIGGER audit_"+sfx+" AFTER INSERT ON "+ob.Table()+" FOR EACH ROW INSERT INTO "+missing+" VALUES (NEW.id)")
		default:
			exec(t, db, "CREATE TRIGGER audit_"+sfx+" AFTER INSERT ON "+ob.Table()+" BEGIN INSERT INTO "+missing+" VALUES (NEW.id); END")
		}
		ib := newFixture(t, db).newInbox(inbox.Config{Outbox: ob.Publisher})
		rec := &recorder{}
		in := newFeed()
		runRouter(t, func(r *message.Router) {
			r.AddMiddleware(rec.Middleware, ib.Middleware)
			r.AddHandler("billing", "orders", in, "invoices", nil, func(msg *message.Message) ([]*message.Message, error) {
				return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("invoice"))}, nil
			})
		})
		if in.deliver(t, message.NewMessage(watermill.NewUUID(), []byte("order"))) {
			t.Fatal("acked although the outbox insert failed")
		}
		if err := rec.last(); errors.Is(err, inbox.ErrTableNotFound) {
			t.Errorf("the outbox table exists (its trigger's table is missing), and the error says it does not: %v", err)
		}
	})
}

// A publish on a transaction that has already ended (committed or rolled
// back) fails as it did, not as a missing outbox table: on SQLite the
// check that tells a missing table read any failure of its own probe as
// one, and a handler that committed the inbox transaction itself and then
// published got a transient ErrTableNotFound, retried for ever.
func TestPublishOnAnEndedTransactionIsNotAMissingOutboxTable(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: newBrokerStub(), PollInterval: time.Hour})
		t.Run("Publisher after Commit", func(t *testing.T) {
			tx, err := db.BeginTxx(context.Background(), nil)
			if err != nil {
				t.Fatal(err)
			}
			pub, err := ob.Publisher(tx)
			if err != nil {
				t.Fatal(err)
			}
			if err := tx.Commit(); err != nil {
				t.Fatal(err)
			}
			if err := pub.Publish("invoices", message.NewMessage(watermill.NewUUID(), []byte("x"))); err == nil || errors.Is(err, inbox.ErrTableNotFound) {
				t.Errorf("publish after the transaction's commit: %v, want an error that is not ErrTableNotFound", err)
			}
		})
		t.Run("PublisherOn after Rollback", func(t *testing.T) {
			tx, err := db.BeginTxx(context.Background(), nil)
			if err != nil {
				t.Fatal(err)
			}
			pub := ob.PublisherOn(func(ctx context.Context, q string, args ...any) error {
				_, err := tx.ExecContext(ctx, q, args...)
				return err
			})
			if err := tx.Rollback(); err != nil {
				t.Fatal(err)
			}
			if err := pub.Publish("invoices", message.NewMessage(watermill.NewUUID(), []byte("x"))); err == nil || errors.Is(err, inbox.ErrTableNotFound) {
				t.Errorf("publish after the transaction's rollback: %v, want an error that is not ErrTableNotFound", err)
			}
		})
		if count(t, db, ob.Table(), "") != 0 {
			t.Error("a publish on an ended transaction wrote to the outbox")
		}
	})
}
