//go:build unix

package brokers

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/watermill-inbox/inbox"
)

const (
	amqpURLEnv     = "INBOX_TEST_AMQP_URL"
	defaultAMQPURL = "amqp://guest:guest@127.0.0.1:5672/"
	startRabbitMQ  = "rabbitmq-server -detached"

	noIDBody = "a foreign message with no message id"
)

// TestRabbitMQ_effectsExactlyOnce runs worker processes on one RabbitMQ
// queue while workers are SIGKILLed between commit and ack and messages are
// published twice, by Watermill (same UUID) and by a plain AMQP producer
// (same message-id property). Every message has exactly one effect, and a
// message with no id at all is poisoned once instead of spinning.
func TestRabbitMQ_effectsExactlyOnce(t *testing.T) {
	if os.Getenv(workerEnv) != "" {
		t.Skip("worker process")
	}
	url := env(amqpURLEnv, defaultAMQPURL)
	conn, err := amqp091.Dial(url)
	if err != nil {
		unreachable(t, "RabbitMQ", err, fmt.Sprintf("start it with `%s`, or point %s at a server", startRabbitMQ, amqpURLEnv))
	}
	t.Cleanup(func() { conn.Close() })
	r := newRun(t, "rabbitmq")
	r.base.URL = url
	r.base.Topic = "inbox_brokers_" + r.id
	r.base.Poison = r.base.Topic + "_poison"

	inspect, err := conn.Channel() // for setup, progress and checks
	if err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{r.base.Topic, r.base.Poison} {
		// As watermill-amqp's NewDurableQueueConfig declares them.
		if _, err := inspect.QueueDeclare(q, true, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if _, err := inspect.QueueDelete(q, false, false, false); err != nil {
				t.Logf("delete queue %s: %v", q, err)
			}
		})
	}

	plan := newPlan(r.id, true)
	copies := map[string]int{}
	for _, p := range plan {
		if p.id != "" {
			copies[p.id]++
		}
	}
	produced := make(chan error, 1)
	go func() { produced <- publishAMQP(conn, url, r.base.Topic, plan) }()

	isProduced := false
	r.supervise(func() (bool, string) {
		if !isProduced {
			select {
			case err := <-produced:
				if err != nil {
					r.fail("publish: %v", err)
				}
				isProduced = true
			default:
			}
		}
		q, err := inspect.QueueDeclarePassive(r.base.Topic, true, false, false, false, nil)
		if err != nil {
			r.fail("inspect queue: %v", err)
		}
		p, err := inspect.QueueDeclarePassive(r.base.Poison, true, false, false, false, nil)
		if err != nil {
			r.fail("inspect poison queue: %v", err)
		}
		committed, acked := r.committed(), r.acked()
		progress := fmt.Sprintf("%d of %d messages committed, %d of %d copies acked, %d ready in the queue, %d poisoned",
			committed, len(copies), acked, len(plan), q.Messages, p.Messages)
		return isProduced && committed == len(copies) && acked >= len(plan) && q.Messages == 0 && p.Messages > 0, progress
	})
	r.stopAll()
	elapsed := time.Since(r.began)
	r.check(copies)

	// The message with no id lands once on the poison queue.
	var poisoned []amqp091.Delivery
	for {
		d, ok, err := inspect.Get(r.base.Poison, true)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			break
		}
		poisoned = append(poisoned, d)
	}
	if len(poisoned) != 1 {
		t.Errorf("%d messages on the poison queue, want 1", len(poisoned))
	}
	for _, d := range poisoned {
		reason, _ := d.Headers[middleware.ReasonForPoisonedKey].(string)
		if string(d.Body) != noIDBody || !strings.Contains(reason, strings.TrimPrefix(inbox.ErrInvalidMessageID.Error(), "inbox: ")) {
			t.Errorf("poisoned: body %q, reason %q; want body %q and the reason %q", d.Body, reason, noIDBody, inbox.ErrInvalidMessageID)
		}
	}
	t.Logf("RabbitMQ: %d copies of %d messages (%d re-published by Watermill, %d foreign each twice, 1 with no id) in %v\n%s",
		len(plan), len(copies), republish, foreign, elapsed.Round(time.Millisecond), r.summary())
}

// publishAMQP publishes plan to queue: Watermill's messages with
// watermill-amqp's publisher, the others with amqp091-go directly, with the
// AMQP message-id property and no Watermill header. Both wait for the
// broker's confirmation.
func publishAMQP(conn *amqp091.Connection, url, queue string, plan []publication) error {
	config := amqp.NewDurableQueueConfig(url)
	config.Publish.ConfirmDelivery = true
	pub, err := amqp.NewPublisher(config, watermill.NopLogger{})
	if err != nil {
		return err
	}
	defer pub.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	defer ch.Close()
	if err := ch.Confirm(false); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, p := range plan {
		if !p.foreign {
			msg := message.NewMessage(p.id, []byte(fmt.Sprintf(`{"copy":%d}`, p.copy)))
			if err := pub.Publish(queue, msg); err != nil {
				return err
			}
			continue
		}
		body := fmt.Sprintf(`{"order":%q,"copy":%d}`, p.id, p.copy)
		if p.id == "" {
			body = noIDBody
		}
		confirm, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, true, false, amqp091.Publishing{
			MessageId:    p.id,
			ContentType:  "application/json",
			DeliveryMode: amqp091.Persistent,
			Body:         []byte(body),
		})
		if err != nil {
			return err
		}
		if ok, err := confirm.WaitContext(ctx); err != nil || !ok {
			return fmt.Errorf("publish %q: confirmed %v, %v", p.id, ok, err)
		}
	}
	return nil
}
