package kafkaoutbox_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/kafkaoutbox"
)

// refusingPublisher is the router's publisher where the inbox writes the
// handler's outputs to the outbox: a message that reached it is a bug.
type refusingPublisher struct{}

func (refusingPublisher) Publish(string, ...*message.Message) error {
	return errors.New("the router's publisher got a message that belongs to the outbox")
}

func (refusingPublisher) Close() error { return nil }

// Kafka → router → inbox → a handler that returns one invoice per order →
// outbox → relay → kafkaoutbox → Kafka: every invoice arrives once, with
// its UUID, payload and metadata, the invoices of one key in the order of
// their orders, and the outbox ends empty.
func TestRelayThroughKafkaPublisher_DeliversEveryOutputOnceInOrder(t *testing.T) {
	ctx := context.Background()
	brokers, _ := startCluster(t, 0, "orders", "invoices")
	const keys, perKey = 8, 25
	upstream, err := kafka.NewPublisher(publisherConfig(brokers, kafka.DefaultSaramaSyncPublisherConfig()), watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer upstream.Close()
	for seq := range perKey {
		for k := range keys {
			m := message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, `{"order":%d}`, seq))
			m.Metadata.Set("key", "customer-"+strconv.Itoa(k))
			m.Metadata.Set("seq", strconv.Itoa(seq))
			if err := upstream.Publish("orders", m); err != nil {
				t.Fatal(err)
			}
		}
	}

	pub, err := kafkaoutbox.NewPublisher(publisherConfig(brokers, kafkaoutbox.DefaultSaramaConfig()), watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	db := sqliteDB(t)
	ob := newOutbox(t, db, pub, 0)
	ib, err := inbox.New(inbox.Config{DB: db, Dialect: inbox.SQLite, Outbox: ob.Publisher})
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.InitializeSchema(ctx); err != nil {
		t.Fatal(err)
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	router.AddPlugin(ob.RouterPlugin)
	router.AddMiddleware(ib.Middleware)
	router.AddHandler("billing", "orders", subscribe(t, brokers, "billing"), "invoices", refusingPublisher{},
		func(msg *message.Message) ([]*message.Message, error) {
			invoice := message.NewMessage(msg.UUID+"-invoice", append([]byte("invoice of "), msg.Payload...))
			invoice.Metadata.Set("key", msg.Metadata.Get("key"))
			invoice.Metadata.Set("seq", msg.Metadata.Get("seq"))
			return []*message.Message{invoice}, nil
		})
	done := make(chan error, 1)
	go func() { done <- router.Run(ctx) }()
	defer func() {
		router.Close()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()

	got := collect(t, subscribe(t, brokers, "audit"), "invoices", count(keys*perKey))
	seen := map[string]bool{}
	next := map[string]int{}
	for _, m := range got {
		if seen[m.UUID] {
			t.Errorf("invoice %s arrived twice", m.UUID)
		}
		seen[m.UUID] = true
		key, seq := m.Metadata.Get("key"), m.Metadata.Get("seq")
		if !strings.HasSuffix(m.UUID, "-invoice") || !bytes.HasPrefix(m.Payload, []byte("invoice of {\"order\":"+seq+"}")) {
			t.Errorf("invoice %s arrived as %q with seq %q", m.UUID, m.Payload, seq)
		}
		if n, _ := strconv.Atoi(seq); n != next[key] {
			t.Errorf("%s: invoice of order %s arrived when %d was next", key, seq, next[key])
		} else {
			next[key]++
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		s, err := ob.Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if s.Pending == 0 && s.DeadLettered == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the outbox still holds %d messages (%d dead letters) after every invoice arrived", s.Pending, s.DeadLettered)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// One Publish call goes to the broker as a batch, not one produce request
// per message: a relay round costs about one broker round trip, whatever
// its size.
func TestPublisher_SendsTheMessagesOfOneCallTogether(t *testing.T) {
	brokers, produces := startCluster(t, 50*time.Millisecond, "invoices")
	pub, err := kafkaoutbox.NewPublisher(publisherConfig(brokers, kafkaoutbox.DefaultSaramaConfig()), watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	batch := func(n int) []*message.Message {
		msgs := make([]*message.Message, n)
		for i := range msgs {
			msgs[i] = message.NewMessage(watermill.NewUUID(), []byte("invoice"))
			msgs[i].Metadata.Set("key", "customer-"+strconv.Itoa(i%partitions))
		}
		return msgs
	}
	if err := pub.Publish("invoices", batch(1)...); err != nil { // the producer's first metadata and id
		t.Fatal(err)
	}
	before := produces.Load()
	const n = 500
	if err := pub.Publish("invoices", batch(n)...); err != nil {
		t.Fatal(err)
	}
	if requests := produces.Load() - before; requests > n/20 {
		t.Errorf("%d messages of one Publish took %d produce requests, want at most %d", n, requests, n/20)
	}
	got := collect(t, subscribe(t, brokers, "audit"), "invoices", count(n+1))
	if len(got) != n+1 {
		t.Errorf("%d messages arrived, want %d", len(got), n+1)
	}
}

// A message the broker keeps refusing (here: larger than the producer's
// Producer.MaxMessageBytes) is set aside after MaxAttempts, and every
// message around it arrives.
func TestRelayThroughKafkaPublisher_SetsAsideAMessageTheBrokerRefuses(t *testing.T) {
	ctx := context.Background()
	brokers, _ := startCluster(t, 0, "invoices")
	cfg := kafkaoutbox.DefaultSaramaConfig()
	cfg.Producer.MaxMessageBytes = 10_000
	pub, err := kafkaoutbox.NewPublisher(publisherConfig(brokers, cfg), watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	db := sqliteDB(t)
	ob := newOutbox(t, db, pub, 2)
	var msgs []*message.Message
	want := map[string]bool{}
	for i := range 11 {
		payload := []byte("invoice")
		if i == 5 {
			payload = bytes.Repeat([]byte("x"), 50_000)
		}
		m := message.NewMessage(watermill.NewUUID(), payload)
		m.Metadata.Set("key", "customer-1")
		msgs = append(msgs, m)
		if i != 5 {
			want[m.UUID] = true
		}
	}
	writeOutputs(t, db, ob, "invoices", msgs...)
	relayAll(t, ob)

	s, err := ob.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if s.Pending != 0 || s.DeadLettered != 1 {
		t.Errorf("outbox: %d pending and %d dead letters, want 0 and 1", s.Pending, s.DeadLettered)
	}
	// At least once: messages the failed batch carried are sent again.
	got := collect(t, subscribe(t, brokers, "audit"), "invoices", func(got []*message.Message) bool {
		for _, m := range got {
			delete(want, m.UUID)
		}
		return len(want) == 0
	})
	for _, m := range got {
		if len(m.Payload) > 1000 {
			t.Errorf("the refused message %s arrived", m.UUID)
		}
	}
}

// A configuration that cannot work fails in NewPublisher, every problem at
// once, and errors.Is matches inbox.ErrInvalidConfig.
func TestNewPublisher_RefusesAnIncompleteConfig(t *testing.T) {
	cfg := sarama.NewConfig() // Producer.Return.Successes false
	_, err := kafkaoutbox.NewPublisher(kafka.PublisherConfig{OverwriteSaramaConfig: cfg}, nil)
	if !errors.Is(err, inbox.ErrInvalidConfig) {
		t.Fatalf("got %v, want an error wrapping inbox.ErrInvalidConfig", err)
	}
	for _, want := range []string{"Brokers", "Marshaler", "Return.Successes"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the error %q does not name %s", err, want)
		}
	}
}

// After Close, Publish fails with ErrPublisherClosed and sends nothing;
// Close again returns nil.
func TestPublisher_PublishAfterCloseFails(t *testing.T) {
	brokers, produces := startCluster(t, 0, "invoices")
	pub, err := kafkaoutbox.NewPublisher(publisherConfig(brokers, kafkaoutbox.DefaultSaramaConfig()), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := pub.Close(); err != nil {
		t.Fatal(err)
	}
	before := produces.Load()
	if err := pub.Publish("invoices", message.NewMessage(watermill.NewUUID(), nil)); !errors.Is(err, kafkaoutbox.ErrPublisherClosed) {
		t.Errorf("Publish after Close: got %v, want ErrPublisherClosed", err)
	}
	if produces.Load() != before {
		t.Error("Publish after Close sent a produce request")
	}
	if err := pub.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}
