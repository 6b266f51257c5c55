// Command quickstart shows the inbox skipping a duplicate delivery, with
// nothing to install: SQLite in a temporary folder and Watermill's in-memory
// GoChannel pub/sub. Run it from the repository root:
//
//	go run ./_examples/quickstart
//
// Three order events are published, and the second one twice (as a producer
// retry would). The handler creates one invoice per order, inside the inbox
// transaction, so the repeated event is skipped and acknowledged.
package main

import (
	"context"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jmoiron/sqlx"
	_ "modernc.org/sqlite"

	"github.com/watermill-inbox/inbox"
)

func main() {
	if err := run(); err != nil {
		log.Fatal(err)
	}
}

func run() error {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "inbox-quickstart")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)

	// The SQLite settings the inbox recommends: WAL, a busy timeout, and
	// transactions that take the write lock at BEGIN.
	dsn := "file:" + filepath.Join(dir, "shop.db") +
		"?_journal_mode=WAL&_busy_timeout=10000&_synchronous=NORMAL&_txlock=immediate"
	db, err := sqlx.Open("sqlite", dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	if _, err := db.Exec(`CREATE TABLE invoices (order_id TEXT PRIMARY KEY, amount INTEGER NOT NULL)`); err != nil {
		return err
	}

	// One signal per delivery handled, processed or skipped.
	outcomes := make(chan struct{}, 16)
	ib, err := inbox.New(inbox.Config{
		DB:          db,
		OnProcessed: func(inbox.Event) { outcomes <- struct{}{} },
		OnDuplicate: func(e inbox.Event) {
			fmt.Printf("duplicate skipped: %s (message %s)\n", e.Message.Metadata.Get("order_id"), e.MessageID)
			outcomes <- struct{}{}
		},
	})
	if err != nil {
		return err
	}
	if err := ib.InitializeSchema(ctx); err != nil {
		return err
	}

	logger := watermill.NopLogger{}
	pubSub := gochannel.NewGoChannel(gochannel.Config{}, logger)
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		return err
	}
	// Retry, a Timeout per attempt and Recoverer, in the order that gives
	// each retry a fresh transaction, the inbox last.
	mws, err := ib.Middlewares(inbox.MiddlewaresConfig{
		Retry: middleware.Retry{InitialInterval: 10 * time.Millisecond},
	})
	if err != nil {
		return err
	}
	router.AddMiddleware(mws...)

	router.AddConsumerHandler("billing", "orders.confirmed", pubSub, func(msg *message.Message) error {
		// The inbox transaction: the invoice commits together with the
		// inbox row, or not at all.
		tx, ok := inbox.TxFromContext(msg.Context())
		if !ok {
			return inbox.MissingTxError(msg.Context()) // says which middleware or package is missing
		}
		orderID := msg.Metadata.Get("order_id")
		if _, err := tx.ExecContext(msg.Context(),
			`INSERT INTO invoices (order_id, amount) VALUES (?, ?)`, orderID, 100); err != nil {
			return err
		}
		fmt.Printf("processed: %s -> invoice created (message %s)\n", orderID, msg.UUID)
		return nil
	})
	go func() {
		if err := router.Run(ctx); err != nil {
			log.Print(err)
		}
	}()
	<-router.Running()

	var events []*message.Message
	for i := 1; i <= 3; i++ {
		msg := message.NewMessage(watermill.NewUUID(), []byte(`{"amount":100}`))
		msg.Metadata.Set("order_id", fmt.Sprintf("order-%d", i))
		events = append(events, msg)
	}
	deliveries := []*message.Message{events[0], events[1], events[1], events[2]}
	for _, msg := range deliveries {
		// Publish a copy, as a broker delivers one: same UUID, new message.
		// Wait for each outcome so that the output reads in order.
		if err := pubSub.Publish("orders.confirmed", msg.Copy()); err != nil {
			return err
		}
		select {
		case <-outcomes:
		case <-time.After(30 * time.Second):
			return fmt.Errorf("timed out waiting for the router")
		}
	}
	if err := router.Close(); err != nil {
		return err
	}

	var invoices int
	if err := db.Get(&invoices, `SELECT COUNT(*) FROM invoices`); err != nil {
		return err
	}
	fmt.Printf("orders=%d deliveries=%d invoices=%d\n", len(events), len(deliveries), invoices)
	if invoices != len(events) {
		return fmt.Errorf("want %d invoices, got %d", len(events), invoices)
	}
	return nil
}
