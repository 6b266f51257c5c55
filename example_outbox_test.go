package inbox_test

// The outbox setups of docs/outbox.md, compiled: each function's body is a
// snippet of that page. They need a server and a broker, so the examples
// only build them (no Output); the tests in outbox_v4_test.go,
// outbox_bounded_test.go and outbox_test.go run the same setups.

import (
	"context"
	"log"

	"github.com/ThreeDotsLabs/watermill"
	wsql3 "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/mysqloutbox"
)

// The outbox with watermill-sql v4 on database/sql and PostgreSQL: the
// inbox's factory writes to the outbox in the message's transaction, and
// Watermill's forwarder relays the outbox to the broker.
func ExampleConfig_outbox() {
	db, err := sqlx.Open("pgx", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
	if err != nil {
		log.Fatal(err)
	}
	var broker message.Publisher // your Kafka, AMQP, NATS… publisher
	ib, err := outboxV4PostgreSQL(context.Background(), db, broker, watermill.NopLogger{})
	if err != nil {
		log.Fatal(err)
	}
	_ = ib // router.AddMiddleware(ib.Middleware)
}

func outboxV4PostgreSQL(ctx context.Context, db *sqlx.DB, broker message.Publisher, logger watermill.LoggerAdapter) (*inbox.Inbox, error) {
	ib, err := inbox.New(inbox.Config{
		DB: db,
		Outbox: func(tx *sqlx.Tx) (message.Publisher, error) {
			pub, err := wsql.NewPublisher(wsql.TxFromStdSQL(tx.Tx), wsql.PublisherConfig{SchemaAdapter: wsql.DefaultPostgreSQLSchema{}}, logger)
			if err != nil {
				return nil, err
			}
			return forwarder.NewPublisher(pub, forwarder.PublisherConfig{ForwarderTopic: "outbox"}), nil
		},
	})
	if err != nil {
		return nil, err
	}

	// The forwarder: create the outbox tables up front (a publisher on a
	// transaction cannot), then relay the outbox to the broker.
	sub, err := wsql.NewSubscriber(wsql.BeginnerFromStdSQL(db.DB), wsql.SubscriberConfig{
		SchemaAdapter:    wsql.DefaultPostgreSQLSchema{},
		OffsetsAdapter:   wsql.DefaultPostgreSQLOffsetsAdapter{},
		InitializeSchema: true,
	}, logger)
	if err != nil {
		return nil, err
	}
	if err := sub.SubscribeInitialize("outbox"); err != nil { // creates watermill_outbox and watermill_offsets_outbox
		return nil, err
	}
	fwd, err := forwarder.NewForwarder(sub, broker, logger, forwarder.Config{ForwarderTopic: "outbox"})
	if err != nil {
		return nil, err
	}
	go func() {
		if err := fwd.Run(ctx); err != nil {
			logger.Error("outbox forwarder stopped", err, nil)
		}
	}()
	return ib, nil
}

// The bounded outbox: watermill-sql v4's queue schema with delete-on-ack,
// whose table holds only what is not yet forwarded.
func ExampleConfig_outboxBounded() {
	db, err := sqlx.Open("pgx", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
	if err != nil {
		log.Fatal(err)
	}
	var broker message.Publisher
	ib, err := outboxBoundedPostgreSQL(context.Background(), db, broker, watermill.NopLogger{})
	if err != nil {
		log.Fatal(err)
	}
	_ = ib
}

func outboxBoundedPostgreSQL(ctx context.Context, db *sqlx.DB, broker message.Publisher, logger watermill.LoggerAdapter) (*inbox.Inbox, error) {
	schema := wsql.PostgreSQLQueueSchema{SubscribeBatchSize: 1}      // MySQL/MariaDB: wsql.MySQLQueueSchema{SubscribeBatchSize: 1}
	offsets := wsql.PostgreSQLQueueOffsetsAdapter{DeleteOnAck: true} // MySQL/MariaDB: wsql.MySQLQueueOffsetsAdapter{DeleteOnAck: true}

	ib, err := inbox.New(inbox.Config{
		DB: db,
		Outbox: func(tx *sqlx.Tx) (message.Publisher, error) {
			pub, err := wsql.NewPublisher(wsql.TxFromStdSQL(tx.Tx), wsql.PublisherConfig{SchemaAdapter: schema}, logger)
			if err != nil {
				return nil, err
			}
			return forwarder.NewPublisher(pub, forwarder.PublisherConfig{ForwarderTopic: "outbox"}), nil
		},
	})
	if err != nil {
		return nil, err
	}
	sub, err := wsql.NewSubscriber(wsql.BeginnerFromStdSQL(db.DB), wsql.SubscriberConfig{
		SchemaAdapter:    schema,
		OffsetsAdapter:   offsets, // no ConsumerGroup: queue schemas have none
		InitializeSchema: true,
	}, logger)
	if err != nil {
		return nil, err
	}
	if err := sub.SubscribeInitialize("outbox"); err != nil {
		return nil, err
	}
	fwd, err := forwarder.NewForwarder(sub, broker, logger, forwarder.Config{ForwarderTopic: "outbox"})
	if err != nil {
		return nil, err
	}
	go func() {
		if err := fwd.Run(ctx); err != nil {
			logger.Error("outbox forwarder stopped", err, nil)
		}
	}()
	return ib, nil
}

// MySQL/MariaDB with watermill-sql's default (offset-based) schema: the
// mysqloutbox Lock makes outbox offsets follow commit order, so that the
// relay never skips a row.
func ExampleConfig_outboxMySQL() {
	db, err := sqlx.Open("mysql", "root@tcp(127.0.0.1:3306)/test?parseTime=true")
	if err != nil {
		log.Fatal(err)
	}
	ib, err := outboxMySQL(context.Background(), db, watermill.NopLogger{})
	if err != nil {
		log.Fatal(err)
	}
	_ = ib
}

func outboxMySQL(ctx context.Context, db *sqlx.DB, logger watermill.LoggerAdapter) (*inbox.Inbox, error) {
	lock, err := mysqloutbox.NewLock(mysqloutbox.Config{}) // table watermill_outbox_lock, one lock row
	if err != nil {
		return nil, err
	}
	if err := lock.InitializeSchema(ctx, db.DB); err != nil {
		return nil, err
	}
	return inbox.New(inbox.Config{
		DB: db,
		Outbox: func(tx *sqlx.Tx) (message.Publisher, error) {
			pub, err := wsql.NewPublisher(wsql.TxFromStdSQL(tx.Tx), wsql.PublisherConfig{SchemaAdapter: wsql.DefaultMySQLSchema{}}, logger)
			if err != nil {
				return nil, err
			}
			return lock.Publisher(tx.Tx, forwarder.NewPublisher(pub, forwarder.PublisherConfig{ForwarderTopic: "outbox"})), nil
		},
	})
	// The forwarder as for PostgreSQL, with wsql.DefaultMySQLSchema{} and
	// wsql.DefaultMySQLOffsetsAdapter{}.
}

// watermill-sql v3: its publisher takes the *sqlx.Tx itself, its
// subscriber the *sqlx.DB.
func ExampleConfig_outboxV3() {
	db, err := sqlx.Open("pgx", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
	if err != nil {
		log.Fatal(err)
	}
	var broker message.Publisher
	ib, err := outboxV3PostgreSQL(context.Background(), db, broker, watermill.NopLogger{})
	if err != nil {
		log.Fatal(err)
	}
	_ = ib
}

func outboxV3PostgreSQL(ctx context.Context, db *sqlx.DB, broker message.Publisher, logger watermill.LoggerAdapter) (*inbox.Inbox, error) {
	ib, err := inbox.New(inbox.Config{
		DB: db,
		Outbox: func(tx *sqlx.Tx) (message.Publisher, error) {
			pub, err := wsql3.NewPublisher(tx, wsql3.PublisherConfig{SchemaAdapter: wsql3.DefaultPostgreSQLSchema{}}, logger)
			if err != nil {
				return nil, err
			}
			return forwarder.NewPublisher(pub, forwarder.PublisherConfig{ForwarderTopic: "outbox"}), nil
		},
	})
	if err != nil {
		return nil, err
	}
	sub, err := wsql3.NewSubscriber(db, wsql3.SubscriberConfig{
		SchemaAdapter:    wsql3.DefaultPostgreSQLSchema{},
		OffsetsAdapter:   wsql3.DefaultPostgreSQLOffsetsAdapter{},
		InitializeSchema: true,
	}, logger)
	if err != nil {
		return nil, err
	}
	if err := sub.SubscribeInitialize("outbox"); err != nil {
		return nil, err
	}
	fwd, err := forwarder.NewForwarder(sub, broker, logger, forwarder.Config{ForwarderTopic: "outbox"})
	if err != nil {
		return nil, err
	}
	go func() {
		if err := fwd.Run(ctx); err != nil {
			logger.Error("outbox forwarder stopped", err, nil)
		}
	}()
	return ib, nil
}

// The README's outbox snippet (v4, database/sql, the bounded outbox on
// PostgreSQL), compiled.
func readmeOutbox(db *sqlx.DB, logger watermill.LoggerAdapter) (*inbox.Inbox, error) {
	ib, err := inbox.New(inbox.Config{
		DB: db,
		Outbox: func(tx *sqlx.Tx) (message.Publisher, error) { // wsql: github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql
			pub, err := wsql.NewPublisher(wsql.TxFromStdSQL(tx.Tx), wsql.PublisherConfig{SchemaAdapter: wsql.PostgreSQLQueueSchema{}}, logger)
			if err != nil {
				return nil, err
			}
			return forwarder.NewPublisher(pub, forwarder.PublisherConfig{ForwarderTopic: "outbox"}), nil
		},
	})
	// the forwarder's subscriber: wsql.NewSubscriber(wsql.BeginnerFromStdSQL(db.DB), wsql.SubscriberConfig{
	//	SchemaAdapter: wsql.PostgreSQLQueueSchema{SubscribeBatchSize: 1}, OffsetsAdapter: wsql.PostgreSQLQueueOffsetsAdapter{DeleteOnAck: true}}, logger)
	return ib, err
}

var _ = readmeOutbox
