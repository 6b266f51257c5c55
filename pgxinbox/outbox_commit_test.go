package pgxinbox_test

import (
	"context"
	"errors"
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

// outboxFixture is an inbox whose outputs go through an outbox relay
// (pgxinbox.OutboxPublisher) to broker, and a handler that writes its
// business row, publishes one message through inbox.OutboxFromContext and
// returns another.
type outboxFixture struct {
	*fixture
	ob     *inbox.Outbox
	table  string
	broker *countingBroker
	in     *feed
	rec    *recorder
	// kept is the handler's pgx.Tx of the last message, kept past the
	// handler's return.
	kept chan pgx.Tx
}

func newOutboxFixture(t *testing.T, pool *pgxpool.Pool) *outboxFixture {
	t.Helper()
	f := &outboxFixture{fixture: newFixture(t, pool), broker: &countingBroker{}, rec: &recorder{}, kept: make(chan pgx.Tx, 8)}
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
	ib := f.newInbox(pgxinbox.Config{Outbox: pgxinbox.OutboxPublisher(f.ob)})
	f.in = newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(f.rec.Middleware, ib.Middleware)
		r.AddHandler("billing", "orders", f.in, "invoices", f.broker, func(msg *message.Message) ([]*message.Message, error) {
			if err := f.writeEffect(msg); err != nil {
				return nil, err
			}
			pub, ok := inbox.OutboxFromContext(msg.Context())
			if !ok {
				return nil, errors.New("no outbox publisher in the message context")
			}
			if err := pub.Publish("invoices", message.NewMessage(msg.UUID+"-published", nil)); err != nil {
				return nil, err
			}
			tx, _ := pgxinbox.TxFromContext(msg.Context())
			f.kept <- tx
			return []*message.Message{message.NewMessage(msg.UUID+"-returned", nil)}, nil
		})
	})
	return f
}

// relayed runs one relay round and returns the UUIDs the broker has got.
func (f *outboxFixture) relayed(t *testing.T) []string {
	t.Helper()
	if r := f.ob.RelayOnce(context.Background()); r.Err != nil {
		t.Fatal(r.Err)
	}
	var ids []string
	for _, m := range f.broker.sent() {
		ids = append(ids, m.UUID)
	}
	return ids
}

// The outbox INSERTs of a message's outputs (published in the handler and
// returned by it) go to the server in one batch with its COMMIT: a
// processed message with outputs costs the claim's batch, the handler's
// statements and that batch, no round trip more than one without outputs.
func TestOutbox_WritesGoWithTheCommit(t *testing.T) {
	t.Parallel()
	tracer := &sqlTracer{}
	pool := openPool(t, "", "pgx_outbox_commit", func(c *pgxpool.Config) { c.ConnConfig.Tracer = tracer })
	f := newOutboxFixture(t, pool)
	if !f.in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) { // the first checks the tables
		t.Fatalf("first message nacked: %v", f.rec.last())
	}
	tracer.take()
	msg := message.NewMessage(watermill.NewUUID(), nil)
	if !f.in.deliver(t, msg) {
		t.Fatalf("nacked: %v", f.rec.last())
	}
	sent := tracer.take()
	insert := `INSERT INTO "` + f.table + `"`
	if len(sent) != 3 || !strings.HasPrefix(sent[0], "batch: BEGIN") || !strings.HasPrefix(sent[1], "query: INSERT INTO "+f.effect) ||
		sent[2] != "batch: "+strings.Join([]string{sentInsert(sent[2], insert), sentInsert(sent[2], insert), "commit"}, "; ") {
		t.Errorf("sent %q; want the claim's batch, the handler's insert, and one batch of two outbox inserts and commit", sent)
	}
	ids := f.relayed(t)
	if len(ids) != 4 || ids[2] != msg.UUID+"-published" || ids[3] != msg.UUID+"-returned" {
		t.Errorf("relayed %v, want the two outputs of each message, in the order written", ids)
	}
}

// sentInsert returns the first statement of batch that starts with prefix,
// or prefix when none does (the comparison then fails and shows both).
func sentInsert(batch, prefix string) string {
	for _, q := range strings.Split(strings.TrimPrefix(batch, "batch: "), "; ") {
		if strings.HasPrefix(q, prefix) {
			return q
		}
	}
	return prefix
}

// An outbox INSERT that fails in the batch of the COMMIT (the outbox table
// dropped while the service runs) commits nothing: the delivery is nacked
// with the driver's error (42P01), the business row and the claim are gone,
// no connection stays checked out, and once the table is back the
// redelivery is processed and its outputs relayed.
func TestOutbox_FailedWriteAtTheCommitCommitsNothing(t *testing.T) {
	t.Parallel()
	pool := openPool(t, "", "pgx_outbox_failed_write", nil)
	f := newOutboxFixture(t, pool)
	f.exec("DROP TABLE " + f.table)
	msg := message.NewMessage(watermill.NewUUID(), nil)
	if f.in.deliver(t, msg) {
		t.Fatal("acked a message whose outputs could not be written")
	}
	var pgErr *pgconn.PgError
	if err := f.rec.last(); !errors.As(err, &pgErr) || pgErr.Code != "42P01" {
		t.Errorf("router got %v, want the driver's 42P01", err)
	}
	f.expectRows(0, 0)
	expectNoConnHeld(t, pool)
	if err := f.ob.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	if !f.in.deliver(t, msg) {
		t.Fatalf("redelivery nacked: %v", f.rec.last())
	}
	f.expectRows(1, 1)
	if ids := f.relayed(t); len(ids) != 2 {
		t.Errorf("relayed %v, want the redelivery's two outputs", ids)
	}
}

// The handler's pgx.Tx, kept past the message, refuses every statement
// with pgx.ErrTxClosed once the inbox committed it with its outputs, as
// pgx's own Tx does after Commit: it never runs on a connection that
// serves another message.
func TestOutbox_HandlerTxIsClosedOnceCommitted(t *testing.T) {
	t.Parallel()
	pool := openPool(t, "", "pgx_outbox_closed_tx", nil)
	f := newOutboxFixture(t, pool)
	if !f.in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
		t.Fatalf("nacked: %v", f.rec.last())
	}
	tx := <-f.kept
	ctx := context.Background()
	_, execErr := tx.Exec(ctx, "SELECT 1")
	_, queryErr := tx.Query(ctx, "SELECT 1")
	rowErr := tx.QueryRow(ctx, "SELECT 1").Scan(new(int))
	_, batchErr := tx.SendBatch(ctx, &pgx.Batch{}).Exec()
	_, beginErr := tx.Begin(ctx)
	for name, err := range map[string]error{"Exec": execErr, "Query": queryErr, "QueryRow": rowErr, "SendBatch": batchErr,
		"Begin": beginErr, "Commit": tx.Commit(ctx), "Rollback": tx.Rollback(ctx)} {
		if !errors.Is(err, pgx.ErrTxClosed) {
			t.Errorf("%s on the committed transaction: %v, want pgx.ErrTxClosed", name, err)
		}
	}
	f.expectRows(1, 1)
}
