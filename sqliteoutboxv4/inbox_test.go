package sqliteoutboxv4_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// Through the inbox, on SQLite, in a router: a message that the handler
// returns reaches the broker if and only if the inbox transaction commits.
// A handler that wrote to the outbox and then failed leaves no outbox row
// and sends nothing; its redelivery that succeeds leaves exactly one row,
// which the forwarder sends once and then deletes.
func TestInboxOutbox_sends_returned_message_iff_committed(t *testing.T) {
	t.Parallel()
	path := newDBFile(t)
	db := testdb.OpenSQLite(t, path)
	topic := outboxTopic()
	fwdSub := queueSubscriber(t, testdb.OpenSQLite(t, path), topic, 10) // creates the outbox table

	inboxTable := "inbox_" + testdb.RandomSuffix()
	ib, err := inbox.New(inbox.Config{
		DB:    db,
		Table: inboxTable,
		Outbox: func(tx *sqlx.Tx) (message.Publisher, error) {
			return outboxPublisher(t, wsql.TxFromStdSQL(tx.Tx), topic), nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}

	dest := newDestination(t)
	broker := &countingPublisher{next: dest}
	next := receive(t, dest, "invoices")
	startForwarder(t, fwdSub, broker, topic)

	var failing atomic.Bool
	var committedInvoice atomic.Value
	errHandler := errors.New("handler failed after writing to the outbox")
	failed := make(chan struct{}, 1)
	orders := newGoChannel(t, gochannel.Config{})
	router := runRouter(t, func(r *message.Router) {
		r.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
			return func(msg *message.Message) ([]*message.Message, error) {
				produced, err := h(msg) // the inbox has rolled back or committed
				if errors.Is(err, errHandler) {
					select {
					case failed <- struct{}{}:
					default:
					}
				}
				return produced, err
			}
		}, ib.Middleware)
		r.AddHandler("billing", "orders", orders, "invoices", broker, func(msg *message.Message) ([]*message.Message, error) {
			invoice := message.NewMessage(watermill.NewUUID(), []byte("invoice for "+msg.UUID))
			if failing.Load() {
				pub, ok := inbox.OutboxFromContext(msg.Context())
				if !ok {
					return nil, errors.New("no outbox in the message's context")
				}
				if err := pub.Publish("invoices", invoice); err != nil {
					return nil, err
				}
				return []*message.Message{invoice}, errHandler
			}
			committedInvoice.Store(invoice.UUID)
			return []*message.Message{invoice}, nil
		})
	})

	failing.Store(true)
	if err := orders.Publish("orders", message.NewMessage(watermill.NewUUID(), []byte("order"))); err != nil {
		t.Fatal(err)
	}
	<-failed
	if left := queuedUUIDs(t, db, topic); len(left) != 0 {
		t.Fatalf("a failed handler left outbox rows %v", left)
	}
	if n := rows(t, db, inboxTable); n != 0 {
		t.Fatalf("a failed handler left %d inbox rows", n)
	}

	failing.Store(false) // the router's redelivery succeeds
	if got := next(); got != committedInvoice.Load() {
		t.Fatalf("forwarded %s, want the committed invoice %v", got, committedInvoice.Load())
	}
	waitEmpty(t, db, topic)
	router.Close()
	if n := rows(t, db, inboxTable); n != 1 {
		t.Errorf("%d inbox rows, want 1", n)
	}
	if got := broker.sent(); len(got) != 1 {
		t.Errorf("sent to the broker %v, want exactly the committed invoice %v", got, committedInvoice.Load())
	}
}

// runRouter runs a router configured by add until t ends.
func runRouter(t *testing.T, add func(*message.Router)) *message.Router {
	t.Helper()
	r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	add(r)
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	<-r.Running()
	t.Cleanup(func() {
		if err := r.Close(); err != nil {
			t.Errorf("closing the router: %v", err)
		}
		if err := <-done; err != nil {
			t.Errorf("router: %v", err)
		}
	})
	return r
}

// countingPublisher records the UUIDs it publishes to next.
type countingPublisher struct {
	next message.Publisher
	mu   sync.Mutex
	uuid []string
}

func (p *countingPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.mu.Lock()
	for _, msg := range msgs {
		p.uuid = append(p.uuid, msg.UUID)
	}
	p.mu.Unlock()
	return p.next.Publish(topic, msgs...)
}

func (p *countingPublisher) sent() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.uuid...)
}

func (p *countingPublisher) Close() error { return nil }

func rows(t *testing.T, db *sqlx.DB, table string) int {
	t.Helper()
	var n int
	if err := db.Get(&n, `SELECT count(*) FROM "`+table+`"`); err != nil {
		t.Fatal(err)
	}
	return n
}
