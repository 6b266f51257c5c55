package pgxinbox_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// runGoChannel runs h behind ib's middleware on a GoChannel topic, publishes
// msgs, and returns once every message was acked or nacked its last time
// (nacked messages are not redelivered: the router's handler returns
// errors, and GoChannel resends a nacked message, so the test's handler
// decides by itself when to stop failing).
func runGoChannel(t *testing.T, ib *pgxinbox.Inbox, h message.HandlerFunc, acked func() bool, msgs ...*message.Message) {
	t.Helper()
	logger := watermill.NopLogger{}
	pubsub := gochannel.NewGoChannel(gochannel.Config{}, logger)
	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		t.Fatal(err)
	}
	// Deliveries still in the router: closing it cancels their message
	// contexts (GoChannel's), which rolls back a transaction not yet
	// committed, so the router is closed only once none is in flight.
	var inFlight atomic.Int32
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			inFlight.Add(1)
			defer inFlight.Add(-1)
			return h(msg)
		}
	}, ib.Middleware)
	router.AddConsumerHandler("billing", "orders", pubsub, func(msg *message.Message) error {
		_, err := h(msg)
		return err
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	<-router.Running()
	if err := pubsub.Publish("orders", msgs...); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for !acked() || inFlight.Load() != 0 {
		if time.Now().After(deadline) {
			t.Fatal("messages not handled in 30 s")
		}
		time.Sleep(10 * time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// A message is processed once: its effect and its inbox row commit
// together in the pgx transaction, and a redelivery of the same UUID is
// acked without calling the handler.
func TestMiddleware_ProcessesEachMessageOnceInOnePgxTransaction(t *testing.T) {
	t.Parallel()
	pool := testdb.OpenPgxPool(t, "")
	f := newFixture(t, pool)
	var duplicates atomic.Int32
	ib := f.newInbox(pgxinbox.Config{OnDuplicate: func(inbox.Event) { duplicates.Add(1) }})
	var calls, failures atomic.Int32
	h := func(msg *message.Message) ([]*message.Message, error) {
		calls.Add(1)
		tx, ok := pgxinbox.TxFromContext(msg.Context())
		if !ok {
			return nil, errors.New("no pgx transaction in the message context")
		}
		if _, err := tx.Exec(msg.Context(), "INSERT INTO "+f.effect+" (message_id) VALUES ($1)", msg.UUID); err != nil {
			return nil, err
		}
		if string(msg.Payload) == "fail once" && failures.Add(1) == 1 {
			return nil, errors.New("handler failed")
		}
		return nil, nil
	}
	a := message.NewMessage("a", []byte("ok"))
	b := message.NewMessage("b", []byte("fail once"))
	runGoChannel(t, ib, h, func() bool { return calls.Load()+duplicates.Load() == 5 },
		a, b, message.NewMessage("a", []byte("ok")), message.NewMessage("a", []byte("ok")))
	// a once, b once after its failed try rolled back.
	f.expectRows(2, 2)
	if got := duplicates.Load(); got != 2 {
		t.Errorf("duplicates = %d, want 2", got)
	}
	expectNoConnHeld(t, pool)
}
