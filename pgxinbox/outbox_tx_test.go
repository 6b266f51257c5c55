package pgxinbox_test

import (
	"context"
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
