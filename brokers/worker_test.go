//go:build unix

package brokers

import (
	"context"
	"errors"
	"fmt"
	"log"
	"regexp"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	_ "github.com/jackc/pgx/v5/stdlib" // registers "pgx"
	"github.com/jmoiron/sqlx"
	"github.com/nats-io/nats.go"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/workerproc"
)

// workerEnv holds a worker's JSON workerConfig; set, the test binary runs
// TestBrokerWorker as a worker process.
const workerEnv = "INBOX_BROKERS_WORKER"

// workerConfig is what a test tells a worker process.
type workerConfig struct {
	Name      string
	Broker    string // "rabbitmq" or "nats"
	URL       string
	Topic     string // the queue (RabbitMQ) or subject (NATS)
	Poison    string // the poison queue (RabbitMQ) or subject (NATS)
	Durable   string // NATS: the durable consumer, and its deliver group
	DSN       string
	Inbox     string // inbox table
	Business  string // business table
	KillAfter int    // SIGKILL itself right after its KillAfter-th commit; 0: never
	ParentPID int
}

// Events a worker reports (besides workerproc's EvReady and EvInUse), one
// line each on file descriptor 3:
// "<kind> <message id>", or "<kind> <detail>".
const (
	evProcessed = "P" // committed, about to be acked
	evDuplicate = "D" // skipped as a duplicate (acked)
	evKill      = "K" // committed, and SIGKILLed before the ack
	evRefused   = "I" // refused with ErrInvalidMessageID: "I <message uuid>"
	evFailed    = "F" // any other failure: "F <error>"
)

// TestBrokerWorker is a worker process of the broker tests: a Watermill
// router with a poison queue and the inbox middleware on PostgreSQL, and one
// handler, "billing", reading the test's queue or stream. It runs until
// SIGTERM, or until it SIGKILLs itself after its KillAfter-th commit. Run on
// its own it skips.
func TestBrokerWorker(t *testing.T) {
	var cfg workerConfig
	if !workerproc.Config(t, workerEnv, &cfg) {
		t.Skip("helper process of the broker tests; runs only when they start it")
	}
	log.SetPrefix(cfg.Name + ": ")
	ev := workerproc.OpenEvents()
	sig, stop := ev.Ready()
	defer stop()

	defer workerproc.ExitWhenOrphaned(cfg.ParentPID, log.Printf)()

	db, err := sqlx.Open("pgx", cfg.DSN)
	if err != nil {
		t.Fatal(err)
	}
	db.SetMaxOpenConns(4)
	logger := watermill.NewStdLogger(false, false)

	// The id the inbox claims: the foreign producer's, or the Watermill UUID.
	var messageID func(*message.Message) (string, error)
	var sub message.Subscriber
	var pub message.Publisher // for the poison queue
	switch cfg.Broker {
	case "rabbitmq":
		messageID = inbox.MessageIDFromMetadataOrUUID(inbox.AMQPMessageIDKey)
		sub, pub = rabbitMQ(t, cfg, logger)
	case "nats":
		messageID = inbox.MessageIDFromMetadataOrUUID(inbox.NATSMsgIDHeader)
		sub, pub = natsJetStream(t, cfg, logger)
	default:
		t.Fatalf("unknown broker %q", cfg.Broker)
	}
	defer pub.Close()

	ib, err := inbox.New(inbox.Config{
		DB:        db,
		Table:     cfg.Inbox,
		MessageID: messageID,
		// Each copy of an event carries its copy number in the payload
		// (which copy the inbox processed): a resend counter, which the
		// fingerprint leaves out, as a service does with a producer's
		// volatile fields, so that a copy is a duplicate and not a reused id.
		Fingerprint: func(msg *message.Message) []byte { return copyNumber.ReplaceAll(msg.Payload, nil) },
		OnProcessed: func(e inbox.Event) { ev.Send(evProcessed, e.MessageID) },
		OnDuplicate: func(e inbox.Event) { ev.Send(evDuplicate, e.MessageID) },
		OnFailed: func(e inbox.Event) {
			if errors.Is(e.Err, inbox.ErrInvalidMessageID) {
				ev.Send(evRefused, e.Message.UUID)
				return
			}
			ev.Send(evFailed, fmt.Sprintf("%q: %q", e.MessageID, e.Err.Error()))
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 15 * time.Second}, logger)
	if err != nil {
		t.Fatal(err)
	}
	// A message whose id is invalid can never succeed: poison it, or the
	// broker redelivers it at once, forever.
	poison, err := middleware.PoisonQueueWithFilter(pub, cfg.Poison, func(err error) bool {
		return errors.Is(err, inbox.ErrInvalidMessageID)
	})
	if err != nil {
		t.Fatal(err)
	}
	router.AddMiddleware(
		middleware.Recoverer,
		poison, // outside (before) the inbox: a poisoned message is not marked processed
		ib.Middleware,
	)

	insert := db.Rebind("INSERT INTO " + cfg.Business + " (message_id, worker) VALUES (?, ?)")
	kill := workerproc.NewSelfKill(cfg.KillAfter)
	router.AddConsumerHandler(consumer, cfg.Topic, sub, func(msg *message.Message) error {
		ctx := msg.Context()
		tx, ok := inbox.TxFromContext(ctx)
		if !ok {
			return errors.New("no inbox transaction")
		}
		id, err := messageID(msg) // the id the inbox claimed
		if err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, insert, id, cfg.Name); err != nil {
			return err
		}
		kill.AfterCommit(ctx, func() { ev.Send(evKill, id) })
		return nil
	})

	workerproc.RunRouter(t, router, sig)
	if err := sub.Close(); err != nil {
		t.Errorf("close subscriber: %v", err)
	}
	if err := ib.Close(); err != nil {
		t.Errorf("close inbox: %v", err)
	}
	ev.ReportInUse(db)
	if err := db.Close(); err != nil {
		t.Errorf("close db: %v", err)
	}
}

// rabbitMQ returns the worker's subscriber to the test's queue, and a
// publisher for its poison queue.
func rabbitMQ(t *testing.T, cfg workerConfig, logger watermill.LoggerAdapter) (message.Subscriber, message.Publisher) {
	config := amqp.NewDurableQueueConfig(cfg.URL)
	config.Marshaler = AMQPMarshaler{}
	config.Publish.ConfirmDelivery = true // a poisoned copy is stored before the ack
	sub, err := amqp.NewSubscriber(config, logger)
	if err != nil {
		t.Fatal(err)
	}
	pub, err := amqp.NewPublisher(config, logger)
	if err != nil {
		t.Fatal(err)
	}
	return sub, pub
}

// natsJetStream returns the worker's subscriber to the test's stream, bound
// to the durable consumer the test created, and a publisher for its poison
// stream.
func natsJetStream(t *testing.T, cfg workerConfig, logger watermill.LoggerAdapter) (message.Subscriber, message.Publisher) {
	sub, err := wmnats.NewSubscriber(wmnats.SubscriberConfig{
		URL:              cfg.URL,
		QueueGroupPrefix: cfg.Durable, // the consumer's deliver group
		Unmarshaler:      &NATSMarshaler{},
		CloseTimeout:     10 * time.Second,
		JetStream: wmnats.JetStreamConfig{
			DurablePrefix: cfg.Durable,
			// Without ManualAck, nats.go acks each message when
			// watermill-nats's callback returns, also one it gave up on
			// (after AckWaitTimeout, or on Close) before the handler ended.
			SubscribeOptions: []nats.SubOpt{nats.ManualAck(), nats.AckExplicit()},
		},
	}, logger)
	if err != nil {
		t.Fatal(err)
	}
	pub, err := wmnats.NewPublisher(wmnats.PublisherConfig{URL: cfg.URL}, logger)
	if err != nil {
		t.Fatal(err)
	}
	return sub, pub
}

// copyNumber matches the copy number in a published event's payload.
var copyNumber = regexp.MustCompile(`"copy":[0-9]+`)
