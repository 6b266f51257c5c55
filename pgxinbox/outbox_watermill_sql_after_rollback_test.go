package pgxinbox_test

import (
	"context"
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// With Config.Outbox over watermill-sql v4 (wsql.TxFromPgx), a handler that
// ends the transaction with its own ROLLBACK and then returns an output has
// nothing written: the inbox checks the transaction before it publishes
// through another package's publisher, which wrote the output in
// autocommit, sent for a nacked delivery.
func TestWatermillSQLOutboxWritesNothingAfterTheHandlersRollback(t *testing.T) {
	pool := testdb.OpenPgxPool(t, "")
	f := newFixture(t, pool)
	topic := "pgx_wsql_after_rollback_" + f.sfx
	table := `"watermill_` + topic + `"`
	f.dropLater(table)
	schema := wsql.PostgreSQLQueueSchema{}
	sub, err := wsql.NewSubscriber(wsql.BeginnerFromPgx(pool), wsql.SubscriberConfig{SchemaAdapter: schema,
		OffsetsAdapter: wsql.PostgreSQLQueueOffsetsAdapter{DeleteOnAck: true}, InitializeSchema: true}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	if err := sub.SubscribeInitialize(topic); err != nil {
		t.Fatal(err)
	}
	sub.Close()
	ib := f.newInbox(pgxinbox.Config{Outbox: func(tx pgx.Tx) (message.Publisher, error) {
		return wsql.NewPublisher(wsql.TxFromPgx(tx), wsql.PublisherConfig{SchemaAdapter: schema}, watermill.NopLogger{})
	}})
	rec := &recorder{}
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(rec.Middleware, ib.Middleware)
		r.AddHandler("billing", "orders", in, topic, refusingPublisher{}, func(msg *message.Message) ([]*message.Message, error) {
			if err := f.writeEffect(msg); err != nil {
				return nil, err
			}
			tx, ok := pgxinbox.TxFromContext(msg.Context())
			if !ok {
				return nil, errors.New("no tx")
			}
			_, _ = tx.Exec(msg.Context(), "ROLLBACK")
			return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte(`{}`))}, nil
		})
	})
	acked := in.deliver(t, message.NewMessage(watermill.NewUUID(), nil))
	var n int
	if err := pool.QueryRow(context.Background(), "SELECT count(*) FROM "+table).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if acked {
		t.Error("acked; want nacked: the handler rolled its transaction back")
	}
	if n != 0 {
		t.Errorf("%d outputs in the watermill-sql outbox for a delivery whose effects did not commit (effects %d, inbox rows %d: %v); want 0",
			n, f.effects(), f.inboxRows(), rec.last())
	}
}
