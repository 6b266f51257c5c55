package bench

import (
	"fmt"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/kafkaoutbox"
)

// BenchmarkOutboxRelayToKafka/broker-<latency> relays a backlog of b.N
// outbox messages on PostgreSQL to a kfake topic of 8 partitions whose
// every produce request takes latency more (0: kfake in process; 2 ms: a
// replicated cluster's acks=all), once through watermill-kafka's publisher
// (one message per produce request and ack) and once through
// kafkaoutbox's (each relay round's messages in one batch), each with its
// default sarama settings. Reports each one's msgs/s and their ratio.
func BenchmarkOutboxRelayToKafka(b *testing.B) {
	for _, latency := range []time.Duration{0, 2 * time.Millisecond} {
		b.Run("broker-"+latency.String(), func(b *testing.B) {
			tdb := testdb.All[0]
			for _, d := range databases() {
				if d.Name == "postgres" {
					tdb = d
				}
			}
			db := tdb.Open(b)
			rate := map[string]float64{}
			for _, publisher := range []string{"watermill-kafka", "kafkaoutbox"} {
				brokers := slowCluster(b, latency, "invoices")
				var pub message.Publisher
				var err error
				marshaler := kafka.DefaultMarshaler{}
				if publisher == "watermill-kafka" {
					cfg := kafka.DefaultSaramaSyncPublisherConfig()
					cfg.Version = sarama.V2_8_0_0
					pub, err = kafka.NewPublisher(kafka.PublisherConfig{Brokers: brokers, Marshaler: marshaler, OverwriteSaramaConfig: cfg}, watermill.NopLogger{})
				} else {
					cfg := kafkaoutbox.DefaultSaramaConfig()
					cfg.Version = sarama.V2_8_0_0
					pub, err = kafkaoutbox.NewPublisher(kafka.PublisherConfig{Brokers: brokers, Marshaler: marshaler, OverwriteSaramaConfig: cfg}, nil)
				}
				if err != nil {
					b.Fatal(err)
				}
				ob := newBenchOutbox(b, db, tdb.Dialect, pub)
				fillOutbox(b, db, ob.Publisher, "invoices", b.N)
				rate[publisher] = relayBacklogRate(b, ob)
				pub.Close()
			}
			b.ReportMetric(rate["watermill-kafka"], "watermill-kafka-msgs/s")
			b.ReportMetric(rate["kafkaoutbox"], "kafkaoutbox-msgs/s")
			b.ReportMetric(rate["kafkaoutbox"]/rate["watermill-kafka"], "kafkaoutbox/watermill-kafka")
		})
	}
}

// BenchmarkOutboxRelayToManyTopics/broker-<latency> relays a backlog of
// b.N outbox messages on PostgreSQL spread round robin over 200 topics (a
// topic per tenant) through kafkaoutbox's publisher to kfake, as
// BenchmarkOutboxRelayToKafka does: once with each relay round publishing
// to one topic after another (TopicConcurrency 1, the relay before the
// setting) and once to up to DefaultOutboxTopicConcurrency (64) at once.
// Reports each one's msgs/s and their ratio.
func BenchmarkOutboxRelayToManyTopics(b *testing.B) {
	topics := make([]string, 200)
	for i := range topics {
		topics[i] = fmt.Sprintf("tenant-%03d", i)
	}
	for _, latency := range []time.Duration{0, 2 * time.Millisecond} {
		b.Run("broker-"+latency.String(), func(b *testing.B) {
			tdb := testdb.All[0]
			for _, d := range databases() {
				if d.Name == "postgres" {
					tdb = d
				}
			}
			db := tdb.Open(b)
			rate := map[int]float64{}
			for _, concurrency := range []int{1, inbox.DefaultOutboxTopicConcurrency} {
				brokers := slowCluster(b, latency, topics...)
				cfg := kafkaoutbox.DefaultSaramaConfig()
				cfg.Version = sarama.V2_8_0_0
				pub, err := kafkaoutbox.NewPublisher(kafka.PublisherConfig{Brokers: brokers, Marshaler: kafka.DefaultMarshaler{}, OverwriteSaramaConfig: cfg}, nil)
				if err != nil {
					b.Fatal(err)
				}
				ob := newBenchOutboxWith(b, inbox.OutboxConfig{DB: db, Dialect: tdb.Dialect, Publisher: pub, TopicConcurrency: concurrency})
				fillOutboxOver(b, db, ob.Publisher, topics, b.N)
				rate[concurrency] = relayBacklogRate(b, ob)
				pub.Close()
			}
			b.ReportMetric(rate[1], "one-topic-at-a-time-msgs/s")
			b.ReportMetric(rate[inbox.DefaultOutboxTopicConcurrency], "at-once-msgs/s")
			b.ReportMetric(rate[inbox.DefaultOutboxTopicConcurrency]/rate[1], "at-once/one-at-a-time")
		})
	}
}

// slowCluster starts a kfake broker holding topics (8 partitions each),
// closed when b ends, whose every produce request takes latency more.
func slowCluster(b *testing.B, latency time.Duration, topics ...string) []string {
	b.Helper()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(kafkaPartitions, topics...))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(c.Close)
	if latency > 0 {
		c.ControlKey(kmsg.Produce.Int16(), func(kmsg.Request) (kmsg.Response, error, bool) {
			c.KeepControl()
			c.SleepControl(func() { time.Sleep(latency) })
			return nil, nil, false
		})
	}
	return c.ListenAddrs()
}
