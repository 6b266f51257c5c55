// Command billing runs the inbox's main job end to end, on a real Kafka
// protocol, while every cause of redelivery happens: Orders publishes
// orders.confirmed events; Billing creates one invoice per order and emits
// invoices.to_send through the inbox's outbox (inbox.Outbox) in the same
// transaction; the outbox relay, running in each Billing process, sends it to
// Kafka; Mailer "sends" one email per invoice. Both consumers share one
// inbox table.
//
//	go run .                       # kfake broker in process + SQLite in a temporary folder
//	go run . -db 'postgres://postgres@127.0.0.1:5432/test?sslmode=disable'
//	go run . -db 'postgres://postgres@127.0.0.1:5432/test?sslmode=disable' -inbox pgx
//	go run . -db 'mysql://root@tcp(127.0.0.1:3306)/test?parseTime=true'
//	go run . -brokers kafka:9092   # an external Kafka
//
// The outbox is the library's own relay on every database, set up as the
// README shows: inbox.NewOutbox with the database and kafkaoutbox's publisher,
// Config{Outbox: ob.Publisher} (pgxinbox.OutboxPublisher(ob) with -inbox
// pgx), router.AddPlugin(ob.RouterPlugin). Its table holds only what has
// not been sent yet. SQLite has no row locks, so there one relay runs per
// database: billing-3, which overlaps billing-2, runs none.
//
// With -inbox pgx (PostgreSQL only) Billing and Mailer run package pgxinbox
// over a pgxpool instead of package inbox over database/sql: handlers get a
// pgx.Tx, and the outbox rows are written in it.
//
// Injected, by default: the Orders producer re-sends 5 % of the events; a
// Billing worker process is SIGKILLed once it has committed an order and its
// relay has had Kafka accept a batch of invoice events: the order is not
// acked yet and the batch's outbox rows are not deleted yet, so the order is
// delivered again and the batch is relayed again; a second Billing instance
// joins and leaves the consumer group (rebalance); the group's offsets are
// deleted and everything is replayed (operator rewind). It ends with
//
//	outputs relayed twice: N (Kafka holds R invoice events for I invoices), skipped by the mailer's inbox: N, second effects: 0
//	effectively-once: orders=O invoices=O emails=O deliveries=D duplicates_skipped=S
//	outbox: pending=0 dead_lettered=0
//
// and exits non-zero if invoices, emails or distinct invoice events differ
// from orders, if an order got a second invoice or email, if an invoice
// event Kafka holds twice was not skipped by the mailer's inbox, if the
// injected relay crash sent nothing twice, or if the outbox still holds
// rows once everything was relayed.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"os/signal"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	_ "github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/jmoiron/sqlx"
	_ "modernc.org/sqlite"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/kafkaoutbox"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

const (
	ordersTopic   = "orders.confirmed"
	invoicesTopic = "invoices.to_send"
	partitions    = 3
)

var (
	role      = flag.String("role", "orchestrator", "internal: orchestrator, billing or mailer")
	brokers   = flag.String("brokers", "", "Kafka bootstrap addresses (default: an in-process kfake broker)")
	dsn       = flag.String("db", "", "postgres://… or mysql://<go-sql-driver DSN> (default: SQLite in a temporary folder)")
	inboxImpl = flag.String("inbox", "database/sql", "database/sql (package inbox over sqlx) or pgx (package pgxinbox over a pgxpool; PostgreSQL only)")
	orders    = flag.Int("orders", 1000, "orders to publish")
	resend    = flag.Float64("resend", 0.05, "share of events the producer publishes twice")
	killAfter = flag.Int("kill-after", 0, "internal: SIGKILL this worker once it has committed N orders and its relay has then had Kafka accept a batch")
	relay     = flag.Bool("relay", true, "internal: run the outbox relay in this Billing worker")
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

// database is the opened -db with its dialect.
type database struct {
	db      *sqlx.DB
	pool    *pgxpool.Pool // -inbox pgx only: db then borrows its connections
	dialect inbox.Dialect
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
		d := &database{dialect: inbox.PostgreSQL}
		if impl == "pgx" {
			pool, err := pgxpool.New(ctx, dsn)
			if err != nil {
				return nil, err
			}
			d.pool, d.db = pool, pgxinbox.DB(pool) // the outbox relay reads through it
			return d, nil
		}
		db, err := sqlx.Open("pgx", dsn)
		d.db = db
		return d, err
	case strings.HasPrefix(dsn, "mysql://"):
		db, err := sqlx.Open("mysql", strings.TrimPrefix(dsn, "mysql://"))
		return &database{db: db, dialect: inbox.MySQL}, err
	case strings.HasPrefix(dsn, "sqlite:"):
		path := strings.TrimPrefix(dsn, "sqlite:")
		params := "_journal_mode=WAL&_busy_timeout=30000&_synchronous=NORMAL"
		db, err := sqlx.Open("sqlite", "file:"+path+"?"+params+"&_txlock=immediate")
		return &database{db: db, dialect: inbox.SQLite}, err
	}
	return nil, fmt.Errorf("-db %q: want postgres://… or mysql://…", dsn)
}

func (d *database) Close() {
	d.db.Close()
	if d.pool != nil {
		d.pool.Close()
	}
}

// newOutbox is the run's outbox, relaying to pub.
func (d *database) newOutbox(run string, pub message.Publisher, logger watermill.LoggerAdapter) (*inbox.Outbox, error) {
	return inbox.NewOutbox(inbox.OutboxConfig{DB: d.db, Dialect: d.dialect, Table: "outbox_" + run, Publisher: pub, Logger: logger})
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
// The business tables have no unique key on order_id, on purpose: the inbox
// alone keeps a second effect out, and one would show as a second row.
func tables(d *database, run string) error {
	stmts := []string{
		"CREATE TABLE IF NOT EXISTS invoices_" + run + " (order_id VARCHAR(64) NOT NULL, amount INTEGER NOT NULL)",
		"CREATE TABLE IF NOT EXISTS emails_sent_" + run + " (order_id VARCHAR(64) NOT NULL)",
		"CREATE TABLE IF NOT EXISTS deliveries_" + run + " (consumer VARCHAR(32) NOT NULL, outcome VARCHAR(16) NOT NULL, message_id VARCHAR(255) NOT NULL)",
	}
	for _, s := range stmts {
		if _, err := d.db.Exec(s); err != nil {
			return err
		}
	}
	return nil
}

// newInbox is the inbox of one worker: package inbox on database/sql, or
// package pgxinbox on the pgx pool. With ob, the messages its handlers
// return are written to ob's outbox in the message's transaction.
func (d *database) newInbox(name, run string, hooks func(string) func(inbox.Event), ob *inbox.Outbox) (*inbox.Inbox, error) {
	if d.pool != nil {
		cfg := pgxinbox.Config{
			Pool: d.pool, Table: "inbox_" + run, Consumer: name,
			OnProcessed: hooks("processed"), OnDuplicate: hooks("duplicate"),
		}
		if ob != nil {
			cfg.Outbox = pgxinbox.OutboxPublisher(ob)
		}
		ib, err := pgxinbox.New(cfg)
		if err != nil {
			return nil, err
		}
		return ib.Inbox, nil
	}
	cfg := inbox.Config{
		DB: d.db, Dialect: d.dialect, Table: "inbox_" + run, Consumer: name,
		OnProcessed: hooks("processed"), OnDuplicate: hooks("duplicate"),
	}
	if ob != nil {
		cfg.Outbox = ob.Publisher
	}
	return inbox.New(cfg)
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
		return func(e inbox.Event) {
			// Outside the inbox transaction, before the ack: survives a SIGKILL.
			if _, err := d.db.Exec(d.db.Rebind("INSERT INTO deliveries_"+run+" (consumer, outcome, message_id) VALUES (?, ?, ?)"),
				name, outcome, e.MessageID); err != nil {
				log.Printf("%s: record delivery: %v", *instance, err)
			}
		}
	}
	// The router logs handler errors (nacks) and the relay's failed rounds
	// to stderr; nothing else.
	errLog := errorLogger{*instance}
	var ob *inbox.Outbox
	crash := &crashAfterPublish{name: *instance}
	if name == "billing" {
		// The outbox relay's Kafka publisher, keyed by order as Orders':
		// kafkaoutbox sends each relay round's messages in one batch
		// (watermill-kafka's publisher waits for each message's ack).
		relayConfig := kafkaoutbox.DefaultSaramaConfig()
		relayConfig.Version = sarama.V2_8_0_0
		kafkaPub, err := kafkaoutbox.NewPublisher(kafka.PublisherConfig{
			Brokers: strings.Split(*brokers, ","), Marshaler: kafka.NewWithPartitioningMarshaler(orderKey),
			OverwriteSaramaConfig: relayConfig,
		}, logger)
		if err != nil {
			return err
		}
		defer kafkaPub.Close()
		crash.Publisher = kafkaPub
		// The orchestrator created the table (ob.InitializeSchema).
		if ob, err = d.newOutbox(run, crash, errLog); err != nil {
			return err
		}
	}
	ib, err := d.newInbox(name, run, record, ob)
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
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, errLog)
	if err != nil {
		return err
	}
	router.AddMiddleware(mws...)
	router.AddPlugin(ib.RouterPlugin) // a missing inbox table stops router.Run
	if ob != nil && *relay {
		router.AddPlugin(ob.RouterPlugin) // the relay runs while the router runs
	}
	var committed atomic.Int64
	if name == "billing" {
		router.AddHandler("billing", ordersTopic, sub, invoicesTopic, unusedPublisher{}, func(msg *message.Message) ([]*message.Message, error) {
			orderID := msg.Metadata.Get("order_id")
			if err := d.execInTx(msg.Context(), "INSERT INTO invoices_"+run+" (order_id, amount) VALUES (?, ?)", orderID, 100); err != nil {
				return nil, err
			}
			if *killAfter > 0 {
				inbox.AfterCommit(msg.Context(), func() {
					if committed.Add(1) != int64(*killAfter) {
						return
					}
					// Hold this order's ack; the relay's next accepted
					// batch kills the process before it deletes the rows.
					log.Printf("%s: committed order %s; SIGKILL before its ack, once the relay has had Kafka accept a batch", *instance, orderID)
					crash.armed.Store(true)
					time.Sleep(30 * time.Second)
					log.Printf("%s: the relay published nothing within 30 s; SIGKILL anyway", *instance)
					syscall.Kill(os.Getpid(), syscall.SIGKILL)
				})
			}
			invoice := message.NewMessage(watermill.NewUUID(), []byte(`{"amount":100}`))
			invoice.Metadata.Set("order_id", orderID)
			return []*message.Message{invoice}, nil // to the outbox, in this transaction
		})
	} else {
		router.AddConsumerHandler("mailer", invoicesTopic, sub, func(msg *message.Message) error {
			return d.execInTx(msg.Context(), "INSERT INTO emails_sent_"+run+" (order_id) VALUES (?)", msg.Metadata.Get("order_id"))
		})
	}
	return router.Run(ctx)
}

// crashAfterPublish is the relay's Kafka publisher; once armed, it SIGKILLs
// the process as soon as Kafka has accepted a batch, before the relay can
// delete the batch's outbox rows: the next relay sends the batch again.
type crashAfterPublish struct {
	message.Publisher
	name  string
	armed atomic.Bool
}

func (p *crashAfterPublish) Publish(topic string, msgs ...*message.Message) error {
	err := p.Publisher.Publish(topic, msgs...)
	if err == nil && p.armed.Load() {
		log.Printf("%s: SIGKILL: Kafka accepted %d invoice events, their outbox rows are not deleted yet", p.name, len(msgs))
		syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {}
	}
	return err
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
