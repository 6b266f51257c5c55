package inbox_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"path/filepath"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
	_ "modernc.org/sqlite"

	"github.com/watermill-inbox/inbox"
)

// The middleware on SQLite, called directly with the same message twice, as
// a router would on a redelivery: the handler runs once.
func Example() {
	dir, _ := os.MkdirTemp("", "inbox-example")
	defer os.RemoveAll(dir)
	db, err := sqlx.Open("sqlite", "file:"+filepath.Join(dir, "app.db")+"?_journal_mode=WAL&_busy_timeout=10000&_txlock=immediate")
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	db.MustExec(`CREATE TABLE invoices (order_id TEXT PRIMARY KEY)`)

	ib, err := inbox.New(inbox.Config{DB: db, Consumer: "billing"})
	if err != nil {
		log.Fatal(err)
	}
	if err := ib.InitializeSchema(context.Background()); err != nil {
		log.Fatal(err)
	}

	handler := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := inbox.TxFromContext(msg.Context())
		_, err := tx.ExecContext(msg.Context(), `INSERT INTO invoices (order_id) VALUES (?)`, string(msg.Payload))
		fmt.Println("invoice created for", string(msg.Payload))
		return nil, err
	})

	msg := message.NewMessage(watermill.NewUUID(), []byte("order-1"))
	for range 2 {
		if _, err := handler(msg.Copy()); err != nil {
			log.Fatal(err)
		}
	}
	var invoices int
	_ = db.Get(&invoices, `SELECT COUNT(*) FROM invoices`)
	fmt.Println("invoices:", invoices)
	// Output:
	// invoice created for order-1
	// invoices: 1
}

// Wiring the inbox into a router: one AddMiddleware line, after Recoverer and
// Retry.
func ExampleInbox_Middleware() {
	var db *sqlx.DB // your database
	ib, err := inbox.New(inbox.Config{DB: db})
	if err != nil {
		return
	}
	router, _ := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	router.AddMiddleware(ib.Middleware)
}

// A handler writes through the inbox transaction.
func ExampleTxFromContext() {
	_ = func(msg *message.Message) error {
		tx, ok := inbox.TxFromContext(msg.Context())
		if !ok {
			return inbox.MissingTxError(msg.Context())
		}
		_, err := tx.ExecContext(msg.Context(), `INSERT INTO invoices (order_id) VALUES (?)`, msg.Metadata.Get("order_id"))
		return err
	}
}

// A handler run without the inbox middleware finds no transaction, and
// MissingTxError says why (under a pgxinbox.Inbox it names
// pgxinbox.TxFromContext instead).
func ExampleMissingTxError() {
	msg := message.NewMessage(watermill.NewUUID(), nil) // not claimed by any inbox
	_, ok := inbox.TxFromContext(msg.Context())
	fmt.Println(ok)
	fmt.Println(inbox.MissingTxError(msg.Context()))
	// Output:
	// false
	// inbox: no inbox transaction in the message context: no Inbox.Middleware runs around this handler (add it with router.AddMiddleware(ib.Middleware) or to the handler), or the context is not msg.Context()
}
