package inbox_test

import (
	"path/filepath"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
)

// A router that takes longer than RouterPluginStartTimeout to start running
// (here a plugin after the outbox's that waits for something: migrations, a
// leader lock) gets its relay once it runs. RouterPlugin's goroutine gave up
// after 5 minutes, and the outputs handlers committed then stayed in the
// outbox for as long as the process lived, while the broker worked.
func TestOutboxRelayStartsWhenTheRouterStartsLate(t *testing.T) {
	defer inbox.SetRouterStartWarning(inbox.SetRouterStartWarning(300 * time.Millisecond))
	db := openSQLite(t, filepath.Join(t.TempDir(), "outbox.db"))
	broker := newBrokerStub()
	ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Dialect: inbox.SQLite, Table: "outbox_late", Publisher: broker, PollInterval: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.InitializeSchema(t.Context()); err != nil {
		t.Fatal(err)
	}
	ib, err := inbox.New(inbox.Config{DB: db, Dialect: inbox.SQLite, Table: "inbox_late", Outbox: ob.Publisher})
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.InitializeSchema(t.Context()); err != nil {
		t.Fatal(err)
	}
	in := newFeed()
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r.AddPlugin(ob.RouterPlugin)
	r.AddPlugin(func(*message.Router) error { time.Sleep(time.Second); return nil })
	r.AddMiddleware(ib.Middleware)
	r.AddHandler("billing", "orders", in, "invoices", broker, func(msg *message.Message) ([]*message.Message, error) {
		return []*message.Message{message.NewMessage(msg.UUID+"-invoice", []byte("invoice"))}, nil
	})
	go func() { _ = r.Run(t.Context()) }()
	defer r.Close()
	<-r.Running()
	order := message.NewMessage(watermill.NewUUID(), []byte("order"))
	if !in.deliver(t, order) {
		t.Fatal("nacked")
	}
	deadline := time.Now().Add(10 * time.Second)
	for len(broker.uuids("invoices")) == 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if got := broker.uuids("invoices"); len(got) != 1 {
		st, _ := ob.Stats(t.Context())
		t.Errorf("10 s after the commit, with the router running and the broker taking everything: %d invoices sent, outbox %+v; want the invoice sent", len(got), st)
	}
}
