package bench

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

const kafkaPartitions = 8

// BenchmarkKafkaEndToEnd/postgres/<variant>: messages per second from a
// Kafka topic (kfake, in-process, 8 partitions) through a Watermill router
// to a handler that inserts one row in PostgreSQL, with and without the
// inbox. The b.N messages are produced before the clock starts; the clock
// runs from the first message handled to the last, so the consumer group's
// join is not counted.
func BenchmarkKafkaEndToEnd(b *testing.B) {
	for _, v := range []string{"baseline", "inbox"} {
		b.Run("postgres/"+v, func(b *testing.B) {
			db := testdb.OpenPostgres(b, "")
			db.SetMaxOpenConns(kafkaPartitions + 2)
			db.SetMaxIdleConns(kafkaPartitions + 2)
			business := businessTable(b, db)
			var h message.HandlerFunc
			if v == "baseline" {
				h = baseline(b, db, inbox.PostgreSQL, business)
			} else {
				ib, _ := newInbox(b, db, inbox.PostgreSQL, "")
				h = inboxHandler(ib, insertSQL(db, business))
			}
			runKafka(b, h)
		})
	}
}

func runKafka(b *testing.B, h message.HandlerFunc) {
	topic := "orders_" + testdb.RandomSuffix()
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(kafkaPartitions, topic))
	if err != nil {
		b.Fatal(err)
	}
	defer cluster.Close()
	brokers := cluster.ListenAddrs()
	logger := watermill.NopLogger{}

	produce(b, brokers, topic, b.N)

	saramaCfg := kafka.DefaultSaramaSubscriberConfig()
	saramaCfg.Version = sarama.V2_8_0_0
	saramaCfg.Consumer.Offsets.Initial = sarama.OffsetOldest
	saramaCfg.Consumer.MaxWaitTime = 10 * time.Millisecond // commit waits behind the fetch long-poll: see docs/brokers.md
	sub, err := kafka.NewSubscriber(kafka.SubscriberConfig{
		Brokers:               brokers,
		Unmarshaler:           kafka.DefaultMarshaler{},
		OverwriteSaramaConfig: saramaCfg,
		ConsumerGroup:         "billing",
	}, logger)
	if err != nil {
		b.Fatal(err)
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		b.Fatal(err)
	}
	var handled atomic.Int64
	var first, last atomic.Int64
	done := make(chan struct{})
	var once sync.Once
	router.AddConsumerHandler("billing", topic, sub, func(msg *message.Message) error {
		if _, err := h(msg); err != nil {
			return err
		}
		now := time.Now().UnixNano()
		first.CompareAndSwap(0, now)
		if handled.Add(1) == int64(b.N) {
			last.Store(now)
			once.Do(func() { close(done) })
		}
		return nil
	})
	b.ReportAllocs()
	b.ResetTimer()
	go func() { _ = router.Run(context.Background()) }()
	select {
	case <-done:
	case <-time.After(10 * time.Minute):
		b.Fatalf("handled %d of %d messages in 10 minutes", handled.Load(), b.N)
	}
	b.StopTimer()
	router.Close()
	elapsed := time.Duration(last.Load() - first.Load())
	if b.N > 1 && elapsed > 0 {
		b.ReportMetric(float64(b.N-1)/elapsed.Seconds(), "msgs/s")
	}
}

// produce writes n messages to topic, spread over its partitions by key.
func produce(b *testing.B, brokers []string, topic string, n int) {
	cfg := kafka.DefaultSaramaSyncPublisherConfig()
	cfg.Version = sarama.V2_8_0_0
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{
		Brokers:               brokers,
		Marshaler:             kafka.NewWithPartitioningMarshaler(func(_ string, msg *message.Message) (string, error) { return msg.UUID, nil }),
		OverwriteSaramaConfig: cfg,
	}, watermill.NopLogger{})
	if err != nil {
		b.Fatal(err)
	}
	defer pub.Close()
	const batch = 500
	for lo := 0; lo < n; lo += batch {
		msgs := make([]*message.Message, 0, batch)
		for i := lo; i < min(n, lo+batch); i++ {
			msgs = append(msgs, message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf(`{"order":%d}`, i))))
		}
		if err := pub.Publish(topic, msgs...); err != nil {
			b.Fatal(err)
		}
	}
}
