// Command service is a whole consumer service wired the way the README's
// sections describe it, in one program with one shutdown: the inbox with
// Retry, Timeout, Recoverer and a poison queue around it, the outbox and its
// relay, the purge with its window read from Kafka, and the metrics module
// served over HTTP. It needs nothing installed: Kafka is an in-process kfake
// broker and the database SQLite in a temporary folder. Run it with
//
//	cd _examples/service && go run .
//
// Five orders are published, one of them twice (a producer's retry); the
// handler writes an invoice and returns an "invoice created" event, which the
// relay sends to the invoices topic. The program checks that four invoices
// exist and four events arrived, prints some of the scrape, and shuts down
// in the order each part needs.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/twmb/franz-go/pkg/kfake"
	_ "modernc.org/sqlite"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/kafkaoutbox"
	"github.com/watermill-inbox/inbox/kafkaretention"
	"github.com/watermill-inbox/inbox/metrics"
)

func main() {
	if err := run(); err != nil {
		log.Fatal(err)
	}
}

func run() error {
	ctx := context.Background()
	logger := watermill.NewStdLogger(false, false)

	// The broker and the database: replace with yours.
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(4, "orders", "invoices", "poison"))
	if err != nil {
		return err
	}
	defer cluster.Close()
	brokers := cluster.ListenAddrs()
	dir, err := os.MkdirTemp("", "inbox-service")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	db, err := sqlx.Open("sqlite", "file:"+filepath.Join(dir, "service.db")+
		"?_journal_mode=WAL&_busy_timeout=10000&_synchronous=NORMAL&_txlock=immediate")
	if err != nil {
		return err
	}
	defer db.Close() // last: everything below uses it
	if _, err := db.Exec("CREATE TABLE invoices (order_id TEXT PRIMARY KEY, amount INTEGER NOT NULL)"); err != nil {
		return err
	}

	// Metrics: one registry for the inbox, the outbox and the purge.
	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg)
	if err != nil {
		return err
	}

	// The outbox: its relay publishes with kafkaoutbox (a round's messages
	// in one batch, each message's outcome known).
	pub, err := kafkaoutbox.NewPublisher(kafka.PublisherConfig{Brokers: brokers, Marshaler: kafka.DefaultMarshaler{}}, logger)
	if err != nil {
		return err
	}
	ob, err := inbox.NewOutbox(m.InstrumentOutbox(inbox.OutboxConfig{DB: db, Publisher: pub, Logger: logger}))
	if err != nil {
		return err
	}
	if err := ob.InitializeSchema(ctx); err != nil { // or your migrations: inbox schema -outbox-table …
		return err
	}
	if err := m.WatchOutbox(ob); err != nil { // depth and oldest message, read at each scrape
		return err
	}

	// The inbox, its outputs to the outbox.
	ib, err := inbox.New(m.Instrument(inbox.Config{DB: db, Outbox: ob.Publisher}))
	if err != nil {
		return err
	}
	if err := ib.InitializeSchema(ctx); err != nil { // or your migrations: inbox schema -apply
		return err
	}
	if err := m.WatchTable(db, nil, ""); err != nil { // the table's estimated rows, at each scrape
		return err
	}

	// The purge: its window is the topics' retention, read from Kafka.
	window, err := kafkaretention.New(kafkaretention.Config{Brokers: brokers, Topics: []string{"orders"}})
	if err != nil {
		return err
	}
	purger, err := inbox.NewPurger(m.InstrumentPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Window: window}, Logger: logger}))
	if err != nil {
		return err
	}

	// The router: the inbox's middlewares (Retry, a Timeout per attempt,
	// Recoverer; a poison queue for what a retry cannot fix), its plugins.
	poison, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: brokers, Marshaler: kafka.DefaultMarshaler{}}, logger)
	if err != nil {
		return err
	}
	defer poison.Close()
	mws, err := ib.Middlewares(inbox.MiddlewaresConfig{PoisonQueue: poison, PoisonTopic: "poison"})
	if err != nil {
		return err
	}
	subCfg := kafka.DefaultSaramaSubscriberConfig()
	subCfg.Consumer.Offsets.Initial = sarama.OffsetOldest
	sub, err := kafka.NewSubscriber(kafka.SubscriberConfig{Brokers: brokers, Unmarshaler: kafka.DefaultMarshaler{},
		OverwriteSaramaConfig: subCfg, ConsumerGroup: "billing"}, logger)
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		return err
	}
	router.AddMiddleware(mws...)
	router.AddPlugin(ib.RouterPlugin, ob.RouterPlugin, purger.RouterPlugin)
	router.AddHandler("billing", "orders", sub, "invoices", nil, func(msg *message.Message) ([]*message.Message, error) {
		tx, ok := inbox.TxFromContext(msg.Context()) // the inbox's transaction: the invoice commits with the claim
		if !ok {
			return nil, inbox.MissingTxError(msg.Context())
		}
		if _, err := tx.ExecContext(msg.Context(), "INSERT INTO invoices (order_id, amount) VALUES (?, ?)", string(msg.Payload), 100); err != nil {
			return nil, err
		}
		// Returned messages go to the outbox in the same transaction.
		return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("invoice for "+string(msg.Payload)))}, nil
	})

	// Metrics over HTTP (on a port of its own in a real service).
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: promhttp.HandlerFor(reg, promhttp.HandlerOpts{}), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()

	runErr := make(chan error, 1)
	go func() { runErr <- router.Run(ctx) }()
	select {
	case <-router.Running():
	case err := <-runErr:
		return err // a missing table, a refused window: the plugins' checks
	}

	if err := publishOrders(brokers, logger); err != nil {
		return err
	}
	events, err := readInvoiceEvents(brokers, logger, 4)
	if err != nil {
		return err
	}
	var invoices int
	if err := db.Get(&invoices, "SELECT COUNT(*) FROM invoices"); err != nil {
		return err
	}
	fmt.Printf("5 order messages, one sent twice: %d invoices, %d invoice events downstream\n", invoices, len(events))
	if err := printScrape("http://" + ln.Addr().String() + "/metrics"); err != nil {
		return err
	}

	// Shutdown, in order: the router (its handlers finish; the plugins
	// stop), the relay's and the purge's rounds in progress (with a context
	// of their own: router.Run's has ended), then what they used.
	if err := router.Close(); err != nil {
		return err
	}
	if err := <-runErr; err != nil {
		return err
	}
	shutdownCtx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := errors.Join(ob.WaitStopped(shutdownCtx), purger.WaitStopped(shutdownCtx)); err != nil {
		return err
	}
	if err := errors.Join(window.Close(), pub.Close(), sub.Close()); err != nil {
		return err
	}
	if invoices != 4 || len(events) != 4 {
		return fmt.Errorf("%d invoices and %d events, want 4 of each", invoices, len(events))
	}
	return nil
}

// publishOrders publishes orders o-1 to o-5, and o-3 a second time with
// the same UUID, as a producer's retry does.
func publishOrders(brokers []string, logger watermill.LoggerAdapter) error {
	p, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: brokers, Marshaler: kafka.DefaultMarshaler{}}, logger)
	if err != nil {
		return err
	}
	defer p.Close()
	var retry *message.Message
	for i := 1; i <= 4; i++ {
		msg := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf("o-%d", i)))
		if i == 3 {
			retry = msg.Copy()
		}
		if err := p.Publish("orders", msg); err != nil {
			return err
		}
	}
	return p.Publish("orders", retry)
}

// readInvoiceEvents reads n messages from the invoices topic, waiting up to
// 30 s, and returns their payloads.
func readInvoiceEvents(brokers []string, logger watermill.LoggerAdapter, n int) ([]string, error) {
	cfg := kafka.DefaultSaramaSubscriberConfig()
	cfg.Consumer.Offsets.Initial = sarama.OffsetOldest
	sub, err := kafka.NewSubscriber(kafka.SubscriberConfig{Brokers: brokers, Unmarshaler: kafka.DefaultMarshaler{},
		OverwriteSaramaConfig: cfg, ConsumerGroup: "reader"}, logger)
	if err != nil {
		return nil, err
	}
	defer sub.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	msgs, err := sub.Subscribe(ctx, "invoices")
	if err != nil {
		return nil, err
	}
	var got []string
	for len(got) < n {
		select {
		case msg := <-msgs:
			got = append(got, string(msg.Payload))
			msg.Ack()
		case <-ctx.Done():
			return got, fmt.Errorf("%d of %d invoice events after 30 s", len(got), n)
		}
	}
	return got, nil
}

// printScrape prints the scrape's lines about messages and the outbox.
func printScrape(url string) error {
	resp, err := http.Get(url)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	for _, line := range strings.Split(string(body), "\n") {
		if strings.HasPrefix(line, "inbox_messages_total") || strings.HasPrefix(line, "inbox_outbox_messages_relayed_total") ||
			strings.HasPrefix(line, "inbox_outbox_pending") {
			fmt.Println("  " + line)
		}
	}
	return nil
}
