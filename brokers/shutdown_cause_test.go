//go:build unix

package brokers

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// A service that runs its router under errgroup.WithContext beside another
// component; that component fails (errgroup cancels the group's context
// with its error as the cause) while a message is in its handler, which
// does not watch the context and returns nil. The inbox rolls back and
// returns a transient error (context.Canceled and the cause);
// Inbox.Middlewares' Retry (cenkalti/backoff) replaces it with
// context.Cause(ctx) alone, and the stack adds the context's end back, so
// its poison queue (!IsTransient) poisons nothing: the message was acked on
// the orders topic and never processed.
func TestShutdownWithACauseThroughInboxMiddlewaresPoisonsNothing(t *testing.T) {
	for _, broker := range []string{"rabbitmq", "nats"} {
		for _, backend := range []string{"database/sql", "pgxinbox"} {
			t.Run(broker+"/"+backend, func(t *testing.T) { shutdownWithACause(t, broker, backend) })
		}
	}
}

// shutdownBroker sets up the topic and poison topic on broker, and returns the
// subscriber, the publisher, and a function reading the poisoned
// messages' reasons.
func shutdownBroker(t *testing.T, broker, sfx string) (sub message.Subscriber, pub message.Publisher, topic, poison string, poisoned func() []string) {
	logger := watermill.NopLogger{}
	switch broker {
	case "rabbitmq":
		url := env(amqpURLEnv, defaultAMQPURL)
		conn, err := amqp091.Dial(url)
		if err != nil {
			t.Skip(err)
		}
		t.Cleanup(func() { conn.Close() })
		topic, poison = "shutdown_orders_"+sfx, "shutdown_poison_"+sfx
		inspect, err := conn.Channel()
		if err != nil {
			t.Fatal(err)
		}
		for _, q := range []string{topic, poison} {
			if _, err := inspect.QueueDeclare(q, true, false, false, false, nil); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { inspect.QueueDelete(q, false, false, false) }) //nolint:errcheck
		}
		cfg := amqp.NewDurableQueueConfig(url)
		s, err := amqp.NewSubscriber(cfg, logger)
		if err != nil {
			t.Fatal(err)
		}
		p, err := amqp.NewPublisher(cfg, logger)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { p.Close() })
		return s, p, topic, poison, func() []string {
			var out []string
			for {
				d, ok, err := inspect.Get(poison, true)
				if err != nil || !ok {
					return out
				}
				r, _ := d.Headers[middleware.ReasonForPoisonedKey].(string)
				out = append(out, r)
			}
		}
	default:
		url := env(natsURLEnv, defaultNATSURL)
		nc, err := nats.Connect(url, nats.Timeout(2*time.Second), nats.NoReconnect())
		if err != nil {
			t.Skip(err)
		}
		t.Cleanup(nc.Close)
		js, err := nc.JetStream(nats.MaxWait(10 * time.Second))
		if err != nil {
			t.Fatal(err)
		}
		topic, poison = "shutdown.orders."+sfx, "shutdown.poison."+sfx
		durable := "shutdown_" + sfx
		for _, sc := range []*nats.StreamConfig{
			{Name: "SHUTDOWN_ORDERS_" + sfx, Subjects: []string{topic}, Storage: nats.MemoryStorage},
			{Name: "SHUTDOWN_POISON_" + sfx, Subjects: []string{poison}, Storage: nats.MemoryStorage},
		} {
			if _, err := js.AddStream(sc); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { js.DeleteStream(sc.Name) }) //nolint:errcheck
		}
		if err := createConsumer(js, "SHUTDOWN_ORDERS_"+sfx, topic, durable); err != nil {
			t.Fatal(err)
		}
		s, p := natsJetStream(t, workerConfig{URL: url, Durable: durable}, logger)
		t.Cleanup(func() { p.Close() })
		return s, p, topic, poison, func() []string {
			ps, err := js.SubscribeSync(poison, nats.DeliverAll())
			if err != nil {
				t.Fatal(err)
			}
			defer ps.Unsubscribe() //nolint:errcheck
			var out []string
			for {
				m, err := ps.NextMsg(500 * time.Millisecond)
				if err != nil {
					return out
				}
				out = append(out, m.Header.Get(middleware.ReasonForPoisonedKey))
			}
		}
	}
}

func shutdownWithACause(t *testing.T, broker, backend string) {
	sfx := randomSuffix()
	sub, pub, topic, poison, poisoned := shutdownBroker(t, broker, sfx)
	table, business := "shutdown_inbox_"+sfx, "shutdown_business_"+sfx
	var err error
	dsn := env(postgresDSNEnv, defaultPostgresDSN)
	db := openPostgres(t, dsn)
	if _, err := db.Exec("CREATE TABLE " + business + " (id text PRIMARY KEY)"); err != nil {
		t.Fatal(err)
	}
	defer db.Exec("DROP TABLE IF EXISTS " + business) //nolint:errcheck
	defer db.Exec("DROP TABLE IF EXISTS " + table)    //nolint:errcheck

	var ib *inbox.Inbox
	var closeInbox func() error
	var write func(msg *message.Message) error
	switch backend {
	case "database/sql":
		ib, err = inbox.New(inbox.Config{DB: db, Table: table})
		if ib != nil {
			closeInbox = ib.Close
		}
		write = func(msg *message.Message) error {
			tx, _ := inbox.TxFromContext(msg.Context())
			_, err := tx.ExecContext(msg.Context(), "INSERT INTO "+business+" VALUES ($1)", msg.UUID)
			return err
		}
	case "pgxinbox":
		pool, perr := pgxpool.New(context.Background(), dsn)
		if perr != nil {
			t.Fatal(perr)
		}
		defer pool.Close()
		var pib *pgxinbox.Inbox
		pib, err = pgxinbox.New(pgxinbox.Config{Pool: pool, Table: table})
		if pib != nil {
			ib, closeInbox = pib.Inbox, pib.Close
		}
		write = func(msg *message.Message) error {
			tx, _ := pgxinbox.TxFromContext(msg.Context())
			_, err := tx.Exec(msg.Context(), "INSERT INTO "+business+" VALUES ($1)", msg.UUID)
			return err
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	defer closeInbox() //nolint:errcheck
	if err := ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}

	logger := watermill.NopLogger{}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	if err != nil {
		t.Fatal(err)
	}
	mws, err := ib.Middlewares(inbox.MiddlewaresConfig{PoisonQueue: pub, PoisonTopic: poison})
	if err != nil {
		t.Fatal(err)
	}
	var inboxErr atomic.Pointer[error] // errors of different types: atomic.Value panicked on the second
	last := len(mws) - 1
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			t.Logf("the whole stack returned: %q", err)
			return out, err
		}
	})
	router.AddMiddleware(mws[:last]...)
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc { // records what the inbox returned
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err != nil {
				inboxErr.Store(&err)
			}
			return out, err
		}
	}, mws[last])
	var calls atomic.Int32
	started := make(chan struct{}, 10)
	router.AddConsumerHandler("billing", topic, sub, func(msg *message.Message) error {
		calls.Add(1)
		if err := write(msg); err != nil {
			return err
		}
		started <- struct{}{}
		time.Sleep(300 * time.Millisecond) // a remote call that does not watch the context
		return nil
	})

	// What errgroup.WithContext does when another component of the group
	// fails: it cancels the group's context with that failure as its cause.
	group, shutdown := context.WithCancelCause(context.Background())
	defer shutdown(nil)
	ran := make(chan struct{})
	go func() { defer close(ran); _ = router.Run(group) }()
	<-router.Running()
	if err := pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("order"))); err != nil {
		t.Fatal(err)
	}
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("handler never started")
	}
	errConfig := errors.New("metrics exporter: invalid configuration")
	shutdown(errConfig) // the process's other component fails: shutdown
	<-ran
	_ = sub.Close()

	if p := inboxErr.Load(); p != nil {
		e := *p
		t.Logf("the inbox returned: %v (IsTransient %v)", e, inbox.IsTransient(e))
	}
	var businessRows, inboxRows int
	_ = db.Get(&businessRows, "SELECT count(*) FROM "+business)
	_ = db.Get(&inboxRows, "SELECT count(*) FROM "+table)
	time.Sleep(300 * time.Millisecond)
	if reasons := poisoned(); len(reasons) > 0 {
		t.Errorf("message poisoned at a shutdown (reasons %q); business rows %d, inbox rows %d, handler calls %d: the message is acked on %s and never processed",
			reasons, businessRows, inboxRows, calls.Load(), topic)
	}
}
