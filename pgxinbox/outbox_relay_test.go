package pgxinbox_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// countingBroker records the messages the relay publishes.
type countingBroker struct {
	mu   sync.Mutex
	msgs []*message.Message
}

func (b *countingBroker) Publish(_ string, msgs ...*message.Message) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.msgs = append(b.msgs, msgs...)
	return nil
}

func (b *countingBroker) Close() error { return nil }

func (b *countingBroker) sent() []*message.Message {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]*message.Message(nil), b.msgs...)
}

// In every pgx query mode (exec and simple_protocol are what PgBouncer in
// transaction mode needs), a handler's returned message is written in the
// message's pgx transaction and relayed once it commits, with its UUID,
// payload and metadata; a failed handler's never.
func TestOutboxRelay_EveryQueryModeWritesAndRelays(t *testing.T) {
	t.Parallel()
	modes := map[string]pgx.QueryExecMode{
		"cache_statement": pgx.QueryExecModeCacheStatement,
		"cache_describe":  pgx.QueryExecModeCacheDescribe,
		"describe_exec":   pgx.QueryExecModeDescribeExec,
		"exec":            pgx.QueryExecModeExec,
		"simple_protocol": pgx.QueryExecModeSimpleProtocol,
	}
	for name, mode := range modes {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			pool := openPool(t, "", "outbox_"+name, func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = mode })
			f := newFixture(t, pool)
			broker := &countingBroker{}
			ob := f.newRelayOutbox(broker)
			ib := f.newInbox(pgxinbox.Config{Outbox: pgxinbox.OutboxPublisher(ob)})
			in := newFeed()
			runRouter(t, func(r *message.Router) {
				r.AddPlugin(ob.RouterPlugin)
				r.AddMiddleware(ib.Middleware)
				r.AddHandler("billing", "orders", in, "invoices", broker, func(msg *message.Message) ([]*message.Message, error) {
					if msg.Metadata.Get("fail") != "" {
						pub, _ := inbox.OutboxFromContext(msg.Context())
						if err := pub.Publish("invoices", message.NewMessage(watermill.NewUUID(), nil)); err != nil {
							return nil, err
						}
						return nil, context.DeadlineExceeded
					}
					out := message.NewMessage(msg.UUID+"-invoice", []byte{0, 1, 2, 255})
					out.Metadata.Set("order", msg.UUID)
					return []*message.Message{out}, nil
				})
			})
			ok := message.NewMessage(watermill.NewUUID(), nil)
			failing := message.NewMessage(watermill.NewUUID(), nil)
			failing.Metadata.Set("fail", "yes")
			if !in.deliver(t, ok) || in.deliver(t, failing) {
				t.Fatal("want the first delivery acked and the failing one nacked")
			}
			waitFor(t, "the invoice relayed and the outbox empty", func() bool {
				stats, err := ob.Stats(context.Background())
				return err == nil && stats.Pending == 0 && len(broker.sent()) >= 1
			})
			sent := broker.sent()
			if len(sent) != 1 || sent[0].UUID != ok.UUID+"-invoice" || string(sent[0].Payload) != "\x00\x01\x02\xff" ||
				sent[0].Metadata.Get("order") != ok.UUID {
				t.Errorf("relayed %d messages, the first %+v; want only the invoice of %s with its payload and metadata", len(sent), sent, ok.UUID)
			}
		})
	}
}

// newRelayOutbox returns an Outbox on a table of its own on f's pool
// (through pgx's database/sql adapter), created, relaying to broker, whose
// relay polls once an hour (woken by commits).
func (f *fixture) newRelayOutbox(broker message.Publisher) *inbox.Outbox {
	f.t.Helper()
	db := sqlx.NewDb(stdlib.OpenDBFromPool(f.pool), "pgx")
	f.t.Cleanup(func() { db.Close() })
	table := "pgx_outbox_" + testdb.RandomSuffix()
	f.dropLater(table, table+"_dead")
	ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Table: table, Publisher: broker, PollInterval: time.Hour})
	if err != nil {
		f.t.Fatal(err)
	}
	if err := ob.InitializeSchema(context.Background()); err != nil {
		f.t.Fatal(err)
	}
	return ob
}
