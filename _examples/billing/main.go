// Command billing runs the inbox's main job end to end, on a real Kafka
// protocol, while every cause of redelivery happens: Orders publishes
// orders.confirmed events; Billing creates exactly one invoice per order and
// emits invoices.to_send through an outbox in the same transaction;
// Watermill's forwarder relays the outbox to Kafka; Mailer "sends" one email
// per invoice. Both consumers share one inbox table.
//
//	go run .                       # kfake broker in process + SQLite in a temporary folder
//	go run . -db 'postgres://postgres@127.0.0.1:5432/test?sslmode=disable'
//	go run . -db 'mysql://root@tcp(127.0.0.1:3306)/test?parseTime=true'
//	go run . -brokers kafka:9092   # an external Kafka
//
// Injected, by default: the producer re-sends 5 % of the events (an outbox
// relay retry); a Billing worker process is SIGKILLed right after a commit,
// before its ack; a second Billing instance joins and leaves the consumer
// group (rebalance); the group's offsets are deleted and everything is
// replayed (operator rewind). It ends with
//
//	effectively-once: orders=N invoices=N emails=N deliveries=D duplicates_skipped=S
//
// and exits non-zero if invoices or emails differ from orders.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	_ "github.com/go-sql-driver/mysql"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/jmoiron/sqlx"
	_ "modernc.org/sqlite"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/sqliteoutbox"
)

const (
	ordersTopic   = "orders.confirmed"
	invoicesTopic = "invoices.to_send"
	outboxTopic   = "outbox"
	partitions    = 3
)

var (
	role      = flag.String("role", "orchestrator", "internal: orchestrator, billing or mailer")
	brokers   = flag.String("brokers", "", "Kafka bootstrap addresses (default: an in-process kfake broker)")
	dsn       = flag.String("db", "", "postgres://… or mysql://<go-sql-driver DSN> (default: SQLite in a temporary folder)")
	orders    = flag.Int("orders", 1000, "orders to publish")
	resend    = flag.Float64("resend", 0.05, "share of events the producer publishes twice")
	killAfter = flag.Int("kill-after", 0, "internal: SIGKILL this worker right after its Nth commit")
	instance  = flag.String("instance", "", "internal: worker name for logs")
)

func main() {
	flag.Parse()
	var err error
	switch *role {
	case "orchestrator":
		err = orchestrate()
	case "billing", "mailer":
		err = work(*role)
	default:
		err = fmt.Errorf("unknown -role %q", *role)
	}
	if err != nil {
		log.Fatalf("%s: %v", *role, err)
	}
}

// database is the opened -db with its dialect and outbox schema adapter.
type database struct {
	db      *sqlx.DB
	dialect inbox.Dialect
	schema  wsql.SchemaAdapter
	offsets wsql.OffsetsAdapter
	// subscriber opens the forwarder's handle.
	subscriber func() (*sqlx.DB, error)
}

func openDB(dsn string) (*database, error) {
	switch {
	case strings.HasPrefix(dsn, "postgres://"):
		db, err := sqlx.Open("pgx", dsn)
		return &database{db: db, dialect: inbox.PostgreSQL, schema: wsql.DefaultPostgreSQLSchema{},
			offsets: wsql.DefaultPostgreSQLOffsetsAdapter{}, subscriber: func() (*sqlx.DB, error) { return db, nil }}, err
	case strings.HasPrefix(dsn, "mysql://"):
		db, err := sqlx.Open("mysql", strings.TrimPrefix(dsn, "mysql://"))
		return &database{db: db, dialect: inbox.MySQL, schema: wsql.DefaultMySQLSchema{},
			offsets: wsql.DefaultMySQLOffsetsAdapter{}, subscriber: func() (*sqlx.DB, error) { return db, nil }}, err
	case strings.HasPrefix(dsn, "sqlite:"):
		path := strings.TrimPrefix(dsn, "sqlite:")
		params := "_journal_mode=WAL&_busy_timeout=30000&_synchronous=NORMAL"
		db, err := sqlx.Open("sqlite", "file:"+path+"?"+params+"&_txlock=immediate")
		// The forwarder's subscriber holds the write lock while it forwards
		// a small batch (see sqliteoutbox): exactly once, no livelock.
		return &database{db: db, dialect: inbox.SQLite, schema: sqliteoutbox.SchemaAdapter{SubscribeBatchSize: 10},
			offsets: sqliteoutbox.OffsetsAdapter{}, subscriber: func() (*sqlx.DB, error) { return db, nil }}, err
	}
	return nil, fmt.Errorf("-db %q: want postgres://… or mysql://…", dsn)
}

func saramaConfig() *sarama.Config {
	c := kafka.DefaultSaramaSubscriberConfig()
	c.Version = sarama.V2_8_0_0
	c.Consumer.Offsets.Initial = sarama.OffsetOldest
	c.Consumer.MaxWaitTime = 10 * time.Millisecond
	c.Consumer.Offsets.AutoCommit.Interval = 200 * time.Millisecond
	return c
}

// tables creates the business tables and the stats table the example reads.
func tables(d *database, run string) error {
	stmts := []string{
		"CREATE TABLE IF NOT EXISTS invoices_" + run + " (order_id VARCHAR(64) NOT NULL PRIMARY KEY, amount INTEGER NOT NULL)",
		"CREATE TABLE IF NOT EXISTS emails_sent_" + run + " (order_id VARCHAR(64) NOT NULL PRIMARY KEY)",
		"CREATE TABLE IF NOT EXISTS deliveries_" + run + " (consumer VARCHAR(32) NOT NULL, outcome VARCHAR(16) NOT NULL)",
	}
	for _, s := range stmts {
		if _, err := d.db.Exec(s); err != nil {
			return err
		}
	}
	return nil
}

// work runs one Billing or Mailer worker process until SIGTERM.
func work(name string) error {
	run := os.Getenv("BILLING_RUN")
	d, err := openDB(*dsn)
	if err != nil {
		return err
	}
	defer d.db.Close()
	logger := watermill.NopLogger{}
	record := func(outcome string) func(inbox.Event) {
		return func(inbox.Event) {
			// Outside the inbox transaction, before the ack: survives a SIGKILL.
			if _, err := d.db.Exec(d.db.Rebind("INSERT INTO deliveries_"+run+" (consumer, outcome) VALUES (?, ?)"), name, outcome); err != nil {
				log.Printf("%s: record delivery: %v", *instance, err)
			}
		}
	}
	commits := 0
	ib, err := inbox.New(inbox.Config{
		DB: d.db, Dialect: d.dialect, Table: "inbox_" + run, Consumer: name,
		OnProcessed: record("processed"), OnDuplicate: record("duplicate"),
		Outbox: func(tx *sqlx.Tx) (message.Publisher, error) {
			pub, err := wsql.NewPublisher(tx, wsql.PublisherConfig{SchemaAdapter: d.schema}, logger)
			if err != nil {
				return nil, err
			}
			var out message.Publisher = forwarder.NewPublisher(pub, forwarder.PublisherConfig{ForwarderTopic: outboxTopic + "_" + run})
			if d.dialect == inbox.MySQL {
				out = commitOrderedPublisher{tx: tx, lock: "SELECT id FROM outbox_lock_" + run + " WHERE id = 1 FOR UPDATE", next: out}
			}
			return out, nil
		},
	})
	if err != nil {
		return err
	}
	sub, err := kafka.NewSubscriber(kafka.SubscriberConfig{
		Brokers: strings.Split(*brokers, ","), Unmarshaler: kafka.DefaultMarshaler{},
		OverwriteSaramaConfig: saramaConfig(), ConsumerGroup: name + "_" + run,
	}, logger)
	if err != nil {
		return err
	}
	// The router logs handler errors (nacks) to stderr; nothing else.
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, errorLogger{*instance})
	if err != nil {
		return err
	}
	router.AddMiddleware(middleware.Recoverer, middleware.Retry{MaxRetries: 5, InitialInterval: 50 * time.Millisecond}.Middleware, ib.Middleware)
	if name == "billing" {
		router.AddHandler("billing", ordersTopic, sub, invoicesTopic, unusedPublisher{}, func(msg *message.Message) ([]*message.Message, error) {
			tx, _ := inbox.TxFromContext(msg.Context())
			orderID := msg.Metadata.Get("order_id")
			if _, err := tx.ExecContext(msg.Context(), tx.Rebind("INSERT INTO invoices_"+run+" (order_id, amount) VALUES (?, ?)"), orderID, 100); err != nil {
				return nil, err
			}
			commits++
			if *killAfter > 0 && commits == *killAfter {
				inbox.AfterCommit(msg.Context(), func() {
					log.Printf("%s: SIGKILL after committing order %s, before its ack", *instance, orderID)
					syscall.Kill(os.Getpid(), syscall.SIGKILL)
				})
			}
			invoice := message.NewMessage(watermill.NewUUID(), nil)
			invoice.Metadata.Set("order_id", orderID)
			return []*message.Message{invoice}, nil // through the outbox, in this transaction
		})
	} else {
		router.AddConsumerHandler("mailer", invoicesTopic, sub, func(msg *message.Message) error {
			tx, _ := inbox.TxFromContext(msg.Context())
			_, err := tx.ExecContext(msg.Context(), tx.Rebind("INSERT INTO emails_sent_"+run+" (order_id) VALUES (?)"), msg.Metadata.Get("order_id"))
			return err
		})
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	return router.Run(ctx)
}

// unusedPublisher is the router's publisher for Billing: with an outbox,
// the inbox never returns messages to the router.
type unusedPublisher struct{}

func (unusedPublisher) Publish(string, ...*message.Message) error {
	return fmt.Errorf("unexpected: returned messages go through the outbox")
}
func (unusedPublisher) Close() error { return nil }

// errorLogger prints only errors, prefixed with the worker's name.
type errorLogger struct{ name string }

func (l errorLogger) Error(msg string, err error, fields watermill.LogFields) {
	log.Printf("%s: %s: %v", l.name, msg, err)
}
func (l errorLogger) Info(string, watermill.LogFields)                 {}
func (l errorLogger) Debug(string, watermill.LogFields)                {}
func (l errorLogger) Trace(string, watermill.LogFields)                {}
func (l errorLogger) With(watermill.LogFields) watermill.LoggerAdapter { return l }

// commitOrderedPublisher makes MySQL outbox offsets follow commit order.
// watermill-sql's MySQL relay reads rows past its last acked AUTO_INCREMENT
// offset; a transaction that takes offset 93 but becomes visible after one
// that took 94 and committed would be skipped for good (seen in this
// example). Taking one row lock, held until COMMIT, just before the outbox
// insert serialises publish-to-commit, so offsets are assigned in commit
// order. Handlers still run in parallel up to their publish.
type commitOrderedPublisher struct {
	tx   *sqlx.Tx
	lock string
	next message.Publisher
}

func (p commitOrderedPublisher) Publish(topic string, msgs ...*message.Message) error {
	if _, err := p.tx.Exec(p.lock); err != nil {
		return fmt.Errorf("outbox order lock: %w", err)
	}
	return p.next.Publish(topic, msgs...)
}

func (p commitOrderedPublisher) Close() error { return p.next.Close() }
