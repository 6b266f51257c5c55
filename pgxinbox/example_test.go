package pgxinbox_test

import (
	"context"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/inbox/pgxinbox"
)

// The inbox on a pgx pool, with its outbox on watermill-sql v4's queue
// schema (a forwarded row is deleted once the forwarder acked it).
// docs/outbox.md quotes its outbox factory and the forwarder's subscriber,
// and the README's outbox section links here.
func Example() {
	ctx := context.Background()
	logger := watermill.NewStdLogger(false, false)
	pool, err := pgxpool.New(ctx, "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
	if err != nil {
		panic(err)
	}
	outboxSchema := wsql.PostgreSQLQueueSchema{}
	ib, err := pgxinbox.New(pgxinbox.Config{
		Pool: pool,
		Outbox: func(tx pgx.Tx) (message.Publisher, error) {
			pub, err := wsql.NewPublisher(wsql.TxFromPgx(tx), wsql.PublisherConfig{SchemaAdapter: outboxSchema}, logger)
			if err != nil {
				return nil, err
			}
			return forwarder.NewPublisher(pub, forwarder.PublisherConfig{ForwarderTopic: "outbox"}), nil
		},
	})
	if err != nil {
		panic(err)
	}
	if err := ib.InitializeSchema(ctx); err != nil {
		panic(err)
	}
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		panic(err)
	}
	router.AddMiddleware(ib.Middleware)
	router.AddHandler("billing", "orders", subscriber, "invoices", publisher, func(msg *message.Message) ([]*message.Message, error) {
		tx, ok := pgxinbox.TxFromContext(msg.Context())
		if !ok {
			return nil, pgxinbox.MissingTxError(msg.Context())
		}
		if _, err := tx.Exec(msg.Context(), "INSERT INTO invoices (order_id) VALUES ($1)", msg.UUID); err != nil {
			return nil, err
		}
		return []*message.Message{message.NewMessage(watermill.NewUUID(), msg.Payload)}, nil // via the outbox
	})

	// The forwarder reads the outbox table and publishes to the broker.
	// A batch of 1: watermill-sql v4.1.2's subscriber, stopped in the middle
	// of a batch, acks (here: deletes) the rows of the batch it had not
	// delivered (docs/outbox.md).
	outboxSubscriber, err := wsql.NewSubscriber(wsql.BeginnerFromPgx(pool), wsql.SubscriberConfig{
		SchemaAdapter:    wsql.PostgreSQLQueueSchema{SubscribeBatchSize: 1},
		OffsetsAdapter:   wsql.PostgreSQLQueueOffsetsAdapter{DeleteOnAck: true},
		InitializeSchema: true,
	}, logger)
	if err != nil {
		panic(err)
	}
	if err := outboxSubscriber.SubscribeInitialize("outbox"); err != nil { // the publisher cannot create it in a transaction
		panic(err)
	}
	fwd, err := forwarder.NewForwarder(outboxSubscriber, publisher, logger, forwarder.Config{ForwarderTopic: "outbox"})
	if err != nil {
		panic(err)
	}
	go fwd.Run(ctx)
	_ = router.Run(ctx)
}

// Stand-ins for the broker (Kafka, RabbitMQ, ...) of the example.
var (
	subscriber message.Subscriber
	publisher  message.Publisher
)
