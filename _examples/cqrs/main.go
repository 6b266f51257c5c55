// Command cqrs shows the inbox under Watermill's CQRS component: an event
// handler that issues one invoice per placed order, with the inbox of
// package inbox (database/sql) or of package pgxinbox (pgx), on PostgreSQL,
// and the InvoiceIssued events it publishes written to the inbox's outbox
// (inbox.Outbox) in the same transaction, from which the outbox relay sends
// them to the broker (a GoChannel here). Run it from this folder:
//
//	go run . [-inbox database/sql|pgx] [-db postgres://…]
//
// What it shows:
//   - the router handler's name is the CQRS event handler's name, so that is
//     the inbox consumer;
//   - inbox.TxFromContext (pgxinbox.TxFromContext) works on the ctx the
//     CQRS handler receives;
//   - a CQRS handler cannot return messages, so it publishes through an
//     EventBus over inbox.ContextOutbox, which writes each event to the
//     outbox of the handled message's transaction;
//   - an event published again through an EventBus gets a new UUID, so
//     Config.MessageID reads the business id (the order id) and the second
//     OrderPlaced of an order is skipped;
//   - a handler that fails after publishing leaves no outbox row: only the
//     retry that commits writes its InvoiceIssued;
//   - the relay sends each InvoiceIssued once and deletes its row: the
//     broker's subscriber gets one per order, and the outbox ends empty.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"maps"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/components/cqrs"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// OrderPlaced is what the handler consumes; InvoiceIssued what it publishes.
type OrderPlaced struct {
	OrderID string `json:"order_id"`
}

type InvoiceIssued struct {
	OrderID string `json:"order_id"`
}

// handlerName is the CQRS event handler's name, and so the inbox consumer.
const handlerName = "IssueInvoiceOnOrderPlaced"

func main() {
	kind := flag.String("inbox", "database/sql", "database/sql (package inbox) or pgx (package pgxinbox)")
	dsn := flag.String("db", envOr("INBOX_TEST_POSTGRES_DSN", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"), "PostgreSQL DSN")
	flag.Parse()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	r, err := run(ctx, *kind, *dsn)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%s inbox: %d orders placed (one twice), handler called %d times (one failure), %d processed, %d duplicate skipped, %d invoices, consumer %q\n",
		*kind, r.Published, r.Calls, r.Processed, r.Duplicates, r.Invoices, r.Consumer)
	fmt.Printf("outbox relay: %d InvoiceIssued relayed, received %v, outbox pending=%d dead_lettered=%d\n",
		r.Relayed, r.Received, r.OutboxPending, r.DeadLettered)
	if err := r.Check(); err != nil {
		log.Fatal(err)
	}
}

// Result is what one run did.
type Result struct {
	Published, Calls, Processed, Duplicates, Invoices int
	Consumer                                          string
	// Relayed is the number of messages the outbox relay reported sent
	// (OutboxConfig.OnRound); Received counts the InvoiceIssued events the
	// broker's subscriber got, by order id.
	Relayed  int
	Received map[string]int
	// OutboxPending and DeadLettered are the outbox's Stats at the end.
	OutboxPending, DeadLettered int
}

// Check reports what is not exactly once.
func (r Result) Check() error {
	var errs []error
	want := func(what string, got, want int) {
		if got != want {
			errs = append(errs, fmt.Errorf("%s = %d, want %d", what, got, want))
		}
	}
	want("processed", r.Processed, 2)
	want("duplicates", r.Duplicates, 1)
	want("handler calls", r.Calls, 3)
	want("invoices", r.Invoices, 2)
	want("InvoiceIssued relayed", r.Relayed, 2)
	want("outbox rows pending", r.OutboxPending, 0)
	want("outbox dead letters", r.DeadLettered, 0)
	want("InvoiceIssued received, orders", len(r.Received), 2)
	for _, id := range []string{"o-1", "o-2"} {
		want("InvoiceIssued received for "+id, r.Received[id], 1)
	}
	if r.Consumer != handlerName {
		errs = append(errs, fmt.Errorf("consumer = %q, want %q", r.Consumer, handlerName))
	}
	return errors.Join(errs...)
}

// run publishes o-1, o-1 again (a new UUID) and o-2 to the handler, which
// fails o-2's first try after publishing, and returns what happened.
func run(ctx context.Context, kind, dsn string) (Result, error) {
	var r Result
	logger := watermill.NopLogger{}
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		return r, err
	}
	defer pool.Close()
	db := pgxinbox.DB(pool) // database/sql over the same pool, for the database/sql inbox and the reads
	defer db.Close()

	sfx := strings.ToLower(watermill.NewShortUUID()) // unquoted names below fold to lower case
	names := tables{inbox: "cqrs_inbox_" + sfx, invoices: "cqrs_invoices_" + sfx, outbox: "cqrs_outbox_" + sfx}
	topic := "cqrs_invoices_" + sfx
	defer func() {
		for _, t := range []string{names.inbox, names.invoices, names.outbox, names.outbox + "_dead"} {
			db.ExecContext(context.WithoutCancel(ctx), "DROP TABLE IF EXISTS "+t)
		}
	}()
	if _, err := db.ExecContext(ctx, "CREATE TABLE "+names.invoices+" (order_id text PRIMARY KEY)"); err != nil {
		return r, err
	}

	// The broker the outbox relay sends InvoiceIssued to, and a subscriber
	// of it. BlockPublishUntilSubscriberAck: the relay's publish returns
	// once the subscriber has acked, so an empty outbox means every event
	// has arrived.
	broker := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, logger)
	defer broker.Close()
	received, err := receiveInvoices(ctx, broker, topic)
	if err != nil {
		return r, err
	}
	var relayed atomic.Int32
	ob, err := inbox.NewOutbox(inbox.OutboxConfig{
		DB: db, Table: names.outbox, Publisher: broker,
		OnRound: func(round inbox.OutboxRound) { relayed.Add(int32(round.Relayed)) },
	})
	if err != nil {
		return r, err
	}
	if err := ob.InitializeSchema(ctx); err != nil {
		return r, err
	}

	var c counters
	ib, insertInvoice, closeInbox, err := newInbox(ctx, kind, db, pool, ob, names, &c)
	if err != nil {
		return r, err
	}
	defer closeInbox()
	pubsub := gochannel.NewGoChannel(gochannel.Config{}, logger)
	router, err := newRouter(logger, pubsub, ib, ob, topic, invoiceHandler(&c, insertInvoice))
	if err != nil {
		return r, err
	}
	if r.Published, err = placeOrders(ctx, router, pubsub, ob, &c); err != nil {
		return r, err
	}

	st, err := ob.Stats(ctx)
	if err != nil {
		return r, err
	}
	r.OutboxPending, r.DeadLettered, r.Relayed = int(st.Pending), int(st.DeadLettered), int(relayed.Load())
	r.Received = received.counts()
	r.Calls, r.Processed, r.Duplicates = int(c.calls.Load()), int(c.processed.Load()), int(c.duplicates.Load())
	r.Consumer, _ = c.consumer.Load().(string)
	if err := db.GetContext(ctx, &r.Invoices, "SELECT count(*) FROM "+names.invoices); err != nil {
		return r, err
	}
	var inboxConsumer string
	if err := db.GetContext(ctx, &inboxConsumer, "SELECT DISTINCT consumer FROM "+names.inbox); err != nil {
		return r, err
	}
	if inboxConsumer != r.Consumer {
		return r, fmt.Errorf("inbox rows' consumer %q, handler's name %q", inboxConsumer, r.Consumer)
	}
	return r, nil
}

// tables are the names of one run's tables.
type tables struct{ inbox, invoices, outbox string }

// counters is what the inbox's hooks and the handler count.
type counters struct {
	processed, duplicates, calls, failed atomic.Int32
	consumer                             atomic.Value // the handler's name, as the handler's ctx carries it
}

// tally counts the InvoiceIssued events the broker's subscriber got, by
// order id.
type tally struct {
	mu       sync.Mutex
	received map[string]int
}

// counts returns a copy of the counts so far.
func (t *tally) counts() map[string]int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return maps.Clone(t.received)
}

// receiveInvoices subscribes to topic on broker and counts, until ctx ends,
// the InvoiceIssued events that arrive.
func receiveInvoices(ctx context.Context, broker message.Subscriber, topic string) (*tally, error) {
	issued, err := broker.Subscribe(ctx, topic)
	if err != nil {
		return nil, err
	}
	t := &tally{received: map[string]int{}}
	go func() {
		for msg := range issued {
			var e InvoiceIssued
			if err := json.Unmarshal(msg.Payload, &e); err != nil {
				e.OrderID = "unreadable: " + err.Error()
			}
			t.mu.Lock()
			t.received[e.OrderID]++
			t.mu.Unlock()
			msg.Ack()
		}
	}()
	return t, nil
}

// newInbox makes the inbox of kind (database/sql or pgx) on the table
// names.inbox, its schema included, with the outbox ob and hooks that count
// into c. It returns the inbox the router's middleware comes from, the
// handler's insert of an invoice in the inbox's transaction, and what
// closes the inbox.
func newInbox(ctx context.Context, kind string, db *sqlx.DB, pool *pgxpool.Pool, ob *inbox.Outbox, names tables, c *counters) (
	ib *inbox.Inbox, insertInvoice func(ctx context.Context, orderID string) error, closeInbox func(), err error,
) {
	// An EventBus re-publish has a new UUID: deduplicate by the order id.
	orderID := func(msg *message.Message) (string, error) {
		var e OrderPlaced
		if err := json.Unmarshal(msg.Payload, &e); err != nil {
			return "", err
		}
		return "order-placed/" + e.OrderID, nil
	}
	onProcessed := func(inbox.Event) { c.processed.Add(1) }
	onDuplicate := func(inbox.Event) { c.duplicates.Add(1) }
	insert := "INSERT INTO " + names.invoices + " (order_id) VALUES ($1)"
	switch kind {
	case "database/sql":
		sqlInbox, err := inbox.New(inbox.Config{
			DB: db, Table: names.inbox, MessageID: orderID, OnProcessed: onProcessed, OnDuplicate: onDuplicate,
			Outbox: ob.Publisher, // events published in the handler go to the outbox, in its transaction
		})
		if err != nil {
			return nil, nil, nil, err
		}
		if err := sqlInbox.InitializeSchema(ctx); err != nil {
			return nil, nil, nil, err
		}
		return sqlInbox, func(ctx context.Context, orderID string) error {
			tx, ok := inbox.TxFromContext(ctx)
			if !ok {
				return inbox.MissingTxError(ctx)
			}
			_, err := tx.ExecContext(ctx, insert, orderID)
			return err
		}, func() {}, nil
	case "pgx":
		pgxInbox, err := pgxinbox.New(pgxinbox.Config{
			Pool: pool, Table: names.inbox, MessageID: orderID, OnProcessed: onProcessed, OnDuplicate: onDuplicate,
			Outbox: pgxinbox.OutboxPublisher(ob), // the same, in the pgx transaction
		})
		if err != nil {
			return nil, nil, nil, err
		}
		if err := pgxInbox.InitializeSchema(ctx); err != nil {
			pgxInbox.Close()
			return nil, nil, nil, err
		}
		return pgxInbox.Inbox, func(ctx context.Context, orderID string) error {
			tx, ok := pgxinbox.TxFromContext(ctx)
			if !ok {
				return pgxinbox.MissingTxError(ctx)
			}
			_, err := tx.Exec(ctx, insert, orderID)
			return err
		}, func() { pgxInbox.Close() }, nil
	default:
		return nil, nil, nil, fmt.Errorf("-inbox %q: want database/sql or pgx", kind)
	}
}

// invoiceHandler is the CQRS event handler: it inserts the order's invoice
// in the inbox's transaction and publishes InvoiceIssued through bus (the
// outbox of that transaction); o-2's first try fails after both, which
// rolls them back.
func invoiceHandler(c *counters, insertInvoice func(ctx context.Context, orderID string) error) func(bus *cqrs.EventBus) cqrs.EventHandler {
	return func(bus *cqrs.EventBus) cqrs.EventHandler {
		return cqrs.NewEventHandler(handlerName, func(ctx context.Context, e *OrderPlaced) error {
			c.calls.Add(1)
			c.consumer.Store(message.HandlerNameFromCtx(ctx))
			if err := insertInvoice(ctx, e.OrderID); err != nil {
				return err
			}
			if err := bus.Publish(ctx, &InvoiceIssued{OrderID: e.OrderID}); err != nil {
				return err
			}
			if e.OrderID == "o-2" && c.failed.Add(1) == 1 {
				return errors.New("fails once after publishing") // rolls the invoice and the outbox row back
			}
			return nil
		})
	}
}

// newRouter makes the router that runs the handler on the "orders" topic of
// pubsub: the inbox's middlewares around it, the inbox's and the outbox's
// plugins, and an EventBus that publishes to topic through the outbox of
// the handled message's transaction, which handler receives.
func newRouter(logger watermill.LoggerAdapter, pubsub message.Subscriber, ib *inbox.Inbox, ob *inbox.Outbox, topic string,
	handler func(bus *cqrs.EventBus) cqrs.EventHandler,
) (*message.Router, error) {
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		return nil, err
	}
	// Retry, a Timeout per attempt and Recoverer around the inbox, the
	// inbox last: a failed attempt is retried in a fresh transaction.
	mws, err := ib.Middlewares(inbox.MiddlewaresConfig{Retry: middleware.Retry{InitialInterval: 10 * time.Millisecond}})
	if err != nil {
		return nil, err
	}
	router.AddMiddleware(mws...)
	router.AddPlugin(ib.RouterPlugin) // a missing inbox table stops router.Run
	router.AddPlugin(ob.RouterPlugin) // the outbox relay runs while the router runs
	// Events the handler publishes go to the outbox of its transaction.
	outboxBus, err := cqrs.NewEventBusWithConfig(inbox.ContextOutbox{}, cqrs.EventBusConfig{
		GeneratePublishTopic: func(cqrs.GenerateEventPublishTopicParams) (string, error) { return topic, nil },
		Marshaler:            cqrs.JSONMarshaler{},
	})
	if err != nil {
		return nil, err
	}
	processor, err := cqrs.NewEventProcessorWithConfig(router, cqrs.EventProcessorConfig{
		GenerateSubscribeTopic: func(cqrs.EventProcessorGenerateSubscribeTopicParams) (string, error) { return "orders", nil },
		SubscriberConstructor: func(cqrs.EventProcessorSubscriberConstructorParams) (message.Subscriber, error) {
			return pubsub, nil
		},
		Marshaler: cqrs.JSONMarshaler{},
	})
	if err != nil {
		return nil, err
	}
	if err := processor.AddHandlers(handler(outboxBus)); err != nil {
		return nil, err
	}
	return router, nil
}

// placeOrders runs router, publishes o-1, o-1 again and o-2 to pubsub's
// "orders" topic, waits until the inbox has processed or skipped all three
// and the relay has emptied the outbox ob, and stops the router. It returns
// how many orders it published.
func placeOrders(ctx context.Context, router *message.Router, pubsub message.Publisher, ob *inbox.Outbox, c *counters) (published int, err error) {
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- router.Run(runCtx) }()
	<-router.Running()
	defer func() {
		stop()
		if runErr := <-done; err == nil {
			err = runErr
		}
	}()

	orderBus, err := cqrs.NewEventBusWithConfig(pubsub, cqrs.EventBusConfig{
		GeneratePublishTopic: func(cqrs.GenerateEventPublishTopicParams) (string, error) { return "orders", nil },
		Marshaler:            cqrs.JSONMarshaler{},
	})
	if err != nil {
		return published, err
	}
	for _, id := range []string{"o-1", "o-1", "o-2"} {
		if err := orderBus.Publish(ctx, &OrderPlaced{OrderID: id}); err != nil {
			return published, err
		}
		published++
	}
	for c.processed.Load()+c.duplicates.Load() < 3 && ctx.Err() == nil {
		time.Sleep(10 * time.Millisecond)
	}
	// Every transaction has committed; the relay empties the outbox.
	for pending := int64(-1); pending != 0; time.Sleep(10 * time.Millisecond) {
		st, err := ob.Stats(ctx)
		if err != nil {
			return published, fmt.Errorf("waiting for the outbox relay to send the InvoiceIssued events (%d pending when last read): %w", pending, err)
		}
		pending = st.Pending
	}
	return published, nil
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// isUnreachable reports a PostgreSQL that is not running (for the test's
// local skip).
func isUnreachable(err error) bool {
	var netErr *net.OpError
	return errors.As(err, &netErr)
}
