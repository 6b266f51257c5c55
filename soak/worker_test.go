//go:build unix

package soak

import (
	"errors"
	"fmt"
	"log"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	_ "github.com/jackc/pgx/v5/stdlib" // registers "pgx"
	_ "modernc.org/sqlite"             // registers "sqlite"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/workerproc"
)

// workerEnv holds a worker's JSON workerConfig; set, the test binary runs
// TestSoakWorker as a worker process.
const workerEnv = "INBOX_SOAK_WORKER"

// workerConfig is what TestSoak tells a worker process.
type workerConfig struct {
	Name      string
	Brokers   []string
	Topic     string
	Driver    string // "pgx", "mysql" or "sqlite"
	DSN       string
	MaxConns  int
	Inbox     string            // inbox table, shared by the consumers
	Business  map[string]string // consumer -> business table
	Groups    map[string]string // consumer -> Kafka consumer group
	KillAfter int               // SIGKILL itself right after its Nth commit (all consumers); 0: never
	FailRate  float64           // share of handler attempts that fail after writing
	ParentPID int
}

// errInjected is the injected handler failure.
var errInjected = errors.New("soak: injected handler failure")

// Events a worker reports to TestSoak (besides workerproc's EvReady and
// EvInUse), one line each on file descriptor 3:
// "<kind> <consumer>" or "<kind> <detail>".
const (
	evProcessed = "P" // committed, about to be acked
	evDuplicate = "D" // skipped as a duplicate (acked)
	evInjected  = "I" // injected failure: rolled back, retried or nacked
	evTransient = "T" // a failure not injected that inbox.IsTransient reports as transient (rolled back, nacked): "T <consumer> <error>"
	evFailed    = "F" // any other failure (rolled back, nacked): "F <consumer> <error>"
	evKill      = "K" // committed, and SIGKILLed before the ack
	evSession   = "S" // a new MariaDB connection: "S <CONNECTION_ID()>"
)

// TestSoakWorker is a worker process of TestSoak: a Watermill router with
// the inbox middleware and two consumers, "billing" and "shipping", reading
// the soak topic from Kafka. It runs until SIGTERM, or until it SIGKILLs
// itself after its KillAfter-th commit. Run on its own it skips.
func TestSoakWorker(t *testing.T) {
	var cfg workerConfig
	if !workerproc.Config(t, workerEnv, &cfg) {
		t.Skip("helper process of TestSoak; runs only when TestSoak starts it")
	}
	log.SetPrefix(cfg.Name + ": ")
	ev := workerproc.OpenEvents()
	sig, stop := ev.Ready()
	defer stop()

	defer workerproc.ExitWhenOrphaned(cfg.ParentPID, log.Printf)()

	db, err := openDB(cfg.Driver, cfg.DSN, func(id int64) { ev.Send(evSession, fmt.Sprint(id)) })
	if err != nil {
		t.Fatal(err)
	}
	db.SetMaxOpenConns(cfg.MaxConns)
	db.SetMaxIdleConns(cfg.MaxConns)

	ib, err := inbox.New(inbox.Config{
		DB:          db,
		Table:       cfg.Inbox,
		OnProcessed: func(e inbox.Event) { ev.Send(evProcessed, e.Consumer) },
		OnDuplicate: func(e inbox.Event) { ev.Send(evDuplicate, e.Consumer) },
		OnFailed: func(e inbox.Event) {
			switch {
			case errors.Is(e.Err, errInjected):
				ev.Send(evInjected, e.Consumer)
			case inbox.IsTransient(e.Err):
				// On MariaDB this includes the deadlock (1213) of three
				// deliveries of one key whose first rolls back (NOTES).
				ev.Send(evTransient, fmt.Sprintf("%s %q", e.Consumer, e.Err.Error()))
			default:
				ev.Send(evFailed, fmt.Sprintf("%s %q", e.Consumer, e.Err.Error()))
			}
		},
	})
	if err != nil {
		t.Fatal(err)
	}

	// The router's Close waits for the Kafka subscribers to close, and a
	// sarama consumer group cannot close while its JoinGroup waits for a
	// rebalance, which lasts up to Rebalance.Timeout (15 s, consumerConfig),
	// plus the session timeout (3 s) of a killed member the group still
	// counts: with 20 s, two workers stopped during such a rebalance timed
	// out in CI. soak.await allows a minute.
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 45 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	router.AddMiddleware(
		middleware.Recoverer,
		middleware.Retry{MaxRetries: 1, InitialInterval: time.Millisecond}.Middleware,
		ib.Middleware,
	)
	kill := workerproc.NewSelfKill(cfg.KillAfter)
	var subs []*kafka.Subscriber
	for _, consumer := range []string{"billing", "shipping"} {
		// One subscriber, so one consumer group, per consumer: two handlers
		// sharing a group would split the partitions between them.
		sub, err := kafka.NewSubscriber(kafka.SubscriberConfig{
			Brokers:               cfg.Brokers,
			Unmarshaler:           kafka.DefaultMarshaler{},
			OverwriteSaramaConfig: consumerConfig(cfg.Name),
			ConsumerGroup:         cfg.Groups[consumer],
			NackResendSleep:       10 * time.Millisecond,
		}, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		subs = append(subs, sub)
		insert := db.Rebind("INSERT INTO " + cfg.Business[consumer] + " (message_id, worker) VALUES (?, ?)")
		router.AddConsumerHandler(consumer, cfg.Topic, sub, func(msg *message.Message) error {
			ctx := msg.Context()
			tx, ok := inbox.TxFromContext(ctx)
			if !ok {
				return errors.New("soak: no inbox transaction")
			}
			if _, err := tx.ExecContext(ctx, insert, msg.UUID, cfg.Name); err != nil {
				return err
			}
			if rand.Float64() < cfg.FailRate {
				return errInjected // after the write: only the rollback removes it
			}
			kill.AfterCommit(ctx, func() { ev.Send(evKill, consumer) })
			return nil
		})
	}

	workerproc.RunRouter(t, router, sig)
	for _, sub := range subs {
		if err := sub.Close(); err != nil {
			t.Errorf("close subscriber: %v", err)
		}
	}
	if err := ib.Close(); err != nil {
		t.Errorf("close inbox: %v", err)
	}
	if inUse := ev.ReportInUse(db); inUse != 0 {
		t.Errorf("%d database connections still in use after the router stopped", inUse)
	}
	if err := db.Close(); err != nil {
		t.Errorf("close db: %v", err)
	}
}

// consumerConfig is the sarama configuration of the workers' subscribers.
func consumerConfig(clientID string) *sarama.Config {
	c := kafka.DefaultSaramaSubscriberConfig()
	c.Version = sarama.V2_8_0_0 // with sarama >= v1.61.1: see docs/brokers.md
	c.ClientID = clientID
	c.Consumer.Offsets.Initial = sarama.OffsetOldest
	c.Consumer.MaxWaitTime = 10 * time.Millisecond // commit latency: see docs/brokers.md
	c.Consumer.Offsets.AutoCommit.Interval = time.Second
	// A killed member's partitions move once its session expires; kfake
	// runs with a 1 s minimum so that this takes 3 s, not 10.
	c.Consumer.Group.Session.Timeout = 3 * time.Second
	c.Consumer.Group.Heartbeat.Interval = 500 * time.Millisecond
	c.Consumer.Group.Rebalance.Timeout = 15 * time.Second
	c.Consumer.Group.Rebalance.Retry.Backoff = 200 * time.Millisecond
	return c
}
