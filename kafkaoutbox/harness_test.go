package kafkaoutbox_test

import (
	"context"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/kafkaoutbox"
)

// partitions is the partition count of every topic the tests seed.
const partitions = 4

// controlledCluster starts a kfake cluster of nodes brokers holding topics
// (closed when t ends) that shows every produce request to onProduce
// first: onProduce returns the answer to send instead, or nil to let the
// cluster handle the request (after any c.SleepControl it called).
func controlledCluster(t *testing.T, nodes int, onProduce func(c *kfake.Cluster, req *kmsg.ProduceRequest) kmsg.Response, topics ...string) *kfake.Cluster {
	t.Helper()
	c, err := kfake.NewCluster(kfake.NumBrokers(nodes), kfake.SeedTopics(partitions, topics...))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	c.ControlKey(kmsg.Produce.Int16(), func(r kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		if resp := onProduce(c, r.(*kmsg.ProduceRequest)); resp != nil {
			return resp, nil, true
		}
		return nil, nil, false
	})
	return c
}

// startCluster starts a kfake broker holding topics, closed when t ends,
// whose every produce request takes latency more (a replicated cluster's
// acks=all), and returns its addresses and a count of the produce requests
// it received.
func startCluster(t *testing.T, latency time.Duration, topics ...string) ([]string, *atomic.Int64) {
	t.Helper()
	var produces atomic.Int64
	c := controlledCluster(t, 1, func(c *kfake.Cluster, _ *kmsg.ProduceRequest) kmsg.Response {
		produces.Add(1)
		if latency > 0 {
			c.SleepControl(func() { time.Sleep(latency) })
		}
		return nil
	}, topics...)
	return c.ListenAddrs(), &produces
}

// byKey is the marshaler of the tests: a message's partition key is its
// "key" metadata, as services key the events of one entity.
func byKey() kafka.MarshalerUnmarshaler {
	return kafka.NewWithPartitioningMarshaler(func(_ string, msg *message.Message) (string, error) {
		return msg.Metadata.Get("key"), nil
	})
}

// saramaVersion is the protocol version of every client of the tests
// (watermill-kafka's default, 1.0, works with kfake too).
var saramaVersion = sarama.V2_8_0_0

// publisherConfig is kafka.PublisherConfig for brokers with the tests'
// marshaler and kafkaoutbox's default sarama settings at saramaVersion.
func publisherConfig(brokers []string, sarama *sarama.Config) kafka.PublisherConfig {
	sarama.Version = saramaVersion
	return kafka.PublisherConfig{Brokers: brokers, Marshaler: byKey(), OverwriteSaramaConfig: sarama}
}

// subscribe returns a watermill-kafka subscriber of brokers in consumer
// group group, reading from the oldest offset, closed when t ends.
func subscribe(t *testing.T, brokers []string, group string) *kafka.Subscriber {
	t.Helper()
	cfg := kafka.DefaultSaramaSubscriberConfig()
	cfg.Version = saramaVersion
	cfg.Consumer.Offsets.Initial = sarama.OffsetOldest
	sub, err := kafka.NewSubscriber(kafka.SubscriberConfig{Brokers: brokers, Unmarshaler: byKey(),
		OverwriteSaramaConfig: cfg, ConsumerGroup: group}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sub.Close() })
	return sub
}

// collect reads topic through sub, acking each message, until done says
// what arrived is enough or 60 s passed, and returns the messages in
// arrival order.
func collect(t *testing.T, sub *kafka.Subscriber, topic string, done func([]*message.Message) bool) []*message.Message {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	ch, err := sub.Subscribe(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	var got []*message.Message
	for !done(got) {
		select {
		case m := <-ch:
			got = append(got, m)
			m.Ack()
		case <-ctx.Done():
			t.Fatalf("after 60 s, %d messages arrived on %s, not what the test waits for", len(got), topic)
		}
	}
	return got
}

// count is collect's done for n messages.
func count(n int) func([]*message.Message) bool {
	return func(got []*message.Message) bool { return len(got) >= n }
}

// sqliteDB opens a SQLite file of t's own: the publisher does not depend on
// the database, whose relay is tested on every database in the inbox
// package.
func sqliteDB(t *testing.T) *sqlx.DB {
	return testdb.OpenSQLite(t, filepath.Join(t.TempDir(), "outbox.db"))
}

// newOutbox returns the relay of db to pub, its table created.
func newOutbox(t *testing.T, db *sqlx.DB, pub message.Publisher, maxAttempts int) *inbox.Outbox {
	t.Helper()
	ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Dialect: inbox.SQLite, Publisher: pub, MaxAttempts: maxAttempts})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	return ob
}

// newRelay returns a SQLite database of t's own and the relay of its
// outbox to brokers through kafkaoutbox's publisher with sarama settings
// cfg (closed when t ends), setting a message aside after maxAttempts.
func newRelay(t *testing.T, brokers []string, cfg *sarama.Config, maxAttempts int) (*sqlx.DB, *inbox.Outbox) {
	t.Helper()
	pub, err := kafkaoutbox.NewPublisher(publisherConfig(brokers, cfg), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pub.Close() })
	db := sqliteDB(t)
	return db, newOutbox(t, db, pub, maxAttempts)
}

// collectAll reads topic from the oldest offset until every UUID in want
// arrived (removing them from want), and returns what arrived.
func collectAll(t *testing.T, brokers []string, topic string, want map[string]bool) []*message.Message {
	t.Helper()
	return collect(t, subscribe(t, brokers, "audit"), topic, func(got []*message.Message) bool {
		for _, m := range got {
			delete(want, m.UUID)
		}
		return len(want) == 0
	})
}

// writeOutputs writes msgs for topic to ob's table in one transaction, as
// a handler's outputs are written.
func writeOutputs(t *testing.T, db *sqlx.DB, ob *inbox.Outbox, topic string, msgs ...*message.Message) {
	t.Helper()
	tx, err := db.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	pub, err := ob.Publisher(tx)
	if err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish(topic, msgs...); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
}

// relayAll runs relay rounds until one finds nothing to relay.
func relayAll(t *testing.T, ob *inbox.Outbox) {
	t.Helper()
	for range 100 {
		r := ob.RelayOnce(context.Background())
		if r.Relayed+r.Failed+r.DeadLettered == 0 && r.Err == nil {
			return
		}
	}
	t.Fatal("the outbox still had messages after 100 relay rounds")
}

// waitForRelayed runs relay rounds, 50 ms apart, until the outbox is empty
// (up to 30 s: sarama's circuit breaker stays open 10 s after the cluster
// recovered).
func waitForRelayed(t *testing.T, ob *inbox.Outbox) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		ob.RelayOnce(context.Background())
		if s, err := ob.Stats(context.Background()); err == nil && s.Pending == 0 {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatal("the outbox still had messages after 30 s of relay rounds")
}

// hungCluster starts a kfake broker holding topic that receives produce
// requests and answers none until release is called (called when t ends
// too), and returns its addresses and a channel that gets a value for each
// produce request held.
func hungCluster(t *testing.T, topic string) (brokers []string, held <-chan struct{}, release func()) {
	t.Helper()
	gate := make(chan struct{})
	var once sync.Once
	release = func() { once.Do(func() { close(gate) }) }
	heldCh := make(chan struct{}, 100)
	c := controlledCluster(t, 1, func(c *kfake.Cluster, _ *kmsg.ProduceRequest) kmsg.Response {
		select {
		case heldCh <- struct{}{}:
		default:
		}
		c.SleepControl(func() { <-gate })
		return nil
	}, topic)
	t.Cleanup(release) // runs before the cluster's Close
	return c.ListenAddrs(), heldCh, release
}

// logLines is a watermill.LoggerAdapter that keeps the messages of its
// Info and Error lines.
type logLines struct {
	mu    sync.Mutex
	lines []string
}

func (l *logLines) add(msg string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, msg)
}

func (l *logLines) Error(msg string, _ error, _ watermill.LogFields) { l.add(msg) }
func (l *logLines) Info(msg string, _ watermill.LogFields)           { l.add(msg) }
func (l *logLines) Debug(string, watermill.LogFields)                {}
func (l *logLines) Trace(string, watermill.LogFields)                {}
func (l *logLines) With(watermill.LogFields) watermill.LoggerAdapter { return l }

// containing returns how many kept lines contain part.
func (l *logLines) containing(part string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, line := range l.lines {
		if strings.Contains(line, part) {
			n++
		}
	}
	return n
}

// partitionZeroAlone puts partition 0 of topic on node 1 of c and the
// others on node 0, so that a fault of node 1 is one partition's.
func partitionZeroAlone(t *testing.T, c *kfake.Cluster, topic string) {
	t.Helper()
	for p := range int32(partitions) {
		node := int32(0)
		if p == 0 {
			node = 1
		}
		if err := c.MoveTopicPartition(topic, p, node); err != nil {
			t.Fatal(err)
		}
	}
}

// produceError is the broker's answer to req that refuses every partition
// of it with code.
func produceError(req *kmsg.ProduceRequest, code int16) *kmsg.ProduceResponse {
	resp := req.ResponseKind().(*kmsg.ProduceResponse)
	for _, t := range req.Topics {
		rt := kmsg.NewProduceResponseTopic()
		rt.Topic, rt.TopicID = t.Topic, t.TopicID
		for _, p := range t.Partitions {
			rp := kmsg.NewProduceResponseTopicPartition()
			rp.Partition, rp.ErrorCode, rp.BaseOffset = p.Partition, code, -1
			rt.Partitions = append(rt.Partitions, rp)
		}
		resp.Topics = append(resp.Topics, rt)
	}
	return resp
}

// faultyCluster starts a kfake broker holding topic, closed when t ends,
// and returns its addresses, refuseNext, which makes it refuse the next
// produce request, every partition of it, with Kafka error code, and
// refused, the number of records that request carried (0 until then).
func faultyCluster(t *testing.T, topic string) (brokers []string, refuseNext func(code int16), refused func() int) {
	t.Helper()
	var next, records atomic.Int32 // the code to refuse the next request with (0: none); its records
	c := controlledCluster(t, 1, func(_ *kfake.Cluster, req *kmsg.ProduceRequest) kmsg.Response {
		code := int16(next.Swap(0))
		if code == 0 {
			return nil
		}
		for _, t := range req.Topics {
			for _, p := range t.Partitions {
				var batch kmsg.RecordBatch
				if batch.ReadFrom(p.Records) == nil {
					records.Add(batch.NumRecords)
				}
			}
		}
		return produceError(req, code)
	}, topic)
	return c.ListenAddrs(), func(code int16) { next.Store(int32(code)) }, func() int { return int(records.Load()) }
}

// newFailFastRelay is newRelay with MaxAttempts 2 and sarama's retries cut
// short, so that a round against a broker that refuses fails fast.
func newFailFastRelay(t *testing.T, brokers []string) (*sqlx.DB, *inbox.Outbox) {
	cfg := kafkaoutbox.DefaultSaramaConfig()
	cfg.Producer.Retry.Max, cfg.Producer.Retry.BackoffFunc, cfg.Producer.Retry.Backoff = 1, nil, 10*time.Millisecond
	cfg.Metadata.Retry.Backoff = 10 * time.Millisecond
	return newRelay(t, brokers, cfg, 2)
}

// customerInvoices returns n messages keyed "customer-<i>", spread over
// the partitions, and their UUIDs as a set.
func customerInvoices(n int) ([]*message.Message, map[string]bool) {
	var msgs []*message.Message
	want := map[string]bool{}
	for i := range n {
		m := message.NewMessage(watermill.NewUUID(), []byte("invoice"))
		m.Metadata.Set("key", "customer-"+strconv.Itoa(i))
		msgs = append(msgs, m)
		want[m.UUID] = true
	}
	return msgs, want
}
