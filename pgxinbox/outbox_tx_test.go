package pgxinbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// The outbox writes of pgxinbox belong to the handler's transaction as it
// is when the handler publishes: inside a savepoint, rolled back with it;
// committed by the handler's own Commit with what it committed; refused
// once the inbox committed. (Keeping the writes for the COMMIT's batch
// broke all three: these tests guard against that.)

// outboxTxFixture is an inbox whose outputs go through an outbox relay
// (pgxinbox.OutboxPublisher), with the handler h.
type outboxTxFixture struct {
	*fixture
	table string
	in    *feed
	rec   *recorder
}

func newOutboxTxFixture(t *testing.T, pool *pgxpool.Pool, h func(f *outboxTxFixture, msg *message.Message) error) *outboxTxFixture {
	t.Helper()
	f := &outboxTxFixture{fixture: newFixture(t, pool), rec: &recorder{}}
	db := pgxinbox.DB(pool)
	t.Cleanup(func() { db.Close() })
	f.table = "pgx_outbox_" + testdb.RandomSuffix()
	f.dropLater(f.table, f.table+"_dead")
	ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Table: f.table, Publisher: &countingBroker{}, PollInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	ib := f.newInbox(pgxinbox.Config{Outbox: pgxinbox.OutboxPublisher(ob)})
	f.in = consume(t, ib, func(msg *message.Message) error { return h(f, msg) }, f.rec.Middleware)
	return f
}

func (f *outboxTxFixture) outboxRows() int { return f.count(f.table) }

// publish publishes one output of msg through the message's outbox.
func publish(msg *message.Message, suffix string) error {
	pub, ok := inbox.OutboxFromContext(msg.Context())
	if !ok {
		return errors.New("no outbox publisher in the message context")
	}
	return pub.Publish("invoices", message.NewMessage(msg.UUID+suffix, nil))
}

// An output published inside a savepoint the handler rolls back is undone
// with the savepoint's other writes; the message is processed.
func TestOutbox_OutputInARolledBackSavepointDoesNotLeave(t *testing.T) {
	t.Parallel()
	pool := openPool(t, "", "pgx_outbox_savepoint", nil)
	f := newOutboxTxFixture(t, pool, func(f *outboxTxFixture, msg *message.Message) error {
		ctx := msg.Context()
		tx, _ := pgxinbox.TxFromContext(ctx)
		sp, err := tx.Begin(ctx)
		if err != nil {
			return err
		}
		if _, err := sp.Exec(ctx, "INSERT INTO "+f.effect+" (message_id) VALUES ($1)", msg.UUID); err != nil {
			return err
		}
		if err := publish(msg, "-in-savepoint"); err != nil {
			return err
		}
		return sp.Rollback(ctx)
	})
	if !f.in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
		t.Fatalf("nacked: %v", f.rec.last())
	}
	f.expectRows(0, 1)
	if n := f.outboxRows(); n != 0 {
		t.Errorf("%d outbox rows published in the rolled-back savepoint, want 0", n)
	}
}

// A handler that publishes and then commits the transaction itself is
// nacked (ErrTransactionEnded), and what it committed stays together: its
// business row, the claim and its output, which the redelivery (a
// duplicate) could not produce again.
func TestOutbox_HandlerCommitKeepsItsOutputsWithItsWrites(t *testing.T) {
	t.Parallel()
	pool := openPool(t, "", "pgx_outbox_handler_commit", nil)
	f := newOutboxTxFixture(t, pool, func(f *outboxTxFixture, msg *message.Message) error {
		if err := f.writeEffect(msg); err != nil {
			return err
		}
		if err := publish(msg, "-out"); err != nil {
			return err
		}
		tx, _ := pgxinbox.TxFromContext(msg.Context())
		return tx.Commit(msg.Context())
	})
	msg := message.NewMessage(watermill.NewUUID(), nil)
	if f.in.deliver(t, msg) {
		t.Fatal("acked a message whose handler committed the transaction itself")
	}
	if err := f.rec.last(); !errors.Is(err, inbox.ErrTransactionEnded) {
		t.Errorf("router got %v, want ErrTransactionEnded", err)
	}
	f.expectRows(1, 1)
	if n := f.outboxRows(); n != 1 {
		t.Errorf("%d outbox rows, want 1: the output commits with the handler's writes", n)
	}
}

// The handler's outbox publisher, kept past the message, refuses to write
// once the inbox committed: an error, never a nil that wrote nothing.
func TestOutbox_PublishAfterTheCommitIsRefused(t *testing.T) {
	t.Parallel()
	pool := openPool(t, "", "pgx_outbox_late_publish", nil)
	kept := make(chan message.Publisher, 1)
	f := newOutboxTxFixture(t, pool, func(f *outboxTxFixture, msg *message.Message) error {
		if err := publish(msg, "-1"); err != nil {
			return err
		}
		pub, _ := inbox.OutboxFromContext(msg.Context())
		kept <- pub
		return nil
	})
	if !f.in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
		t.Fatalf("nacked: %v", f.rec.last())
	}
	if err := (<-kept).Publish("invoices", message.NewMessage(watermill.NewUUID(), nil)); err == nil {
		t.Errorf("a Publish after the commit returned nil; outbox rows: %d", f.outboxRows())
	}
	if n := f.outboxRows(); n != 1 {
		t.Errorf("%d outbox rows, want the committed one", n)
	}
}

// Several goroutines of one handler publish through OutboxFromContext at
// once, on a pgx transaction (not safe for concurrent use): each output is
// written once and the message is processed. They raced on the connection
// (pgx's statement cache under -race) and the delivery failed with "conn
// busy", in every query mode.
func TestOutbox_PublishesFromSeveralGoroutinesOfOneHandler(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			pool := openPool(t, "", "pgx_outbox_goroutines", func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = mode })
			f := newOutboxTxFixture(t, pool, func(f *outboxTxFixture, msg *message.Message) error {
				var wg sync.WaitGroup
				errs := make(chan error, 80)
				for g := range 8 {
					wg.Go(func() {
						for i := range 10 {
							if err := publish(msg, fmt.Sprintf("-%d-%d", g, i)); err != nil {
								errs <- err
							}
						}
					})
				}
				wg.Wait()
				close(errs)
				return <-errs // nil once closed and empty
			})
			if !f.in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
				t.Fatalf("nacked: %v", f.rec.last())
			}
			if n := f.outboxRows(); n != 80 {
				t.Errorf("%d outbox rows, want the 80 outputs", n)
			}
		})
	}
}

// The handler's outbox publisher, kept past the handler (an AfterCommit
// callback, a goroutine that outlives the handler), refuses to write once
// the inbox committed, also when the handler returned messages: their
// INSERT goes with the COMMIT in one batch (CommitWith), which leaves pgx's
// Tx open as far as pgx knows (its "commit" is a queued statement, not
// Tx.Commit), the connection is back in the pool, and pgxTx.Ended reports
// "not ended" once its connection is released. A late Publish must fail
// and write nothing (docs/outbox.md: "if it comes after, is refused with an
// error (nothing written)"); it ran on the released pool connection, in
// autocommit (or inside whatever transaction its next user runs), and the
// relay sent it. Without returned messages (pgx's Tx.Commit) it is refused:
// TestOutbox_PublishAfterTheCommitIsRefused.
func TestOutbox_PublishAfterACommitThatCarriedReturnedMessagesIsRefused(t *testing.T) {
	t.Parallel()
	for _, mode := range allModes {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			pool := openPool(t, "", "late_publish", func(c *pgxpool.Config) {
				c.ConnConfig.DefaultQueryExecMode = mode
				c.MaxConns = 1 // the released connection is the one the next user gets
			})
			lateErr := make(chan error, 1)
			f := newReturnedFixture(t, pool, func(f *returnedFixture, msg *message.Message) ([]*message.Message, error) {
				if err := f.writeEffect(msg); err != nil {
					return nil, err
				}
				pub, _ := inbox.OutboxFromContext(msg.Context())
				// After the commit: the publisher kept by a callback (or a
				// goroutine that outlives the handler) publishes late.
				inbox.AfterCommit(msg.Context(), func() {
					lateErr <- pub.Publish("invoices", message.NewMessage("late-"+msg.UUID, nil))
				})
				return outputs(msg, 1), nil
			})
			if !f.in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
				t.Fatalf("nacked: %v", f.rec.last())
			}
			err := <-lateErr
			n := f.outboxRows()
			if !errors.Is(err, sql.ErrTxDone) {
				t.Errorf("a Publish after the commit returned %v, want an error wrapping sql.ErrTxDone (nothing written); outbox rows: %d", err, n)
			}
			if n != 1 {
				t.Errorf("%d outbox rows, want the 1 committed with the message: the late one was written outside its transaction", n)
			}
			expectNoConnHeld(t, pool)
		})
	}
}

// A publish from a goroutine of the handler that is still writing when the
// handler returns is waited for: the inbox's COMMIT goes after it, and the
// output commits with the message. A pgx connection serves one statement at
// a time: the COMMIT sent beside the goroutine's INSERT failed ("conn
// busy"), and the message was nacked with its output written and lost.
func TestOutbox_PublishInProgressWhenTheHandlerReturnsCommitsWithTheMessage(t *testing.T) {
	t.Parallel()
	pool := openPool(t, "", "publish_in_progress", nil)
	published := make(chan error, 1)
	f := newReturnedFixture(t, pool, func(f *returnedFixture, msg *message.Message) ([]*message.Message, error) {
		if err := f.writeEffect(msg); err != nil {
			return nil, err
		}
		pub, _ := inbox.OutboxFromContext(msg.Context())
		go func() { published <- pub.Publish("invoices", message.NewMessage("late-"+msg.UUID, nil)) }()
		time.Sleep(100 * time.Millisecond) // the INSERT is on its way, and takes 500 ms
		return nil, nil
	})
	slow := "slow_insert_" + testdb.RandomSuffix()
	f.exec("CREATE FUNCTION " + slow + "() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN PERFORM pg_sleep(0.5); RETURN NEW; END$$")
	t.Cleanup(func() {
		if _, err := pool.Exec(context.Background(), "DROP FUNCTION IF EXISTS "+slow+"() CASCADE"); err != nil {
			t.Error(err)
		}
	})
	f.exec("CREATE TRIGGER " + slow + " BEFORE INSERT ON " + f.table + " FOR EACH ROW EXECUTE FUNCTION " + slow + "()")
	if !f.in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
		t.Fatalf("nacked: %v", f.rec.last())
	}
	if err := <-published; err != nil {
		t.Errorf("the goroutine's Publish returned %v, want nil: it was in progress when the handler returned", err)
	}
	if n, e := f.outboxRows(), f.effects(); n != 1 || e != 1 {
		t.Errorf("%d outbox rows and %d effects, want the output committed with the message's effect", n, e)
	}
	expectNoConnHeld(t, pool)
}
