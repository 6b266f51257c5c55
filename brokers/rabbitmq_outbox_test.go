//go:build unix

package brokers

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/watermill-inbox/inbox"
)

// amqpRelayPublisher is docs/outbox.md's wrapper of watermill-amqp's
// publisher for the outbox relay.
type amqpRelayPublisher struct{ message.Publisher }

func (p amqpRelayPublisher) Publish(topic string, msgs ...*message.Message) error {
	errs := make([]error, len(msgs))
	for i, m := range msgs {
		err := p.Publisher.Publish(topic, m)
		if err == nil {
			continue
		}
		// watermill-amqp v3.0.2's errors are plain text: a nack (a queue
		// full with x-overflow reject-publish) and a lost connection are
		// the broker's state, not the message's.
		if strings.Contains(err.Error(), "delivery not confirmed") || strings.Contains(err.Error(), "not connected to AMQP") ||
			errors.Is(err, amqp.ErrClosed) {
			err = fmt.Errorf("%w: %w", inbox.ErrBrokerUnavailable, err)
		}
		for j := i; j < len(msgs); j++ {
			errs[j] = err // this one refused, the rest not tried
		}
		return &inbox.PublishError{MessageErrors: errs}
	}
	return nil
}

// The relay publishes to RabbitMQ with confirms, through amqpRelayPublisher,
// into a queue that protects itself (x-max-length with x-overflow
// reject-publish) and that its consumer drains more slowly than the relay
// sends: RabbitMQ nacks what does not fit now. Every message arrives once
// and none is set aside. Through watermill-amqp's publisher alone, a nack was
// a refusal of the message: messages the broker took a moment later were set
// aside after MaxAttempts (9 to 13 of 60), and each round sent its call's
// earlier messages again (about 1,000 copies of 60 messages in a minute),
// which took the queue's room.
func TestRelayToRabbitMQBehindAQueueThatRejectsWhenFull(t *testing.T) {
	url := env(amqpURLEnv, defaultAMQPURL)
	conn, err := amqp.Dial(url)
	if err != nil {
		unreachable(t, "RabbitMQ", err, "")
	}
	t.Cleanup(func() { conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	queue := "outbox_full_" + randomSuffix()
	if _, err := ch.QueueDeclare(queue, true, false, false, false, amqp.Table{"x-max-length": int32(5), "x-overflow": "reject-publish"}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = ch.QueueDelete(queue, false, false, false) })
	cfg := wamqp.NewDurableQueueConfig(url)
	cfg.Publish.ConfirmDelivery = true
	pub, err := wamqp.NewPublisher(cfg, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pub.Close() })

	db := openPostgres(t, env(postgresDSNEnv, defaultPostgresDSN))
	table := "outbox_full_" + randomSuffix()
	t.Cleanup(func() { _, _ = db.Exec("DROP TABLE IF EXISTS " + table + ", " + table + "_dead") })
	ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Dialect: inbox.PostgreSQL, Table: table, Publisher: amqpRelayPublisher{pub},
		PollInterval: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond}) // MaxAttempts: the default 10
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := ob.InitializeSchema(ctx); err != nil {
		t.Fatal(err)
	}
	const n = 60
	for i := range n {
		tx, err := db.Beginx()
		if err != nil {
			t.Fatal(err)
		}
		w, err := ob.Publisher(tx)
		if err != nil {
			t.Fatal(err)
		}
		if err := w.Publish(queue, message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprint(i)))); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = ob.Run(runCtx) }()
	defer func() { stop(); <-done }()

	got := map[string]int{} // by UUID
	for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		d, ok, err := ch.Get(queue, true) // a slow consumer: one message every 50 ms
		if err != nil {
			t.Fatal(err)
		}
		if ok {
			got[fmt.Sprint(d.Headers[wamqp.DefaultMessageUUIDHeaderKey])]++
			continue
		}
		if s, err := ob.Stats(ctx); err == nil && s.Pending == 0 && s.DeadLettered == 0 {
			break
		}
	}
	s, err := ob.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	copies := 0
	for _, c := range got {
		copies += c - 1
	}
	if len(got) != n || copies != 0 || s.Pending != 0 || s.DeadLettered != 0 {
		t.Errorf("received %d of %d messages, %d copies more; outbox %+v; want each once, nothing set aside", len(got), n, copies, s)
	}
}
