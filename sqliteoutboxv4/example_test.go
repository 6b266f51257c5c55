package sqliteoutboxv4_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jmoiron/sqlx"
	_ "modernc.org/sqlite"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/sqliteoutboxv4"
)

// An inbox on SQLite whose handler's returned message goes to a bounded
// outbox (the queue schema, rows deleted once forwarded) in the inbox
// transaction, and a forwarder that sends it on to the broker (a GoChannel
// here).
func Example_inboxOutbox() {
	dir, err := os.MkdirTemp("", "sqliteoutboxv4")
	if err != nil {
		panic(err)
	}
	defer os.RemoveAll(dir)
	dsn := "file:" + filepath.Join(dir, "app.db") +
		"?_journal_mode=WAL&_busy_timeout=10000&_synchronous=NORMAL&_txlock=immediate"
	db := sqlx.MustOpen("sqlite", dsn)
	defer db.Close()
	fwdDB := sqlx.MustOpen("sqlite", dsn) // the forwarder's own handle
	defer fwdDB.Close()
	logger := watermill.NopLogger{}
	ctx := context.Background()

	// The forwarder reads the outbox and deletes each row once the broker
	// took it. Its subscriber creates the outbox table up front: the
	// inbox's publisher runs on a transaction, where watermill-sql does not
	// create tables.
	sub, err := wsql.NewSubscriber(wsql.BeginnerFromStdSQL(fwdDB.DB), wsql.SubscriberConfig{
		PollInterval:   10 * time.Millisecond,
		SchemaAdapter:  sqliteoutboxv4.QueueSchema{SubscribeBatchSize: 10},
		OffsetsAdapter: sqliteoutboxv4.QueueOffsetsAdapter{DeleteOnAck: true},
	}, logger)
	if err != nil {
		panic(err)
	}
	if err := sub.SubscribeInitialize("outbox"); err != nil {
		panic(err)
	}
	broker := gochannel.NewGoChannel(gochannel.Config{}, logger)
	defer broker.Close()
	fwd, err := forwarder.NewForwarder(sub, broker, logger, forwarder.Config{ForwarderTopic: "outbox"})
	if err != nil {
		panic(err)
	}
	go fwd.Run(ctx)
	defer fwd.Close()
	invoices, err := broker.Subscribe(ctx, "invoices")
	if err != nil {
		panic(err)
	}

	ib, err := inbox.New(inbox.Config{DB: db, Outbox: func(tx *sqlx.Tx) (message.Publisher, error) {
		pub, err := wsql.NewPublisher(wsql.TxFromStdSQL(tx.Tx), wsql.PublisherConfig{
			SchemaAdapter: sqliteoutboxv4.QueueSchema{},
		}, logger)
		return forwarder.NewPublisher(pub, forwarder.PublisherConfig{ForwarderTopic: "outbox"}), err
	}})
	if err != nil {
		panic(err)
	}
	if err := ib.InitializeSchema(ctx); err != nil {
		panic(err)
	}

	orders := gochannel.NewGoChannel(gochannel.Config{}, logger)
	defer orders.Close()
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		panic(err)
	}
	router.AddMiddleware(ib.Middleware)
	router.AddHandler("billing", "orders", orders, "invoices", broker, func(msg *message.Message) ([]*message.Message, error) {
		// Goes to the outbox, in the inbox transaction.
		return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("invoice for "+string(msg.Payload)))}, nil
	})
	go router.Run(ctx)
	defer router.Close()
	<-router.Running()

	if err := orders.Publish("orders", message.NewMessage(watermill.NewUUID(), []byte("order 42"))); err != nil {
		panic(err)
	}
	invoice := <-invoices
	invoice.Ack()
	fmt.Println(string(invoice.Payload))
	// Output: invoice for order 42
}
