package kafkaoutbox_test

import (
	"context"
	"log"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/kafkaoutbox"
)

// The README's outbox setup: the relay sends to Kafka through kafkaoutbox,
// and runs while the router runs. It needs a database and a broker, so the
// example is only built (no Output); TestRelayThroughKafkaPublisher_*
// run the same setup against kfake.
func ExampleNewPublisher() {
	ctx := context.Background()
	logger := watermill.NopLogger{}
	db, err := sqlx.Open("pgx", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
	if err != nil {
		log.Fatal(err)
	}
	pub, err := kafkaoutbox.NewPublisher(kafka.PublisherConfig{Brokers: []string{"127.0.0.1:9092"}, Marshaler: kafka.DefaultMarshaler{}}, logger)
	if err != nil {
		log.Fatal(err)
	}
	defer pub.Close()
	ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Publisher: pub, Logger: logger})
	if err != nil {
		log.Fatal(err)
	}
	if err := ob.InitializeSchema(ctx); err != nil { // or apply ob.SchemaSQL() with your migrations
		log.Fatal(err)
	}
	ib, err := inbox.New(inbox.Config{DB: db, Outbox: ob.Publisher})
	if err != nil {
		log.Fatal(err)
	}
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		log.Fatal(err)
	}
	router.AddPlugin(ob.RouterPlugin) // the relay runs while the router runs
	router.AddMiddleware(ib.Middleware)
	// router.AddHandler(…): the messages a handler returns go to the outbox.
}
