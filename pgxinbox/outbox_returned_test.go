package pgxinbox_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// The messages a handler returns are the transaction's last writes: the
// inbox sends their INSERT with the COMMIT, in one batch. These tests hold
// that batch to what two round trips did: the outputs commit with
// everything else or not at all, in every pgx query mode.

// returnedFixture is an inbox whose handler h returns its outputs, written
// through an outbox relay (pgxinbox.OutboxPublisher) to broker.
type returnedFixture struct {
	*fixture
	ob     *inbox.Outbox
	table  string
	broker *countingBroker
	in     *feed
	rec    *recorder
}

func newReturnedFixture(t *testing.T, pool *pgxpool.Pool, h func(f *returnedFixture, msg *message.Message) ([]*message.Message, error)) *returnedFixture {
	t.Helper()
	return newReturnedFixtureWith(t, pool, pgxinbox.Config{}, h)
}

// newReturnedFixtureWith is newReturnedFixture with the inbox's cfg.
func newReturnedFixtureWith(t *testing.T, pool *pgxpool.Pool, cfg pgxinbox.Config, h func(f *returnedFixture, msg *message.Message) ([]*message.Message, error)) *returnedFixture {
	t.Helper()
	f := &returnedFixture{fixture: newFixture(t, pool), broker: &countingBroker{}, rec: &recorder{}, in: newFeed()}
	db := pgxinbox.DB(pool)
	t.Cleanup(func() { db.Close() })
	f.table = "pgx_outbox_" + testdb.RandomSuffix()
	f.dropLater(f.table, f.table+"_dead")
	var err error
	f.ob, err = inbox.NewOutbox(inbox.OutboxConfig{DB: db, Table: f.table, Publisher: f.broker, PollInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if err := f.ob.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	cfg.Outbox = pgxinbox.OutboxPublisher(f.ob)
	ib := f.newInbox(cfg)
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(f.rec.Middleware, ib.Middleware)
		r.AddHandler("billing", "orders", f.in, "invoices", refusingPublisher{}, func(msg *message.Message) ([]*message.Message, error) {
			return h(f, msg)
		})
	})
	return f
}

// allModes are pgx's query exec modes.
var allModes = []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe,
	pgx.QueryExecModeDescribeExec, pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol}

func (f *returnedFixture) outboxRows() int { return f.count(f.table) }

// relayed relays what the outbox holds and returns the UUIDs sent.
func (f *returnedFixture) relayed(t *testing.T) []string {
	t.Helper()
	for {
		r := f.ob.RelayOnce(context.Background())
		if r.Err != nil {
			t.Fatal(r.Err)
		}
		if r.Relayed == 0 {
			break
		}
	}
	var uuids []string
	for _, m := range f.broker.sent() {
		uuids = append(uuids, m.UUID)
	}
	return uuids
}

// outputs returns n outputs of msg, numbered.
func outputs(msg *message.Message, n int) []*message.Message {
	var out []*message.Message
	for i := range n {
		out = append(out, message.NewMessage(msg.UUID+"-invoice-"+string(rune('a'+i)), []byte{byte(i), 255}))
	}
	return out
}

// refusingPublisher is the router's publisher of a handler whose returned
// messages go to the outbox: a message that reaches it fails the delivery.
type refusingPublisher struct{}

func (refusingPublisher) Publish(string, ...*message.Message) error {
	return errors.New("the router's publisher got a message meant for the outbox")
}
func (refusingPublisher) Close() error { return nil }

// In every query mode, a processed message whose handler returns two
// outputs costs three round trips: BEGIN with the claim, the handler's
// statement, and the outputs' INSERT with COMMIT. Both outputs leave, in
// order, with their payloads.
func TestOutbox_ReturnedMessagesGoOutWithTheCommit(t *testing.T) {
	t.Parallel()
	for _, mode := range allModes {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			tracer := &sqlTracer{}
			pool := openPool(t, "", "pgx_outbox_returned", func(c *pgxpool.Config) {
				c.ConnConfig.Tracer = tracer
				c.ConnConfig.DefaultQueryExecMode = mode
			})
			f := newReturnedFixture(t, pool, func(f *returnedFixture, msg *message.Message) ([]*message.Message, error) {
				if err := f.writeEffect(msg); err != nil {
					return nil, err
				}
				return outputs(msg, 2), nil
			})
			msg := message.NewMessage(watermill.NewUUID(), nil)
			tracer.take()
			if !f.in.deliver(t, msg) {
				t.Fatalf("nacked: %v", f.rec.last())
			}
			sent := tracer.take()
			if len(sent) != 3 || !strings.HasPrefix(strings.ToLower(sent[0]), "batch: begin") ||
				!strings.HasPrefix(sent[2], `batch: INSERT INTO "public"."`+f.table+`"`) || !strings.HasSuffix(sent[2], "; commit") {
				t.Errorf("sent %q, want the claim's batch, the handler's statement, and the outputs' INSERT with COMMIT", sent)
			}
			f.expectRows(1, 1)
			want := []string{msg.UUID + "-invoice-a", msg.UUID + "-invoice-b"}
			if got := f.relayed(t); !slices.Equal(got, want) {
				t.Errorf("relayed %v, want %v", got, want)
			}
			for i, m := range f.broker.sent() {
				if string(m.Payload) != string([]byte{byte(i), 255}) {
					t.Errorf("output %d: payload %v", i, []byte(m.Payload))
				}
			}
			expectNoConnHeld(t, pool)
		})
	}
}

// The batch's INSERT fails when the handler left the transaction failed (it
// ignored an error of its own): PostgreSQL skips the COMMIT sent with it,
// the message is nacked and nothing of it stays. The redelivery writes its
// outputs once.
func TestOutbox_ReturnedMessagesOfAFailedTransactionAreNotWritten(t *testing.T) {
	t.Parallel()
	pool := openPool(t, "", "pgx_outbox_returned_failed", nil)
	f := newReturnedFixture(t, pool, func(f *returnedFixture, msg *message.Message) ([]*message.Message, error) {
		if err := f.writeEffect(msg); err != nil {
			return nil, err
		}
		if msg.Metadata.Get("delivery") == "first" {
			tx, _ := pgxinbox.TxFromContext(msg.Context())
			_, _ = tx.Exec(msg.Context(), "SELECT 1/0") // a sloppy handler ignores this error
		}
		return outputs(msg, 1), nil
	})
	msg := message.NewMessage(watermill.NewUUID(), nil)
	if f.in.deliver(t, labelled(msg, "first")) {
		t.Fatal("acked a message whose transaction had failed")
	}
	var pgErr *pgconn.PgError
	if err := f.rec.last(); !errors.As(err, &pgErr) || pgErr.Code != "25P02" || !strings.Contains(err.Error(), "outbox publish") {
		t.Errorf("router got %v, want the outbox INSERT's 25P02 (in failed sql transaction)", err)
	}
	f.expectRows(0, 0)
	if n := f.outboxRows(); n != 0 {
		t.Fatalf("%d outbox rows, want 0", n)
	}
	if !f.in.deliver(t, labelled(msg, "redelivery")) {
		t.Fatalf("redelivery nacked: %v", f.rec.last())
	}
	f.expectRows(1, 1)
	if got := f.relayed(t); !slices.Equal(got, []string{msg.UUID + "-invoice-a"}) {
		t.Errorf("relayed %v, want the one output", got)
	}
	expectNoConnHeld(t, pool)
}

// A handler that commits the transaction itself and then returns outputs
// is nacked: nothing can write them in the transaction any more, and
// nothing is written outside it.
func TestOutbox_ReturnedMessagesAfterTheHandlersCommitAreRefused(t *testing.T) {
	t.Parallel()
	pool := openPool(t, "", "pgx_outbox_returned_after_commit", nil)
	f := newReturnedFixture(t, pool, func(f *returnedFixture, msg *message.Message) ([]*message.Message, error) {
		if err := f.writeEffect(msg); err != nil {
			return nil, err
		}
		tx, _ := pgxinbox.TxFromContext(msg.Context())
		if err := tx.Commit(msg.Context()); err != nil {
			return nil, err
		}
		return outputs(msg, 1), nil
	})
	if f.in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
		t.Fatal("acked a message whose handler committed the transaction itself")
	}
	if err := f.rec.last(); !errors.Is(err, inbox.ErrTxRolledBack) && !errors.Is(err, inbox.ErrTransactionEnded) {
		t.Errorf("router got %v, want ErrTxRolledBack or ErrTransactionEnded", err)
	}
	if n := f.outboxRows(); n != 0 {
		t.Errorf("%d outbox rows written after the handler's own COMMIT, want 0", n)
	}
	expectNoConnHeld(t, pool)
}
