// Command billing runs the inbox's main job end to end, on a real Kafka
// protocol, while every cause of redelivery happens: Orders publishes
// orders.confirmed events; Billing creates exactly one invoice per order and
// emits invoices.to_send through an outbox in the same transaction;
// Watermill's forwarder relays the outbox to Kafka; Mailer "sends" one email
// per invoice. Both consumers share one inbox table.
//
//	go run .                       # kfake broker in process + SQLite in a temporary folder
//	go run . -db 'postgres://postgres@127.0.0.1:5432/test?sslmode=disable'
//	go run . -db 'postgres://postgres@127.0.0.1:5432/test?sslmode=disable' -inbox pgx
//	go run . -db 'mysql://root@tcp(127.0.0.1:3306)/test?parseTime=true'
//	go run . -brokers kafka:9092   # an external Kafka
//
// The outbox is watermill-sql v4's bounded one on every database: a queue
// schema whose rows the forwarder deletes once it has published them to Kafka
// (PostgreSQLQueueSchema, MySQLQueueSchema, and this repository's
// sqliteoutboxv4.QueueSchema, each with its queue offsets adapter and
// DeleteOnAck). The queue schemas select every row not yet acked rather than
// the rows above an offset, so MySQL/MariaDB needs no commit-order lock
// (package mysqloutbox; see docs/outbox.md).
//
// With -inbox pgx (PostgreSQL only) Billing and Mailer run package pgxinbox
// over a pgxpool instead of package inbox over database/sql: handlers get a
// pgx.Tx, the outbox writes through wsql.TxFromPgx, and the forwarder reads
// through wsql.BeginnerFromPgx.
//
// Injected, by default: the producer re-sends 5 % of the events (an outbox
// relay retry); a Billing worker process is SIGKILLed right after a commit,
// before its ack; a second Billing instance joins and leaves the consumer
// group (rebalance); the group's offsets are deleted and everything is
// replayed (operator rewind). It ends with
//
//	effectively-once: orders=N invoices=N emails=N deliveries=D duplicates_skipped=S
//	outbox_rows=0
//
// and exits non-zero if invoices or emails differ from orders, or if the
// outbox still holds rows once everything was forwarded.
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
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	_ "github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/jmoiron/sqlx"
	_ "modernc.org/sqlite"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/pgxinbox"
	"github.com/watermill-inbox/inbox/sqliteoutboxv4"
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
	inboxImpl = flag.String("inbox", "database/sql", "database/sql (package inbox over sqlx) or pgx (package pgxinbox over a pgxpool; PostgreSQL only)")
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

// database is the opened -db with its dialect and bounded-outbox adapters.
type database struct {
	db      *sqlx.DB
	pool    *pgxpool.Pool // -inbox pgx only: db then borrows its connections
	dialect inbox.Dialect
	// publish is the outbox schema of the publishing side (the inbox
	// transaction), subscribe the forwarder's: the same table, with the
	// forwarder's batch size.
	publish, subscribe wsql.SchemaAdapter
	offsets            wsql.OffsetsAdapter
}

// checkInbox refuses an -inbox the -db cannot run.
func checkInbox(dsn, impl string) error {
	if impl != "database/sql" && impl != "pgx" {
		return fmt.Errorf("-inbox %q: want database/sql or pgx", impl)
	}
	if impl == "pgx" && !strings.HasPrefix(dsn, "postgres://") {
		return fmt.Errorf("-inbox pgx needs PostgreSQL (-db postgres://…): pgxinbox runs on a pgx pool, and pgx speaks only PostgreSQL")
	}
	return nil
}

func openDB(ctx context.Context, dsn, impl string) (*database, error) {
	if err := checkInbox(dsn, impl); err != nil {
		return nil, err
	}
	switch {
	case strings.HasPrefix(dsn, "postgres://"):
		// SubscribeBatchSize 1: watermill-sql v4.1.2's subscriber, closed
		// in the middle of a batch, deletes the rows of that batch it never
		// delivered (docs/outbox.md). With one row per batch the only row
		// read is the one in flight, which is kept and sent again.
		d := &database{dialect: inbox.PostgreSQL, publish: wsql.PostgreSQLQueueSchema{},
			subscribe: wsql.PostgreSQLQueueSchema{SubscribeBatchSize: 1},
			offsets:   wsql.PostgreSQLQueueOffsetsAdapter{DeleteOnAck: true}}
		if impl == "pgx" {
			pool, err := pgxpool.New(ctx, dsn)
			if err != nil {
				return nil, err
			}
			d.pool, d.db = pool, pgxinbox.DB(pool)
			return d, nil
		}
		db, err := sqlx.Open("pgx", dsn)
		d.db = db
		return d, err
	case strings.HasPrefix(dsn, "mysql://"):
		// The same batch size as on PostgreSQL, for the same reason. The
		// queue schema needs no mysqloutbox.Lock: it does not read by offset.
		db, err := sqlx.Open("mysql", strings.TrimPrefix(dsn, "mysql://"))
		return &database{db: db, dialect: inbox.MySQL, publish: wsql.MySQLQueueSchema{},
			subscribe: wsql.MySQLQueueSchema{SubscribeBatchSize: 1},
			offsets:   wsql.MySQLQueueOffsetsAdapter{DeleteOnAck: true}}, err
	case strings.HasPrefix(dsn, "sqlite:"):
		path := strings.TrimPrefix(dsn, "sqlite:")
		params := "_journal_mode=WAL&_busy_timeout=30000&_synchronous=NORMAL"
		db, err := sqlx.Open("sqlite", "file:"+path+"?"+params+"&_txlock=immediate")
		// The forwarder's subscriber holds the write lock while it forwards
		// a small batch (_txlock=immediate; see sqliteoutboxv4): exactly
		// once, no livelock. A batch of 10 as sqliteoutboxv4 recommends:
		// its QueueOffsetsAdapter deletes only the rows up to the last acked
		// one, so a batch cut by a closing forwarder loses nothing.
		return &database{db: db, dialect: inbox.SQLite, publish: sqliteoutboxv4.QueueSchema{},
			subscribe: sqliteoutboxv4.QueueSchema{SubscribeBatchSize: 10},
			offsets:   sqliteoutboxv4.QueueOffsetsAdapter{DeleteOnAck: true}}, err
	}
	return nil, fmt.Errorf("-db %q: want postgres://… or mysql://…", dsn)
}

func (d *database) Close() {
	d.db.Close()
	if d.pool != nil {
		d.pool.Close()
	}
}

// beginner is the forwarder subscriber's handle on the database.
func (d *database) beginner() wsql.Beginner {
	if d.pool != nil {
		return wsql.BeginnerFromPgx(d.pool)
	}
	return wsql.BeginnerFromStdSQL(d.db.DB)
}

// outboxTable is the outbox table of the run, quoted (watermill-sql's name).
func (d *database) outboxTable(run string) string {
	if d.dialect == inbox.MySQL {
		return "`watermill_" + outboxTopic + "_" + run + "`"
	}
	return `"watermill_` + outboxTopic + "_" + run + `"`
}

// execInTx runs a statement (with ? placeholders) in the message's inbox
// transaction, whichever inbox claimed it.
func (d *database) execInTx(ctx context.Context, query string, args ...any) error {
	if d.pool != nil {
		tx, ok := pgxinbox.TxFromContext(ctx)
		if !ok {
			return pgxinbox.MissingTxError(ctx)
		}
		_, err := tx.Exec(ctx, sqlx.Rebind(sqlx.DOLLAR, query), args...)
		return err
	}
	tx, ok := inbox.TxFromContext(ctx)
	if !ok {
		return inbox.MissingTxError(ctx)
	}
	_, err := tx.ExecContext(ctx, tx.Rebind(query), args...)
	return err
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

// middleware is the inbox middleware of one worker: package inbox on
// database/sql, or package pgxinbox on the pgx pool.
func (d *database) newInbox(name, run string, hooks func(string) func(inbox.Event), logger watermill.LoggerAdapter) (*inbox.Inbox, error) {
	// The forwarder's table, checked by RouterPlugin before the router runs.
	outboxTables := []string{"watermill_" + outboxTopic + "_" + run}
	outbox := func(tx wsql.ContextExecutor) (message.Publisher, error) {
		pub, err := wsql.NewPublisher(tx, wsql.PublisherConfig{SchemaAdapter: d.publish}, logger)
		if err != nil {
			return nil, err
		}
		return forwarder.NewPublisher(pub, forwarder.PublisherConfig{ForwarderTopic: outboxTopic + "_" + run}), nil
	}
	if d.pool != nil {
		ib, err := pgxinbox.New(pgxinbox.Config{
			Pool: d.pool, Table: "inbox_" + run, Consumer: name,
			OnProcessed: hooks("processed"), OnDuplicate: hooks("duplicate"),
			Outbox:       func(tx pgx.Tx) (message.Publisher, error) { return outbox(wsql.TxFromPgx(tx)) },
			OutboxTables: outboxTables,
		})
		if err != nil {
			return nil, err
		}
		return ib.Inbox, nil
	}
	ib, err := inbox.New(inbox.Config{
		DB: d.db, Dialect: d.dialect, Table: "inbox_" + run, Consumer: name,
		OnProcessed: hooks("processed"), OnDuplicate: hooks("duplicate"),
		Outbox:       func(tx *sqlx.Tx) (message.Publisher, error) { return outbox(wsql.TxFromStdSQL(tx.Tx)) },
		OutboxTables: outboxTables,
	})
	if err != nil {
		return nil, err
	}
	return ib, nil
}

// work runs one Billing or Mailer worker process until SIGTERM.
func work(name string) error {
	run := os.Getenv("BILLING_RUN")
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	d, err := openDB(ctx, *dsn, *inboxImpl)
	if err != nil {
		return err
	}
	defer d.Close()
	logger := watermill.NopLogger{}
	record := func(outcome string) func(inbox.Event) {
		return func(inbox.Event) {
			// Outside the inbox transaction, before the ack: survives a SIGKILL.
			if _, err := d.db.Exec(d.db.Rebind("INSERT INTO deliveries_"+run+" (consumer, outcome) VALUES (?, ?)"), name, outcome); err != nil {
				log.Printf("%s: record delivery: %v", *instance, err)
			}
		}
	}
	ib, err := d.newInbox(name, run, record, logger)
	if err != nil {
		return err
	}
	// Retry, a Timeout per attempt and Recoverer around the inbox, in the
	// order that gives each attempt a fresh transaction.
	mws, err := ib.Middlewares(inbox.MiddlewaresConfig{
		Retry: middleware.Retry{MaxRetries: 5, InitialInterval: 50 * time.Millisecond},
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
	router.AddMiddleware(mws...)
	router.AddPlugin(ib.RouterPlugin) // a missing inbox or outbox table stops router.Run
	commits := 0
	if name == "billing" {
		router.AddHandler("billing", ordersTopic, sub, invoicesTopic, unusedPublisher{}, func(msg *message.Message) ([]*message.Message, error) {
			orderID := msg.Metadata.Get("order_id")
			if err := d.execInTx(msg.Context(), "INSERT INTO invoices_"+run+" (order_id, amount) VALUES (?, ?)", orderID, 100); err != nil {
				return nil, err
			}
			commits++
			if *killAfter > 0 && commits == *killAfter {
				inbox.AfterCommit(msg.Context(), func() {
					log.Printf("%s: SIGKILL after committing order %s, before its ack", *instance, orderID)
					syscall.Kill(os.Getpid(), syscall.SIGKILL)
				})
			}
			// A JSON payload: the queue schemas' payload column is JSON.
			invoice := message.NewMessage(watermill.NewUUID(), []byte(`{"amount":100}`))
			invoice.Metadata.Set("order_id", orderID)
			return []*message.Message{invoice}, nil // through the outbox, in this transaction
		})
	} else {
		router.AddConsumerHandler("mailer", invoicesTopic, sub, func(msg *message.Message) error {
			return d.execInTx(msg.Context(), "INSERT INTO emails_sent_"+run+" (order_id) VALUES (?)", msg.Metadata.Get("order_id"))
		})
	}
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
