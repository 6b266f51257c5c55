package inbox_test

import (
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/watermill-inbox/inbox"
)

// On Kafka the poison topic must exist where the broker does not create
// topics on first use (kfake; a cluster with auto.create.topics.enable=false).
// A message the inbox refuses for good (here one without a message id) goes
// to it through Inbox.Middlewares' poison queue and is acked, and the next
// message of its partition is processed. Without the topic the poison
// publish fails, the message is nacked and delivered again, and its
// partition holds behind it (docs/brokers.md).
func TestKafkaPoisonQueueNeedsItsTopic(t *testing.T) {
	for _, seeded := range []bool{true, false} {
		t.Run(fmt.Sprintf("poison-topic=%v", seeded), func(t *testing.T) {
			t.Parallel()
			topics := []string{"orders"}
			if seeded {
				topics = append(topics, inbox.DefaultPoisonTopic)
			}
			cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, topics...))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(cluster.Close)
			logger := watermill.NopLogger{}
			sc := kafka.DefaultSaramaSubscriberConfig()
			sc.Version = sarama.V2_8_0_0
			sc.Consumer.Offsets.Initial = sarama.OffsetOldest
			sub, err := kafka.NewSubscriber(kafka.SubscriberConfig{Brokers: cluster.ListenAddrs(), Unmarshaler: kafka.DefaultMarshaler{},
				OverwriteSaramaConfig: sc, ConsumerGroup: "billing", NackResendSleep: 10 * time.Millisecond}, logger)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { sub.Close() })
			pc := kafka.DefaultSaramaSyncPublisherConfig()
			pc.Version = sarama.V2_8_0_0
			pc.Metadata.Retry.Max, pc.Producer.Retry.Max = 0, 0 // a missing topic refused at once
			pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: cluster.ListenAddrs(), Marshaler: kafka.DefaultMarshaler{},
				OverwriteSaramaConfig: pc}, logger)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { pub.Close() })

			db := sqliteDB(t)
			f := newFixture(t, db)
			ib := f.newInbox(inbox.Config{})
			mws, err := ib.Middlewares(inbox.MiddlewaresConfig{PoisonQueue: pub})
			if err != nil {
				t.Fatal(err)
			}
			var withoutID atomic.Int32 // deliveries of the message that has no id
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
					return func(msg *message.Message) ([]*message.Message, error) {
						if msg.UUID == "" {
							withoutID.Add(1)
						}
						return h(msg)
					}
				})
				r.AddMiddleware(mws...)
				r.AddConsumerHandler("billing", "orders", sub, f.writeBusinessRow)
			})
			if err := pub.Publish("orders", message.NewMessage("", []byte("no id")), message.NewMessage(watermill.NewUUID(), []byte("next"))); err != nil {
				t.Fatal(err)
			}
			deadline := time.Now().Add(caseTimeout)
			if seeded {
				for f.businessRows() == 0 && time.Now().Before(deadline) {
					time.Sleep(10 * time.Millisecond)
				}
				if n, d := f.businessRows(), withoutID.Load(); n != 1 || d != 1 {
					t.Errorf("%d business rows and %d deliveries of the message without an id; want it poisoned once and the next message processed", n, d)
				}
				return
			}
			for withoutID.Load() < 3 && time.Now().Before(deadline) {
				time.Sleep(10 * time.Millisecond)
			}
			if d := withoutID.Load(); d < 3 {
				t.Fatalf("the message without an id was delivered %d times, want it nacked and delivered again", d)
			}
			if n := f.businessRows(); n != 0 {
				t.Errorf("%d business rows: the next message went past one that could not be poisoned", n)
			}
		})
	}
}
