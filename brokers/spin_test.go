//go:build unix

package brokers

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/nats-io/nats.go"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/watermill-inbox/inbox"
)

// spinFor is how long the spin tests let a refused message be redelivered.
const spinFor = time.Second

// TestRabbitMQ_refusedMessageSpinsWithoutPoisonQueue shows what the poison
// queue of TestRabbitMQ_effectsExactlyOnce prevents: a message with no id,
// refused by the inbox and nacked, is requeued by RabbitMQ at once and
// comes straight back, again and again.
func TestRabbitMQ_refusedMessageSpinsWithoutPoisonQueue(t *testing.T) {
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
	queue := "inbox_brokers_spin_" + r.id
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(queue, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := ch.QueueDelete(queue, false, false, false); err != nil {
			t.Logf("delete queue %s: %v", queue, err)
		}
	})
	if err := ch.PublishWithContext(context.Background(), "", queue, true, false, amqp091.Publishing{Body: []byte(noIDBody)}); err != nil {
		t.Fatal(err)
	}

	config := amqp.NewDurableQueueConfig(url)
	config.Marshaler = AMQPMarshaler{}
	sub, err := amqp.NewSubscriber(config, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	n := refusals(t, r, sub, queue, inbox.AMQPMessageIDKey, nil)
	t.Logf("RabbitMQ, no poison queue: the message with no id was refused %d times in %v", n, spinFor)
	if n < 20 {
		t.Errorf("refused %d times in %v, want a spin (at least 20)", n, spinFor)
	}
}

// TestNATSJetStream_nakDelayBoundsRedelivery shows how JetStream redelivers
// a message that the inbox refuses: at once, again and again, when the
// subscriber has no NakDelay; once per delay with one.
func TestNATSJetStream_nakDelayBoundsRedelivery(t *testing.T) {
	if os.Getenv(workerEnv) != "" {
		t.Skip("worker process")
	}
	url := env(natsURLEnv, defaultNATSURL)
	how := fmt.Sprintf("start it with `%s`, or point %s at a server", startNATS, natsURLEnv)
	nc, err := nats.Connect(url, nats.Timeout(2*time.Second), nats.NoReconnect())
	if err != nil {
		unreachable(t, "NATS", err, how)
	}
	t.Cleanup(nc.Close)
	js, err := nc.JetStream(nats.MaxWait(10 * time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.AccountInfo(); err != nil {
		unreachable(t, "NATS JetStream", err, "run nats-server with -js: "+how)
	}
	r := newRun(t, "nats")
	for _, tc := range []struct {
		name     string
		nakDelay wmnats.Delay
		min, max int
	}{
		{name: "without NakDelay", min: 20, max: 1 << 30},
		{name: "NakDelay 250ms", nakDelay: wmnats.NewStaticDelay(250 * time.Millisecond), min: 2, max: 5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			id := randomSuffix()
			subject, stream, durable := "inbox.brokers.spin."+id, "INBOX_BROKERS_SPIN_"+id, "spin_"+id
			if _, err := js.AddStream(&nats.StreamConfig{Name: stream, Subjects: []string{subject}, Storage: nats.MemoryStorage}); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				if err := js.DeleteStream(stream); err != nil {
					t.Logf("delete stream %s: %v", stream, err)
				}
			})
			if err := createConsumer(js, stream, subject, durable); err != nil {
				t.Fatal(err)
			}
			if _, err := js.PublishMsg(&nats.Msg{Subject: subject, Data: []byte(noIDBody)}); err != nil {
				t.Fatal(err)
			}
			sub, err := wmnats.NewSubscriber(wmnats.SubscriberConfig{
				URL:              url,
				QueueGroupPrefix: durable,
				Unmarshaler:      &NATSMarshaler{},
				NakDelay:         tc.nakDelay,
				JetStream: wmnats.JetStreamConfig{
					DurablePrefix:    durable,
					SubscribeOptions: []nats.SubOpt{nats.ManualAck(), nats.AckExplicit()},
				},
			}, watermill.NopLogger{})
			if err != nil {
				t.Fatal(err)
			}
			// The server stops redelivering before the subscriber closes:
			// watermill-nats's Close races with a delivery in progress (it
			// closes the channel that delivery sends on).
			stopRedelivery := func() {
				if err := js.DeleteConsumer(stream, durable); err != nil {
					t.Errorf("delete consumer: %v", err)
				}
			}
			n := refusals(t, r, sub, subject, inbox.NATSMsgIDHeader, stopRedelivery)
			t.Logf("JetStream, %s: the message with no id was refused %d times in %v", tc.name, n, spinFor)
			if n < tc.min || n > tc.max {
				t.Errorf("refused %d times in %v, want %d to %d", n, spinFor, tc.min, tc.max)
			}
		})
	}
}

// refusals runs a router in this process, with the inbox (message ids from
// metadata key, or the UUID) and no poison queue, on sub for spinFor, and
// returns how often the inbox refused a message with ErrInvalidMessageID in
// that time. Then it calls stopRedelivery, if set, waits until no refusal
// comes for 100 ms, and closes the router and sub.
func refusals(t *testing.T, r *run, sub message.Subscriber, topic, key string, stopRedelivery func()) int {
	var n atomic.Int64
	ib, err := inbox.New(inbox.Config{
		DB:        r.db,
		Table:     r.base.Inbox,
		MessageID: inbox.MessageIDFromMetadataOrUUID(key),
		OnFailed: func(e inbox.Event) {
			if errors.Is(e.Err, inbox.ErrInvalidMessageID) {
				n.Add(1)
			}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer ib.Close()
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	router.AddMiddleware(middleware.Recoverer, ib.Middleware)
	router.AddConsumerHandler(consumer, topic, sub, func(*message.Message) error {
		return errors.New("the handler runs for a message with an id only")
	})
	ran := make(chan error, 1)
	go func() { ran <- router.Run(context.Background()) }()
	<-router.Running()
	time.Sleep(spinFor)
	refused := int(n.Load())
	if stopRedelivery != nil {
		stopRedelivery()
		for last := int64(-1); n.Load() != last; time.Sleep(100 * time.Millisecond) {
			last = n.Load()
		}
	}
	if err := router.Close(); err != nil {
		t.Errorf("router close: %v", err)
	}
	if err := <-ran; err != nil {
		t.Errorf("router: %v", err)
	}
	if err := sub.Close(); err != nil {
		t.Errorf("close subscriber: %v", err)
	}
	return refused
}
