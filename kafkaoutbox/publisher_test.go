package kafkaoutbox_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

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
	db, ob := newRelay(t, brokers, cfg, 2)
	msgs, want := customerInvoicesOversized(11, func(i int) bool { return i == 5 })
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
	for _, m := range collectAll(t, brokers, "invoices", want) {
		if len(m.Payload) > 1000 {
			t.Errorf("the refused message %s arrived", m.UUID)
		}
	}
}

// Two messages in a row that the broker refuses for good (over
// Producer.MaxMessageBytes) are both set aside once they used their
// attempts, and the messages behind them arrive, in order. The relay's
// rule without ErrMessageRejected, set aside once the next message goes
// through, held the topic back for good: the next message was the other
// refused one.
func TestRelayThroughKafkaPublisher_SetsAsideTwoRefusedMessagesInARow(t *testing.T) {
	brokers, _ := startCluster(t, 0, "invoices")
	cfg := kafkaoutbox.DefaultSaramaConfig()
	cfg.Producer.MaxMessageBytes = 10_000
	db, ob := newRelay(t, brokers, cfg, 2)
	msgs, want := customerInvoicesOversized(7, func(i int) bool { return i < 2 })
	writeOutputs(t, db, ob, "invoices", msgs...)
	for range 10 {
		ob.RelayOnce(context.Background())
	}
	if s, err := ob.Stats(context.Background()); err != nil || s.Pending != 0 || s.DeadLettered != 2 {
		t.Fatalf("outbox after 10 rounds: %+v (%v), want nothing pending and the 2 refused set aside", s, err)
	}
	var got []string
	for _, m := range collectAll(t, brokers, "invoices", want) {
		got = append(got, string(m.Payload))
	}
	if w := []string{"invoice 2", "invoice 3", "invoice 4", "invoice 5", "invoice 6"}; fmt.Sprint(got) != fmt.Sprint(w) {
		t.Errorf("arrived %v, want %v", got, w)
	}
}

// customerInvoicesOversized returns n invoices of one customer (one
// partition key), "invoice <i>", the i-th one 50,000 bytes of "x" instead
// when oversized(i) (over a Producer.MaxMessageBytes of 10,000), with the
// UUIDs of the others.
func customerInvoicesOversized(n int, oversized func(i int) bool) ([]*message.Message, map[string]bool) {
	var msgs []*message.Message
	want := map[string]bool{}
	for i := range n {
		payload := []byte("invoice " + strconv.Itoa(i))
		if oversized(i) {
			payload = bytes.Repeat([]byte("x"), 50_000)
		}
		m := message.NewMessage(watermill.NewUUID(), payload)
		m.Metadata.Set("key", "customer-1")
		msgs = append(msgs, m)
		if !oversized(i) {
			want[m.UUID] = true
		}
	}
	return msgs, want
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

// After Close, Publish fails with ErrPublisherClosed, which wraps
// inbox.ErrBrokerUnavailable (a relay still running after it, a shutdown in
// the wrong order, sets nothing aside), and sends nothing; Close again
// returns nil.
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
	if err := pub.Publish("invoices", message.NewMessage(watermill.NewUUID(), nil)); !errors.Is(err, kafkaoutbox.ErrPublisherClosed) ||
		!errors.Is(err, inbox.ErrBrokerUnavailable) {
		t.Errorf("Publish after Close: got %v, want ErrPublisherClosed and inbox.ErrBrokerUnavailable", err)
	}
	if produces.Load() != before {
		t.Error("Publish after Close sent a produce request")
	}
	if err := pub.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

// A broker that does not answer does not hold Close for longer than the
// close timeout: Close returns ErrCloseTimedOut, later Publish calls fail
// at once, and the Publish in progress ends once the broker answers.
func TestPublisher_CloseReturnsWhileTheBrokerDoesNotAnswer(t *testing.T) {
	brokers, held, release := hungCluster(t, "invoices")
	pub, err := kafkaoutbox.NewPublisher(publisherConfig(brokers, kafkaoutbox.DefaultSaramaConfig()), nil,
		kafkaoutbox.WithCloseTimeout(200*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	published := make(chan error, 1)
	go func() {
		published <- pub.Publish("invoices", message.NewMessage(watermill.NewUUID(), []byte("invoice")))
	}()
	select {
	case <-held:
	case <-time.After(30 * time.Second):
		t.Fatal("the produce request did not reach the broker in 30 s")
	}
	closed := make(chan error, 1)
	go func() { closed <- pub.Close() }()
	select {
	case err := <-closed:
		if !errors.Is(err, kafkaoutbox.ErrCloseTimedOut) {
			t.Errorf("Close with a Publish waiting for the broker: got %v, want ErrCloseTimedOut", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Close still waits for the broker after 30 s")
	}
	if err := pub.Publish("invoices", message.NewMessage(watermill.NewUUID(), nil)); !errors.Is(err, kafkaoutbox.ErrPublisherClosed) {
		t.Errorf("Publish after Close: got %v, want ErrPublisherClosed", err)
	}
	release()
	if err := <-published; err != nil {
		t.Errorf("the Publish in progress, once the broker answered: %v", err)
	}
}

// A sarama configuration that weakens the outbox's guarantees is logged
// when the publisher is made; the default one is not.
func TestNewPublisher_LogsAConfigurationThatWeakensTheGuarantees(t *testing.T) {
	brokers, _ := startCluster(t, 0, "invoices")
	weak := func(change func(*sarama.Config)) *sarama.Config {
		cfg := kafkaoutbox.DefaultSaramaConfig()
		change(cfg)
		return cfg
	}
	for name, tc := range map[string]struct {
		cfg  *sarama.Config
		logs bool
	}{
		"default":                          {kafkaoutbox.DefaultSaramaConfig(), false},
		"acks=1":                           {weak(func(c *sarama.Config) { c.Producer.Idempotent = false; c.Producer.RequiredAcks = sarama.WaitForLocal }), true},
		"not idempotent, one open request": {weak(func(c *sarama.Config) { c.Producer.Idempotent = false }), true},
		"watermill-kafka's":                {kafka.DefaultSaramaSyncPublisherConfig(), true},
	} {
		t.Run(name, func(t *testing.T) {
			logger := &logLines{}
			pub, err := kafkaoutbox.NewPublisher(publisherConfig(brokers, tc.cfg), logger)
			if err != nil {
				t.Fatal(err)
			}
			defer pub.Close()
			if logged := logger.containing("weakens the outbox's guarantees") > 0; logged != tc.logs {
				t.Errorf("logged %v, want %v", logged, tc.logs)
			}
		})
	}
}

// A partition without a leader (an election: LEADER_NOT_AVAILABLE) while
// the topic's other partitions take messages is the broker's state, not
// the message's: the relay sets nothing aside however many rounds fail,
// and once the partition has a leader again every message arrives.
func TestRelayThroughKafkaPublisher_SetsNothingAsideWhileAPartitionHasNoLeader(t *testing.T) {
	var leaderless atomic.Bool
	leaderless.Store(true)
	c := controlledCluster(t, 2, func(c *kfake.Cluster, req *kmsg.ProduceRequest) kmsg.Response {
		if c.CurrentNode() != 1 || !leaderless.Load() {
			return nil
		}
		return produceError(req, kerr.LeaderNotAvailable.Code)
	}, "invoices")
	partitionZeroAlone(t, c, "invoices")
	brokers := c.ListenAddrs()
	db, ob := newFailFastRelay(t, brokers)
	msgs, want := customerInvoices(40)
	writeOutputs(t, db, ob, "invoices", msgs...)
	for i := range 6 {
		r := ob.RelayOnce(context.Background())
		if r.DeadLettered != 0 {
			t.Fatalf("a round while partition 0 has no leader set %d messages aside", r.DeadLettered)
		}
		// The error says why, not only how many ("kafka: Failed to
		// deliver 1 messages").
		if i == 0 && (r.Err == nil || !strings.Contains(r.Err.Error(), sarama.ErrLeaderNotAvailable.Error())) {
			t.Errorf("first round's error: %v, want the broker's reason: %v", r.Err, sarama.ErrLeaderNotAvailable)
		}
	}
	leaderless.Store(false)
	relayAll(t, ob)
	if s, err := ob.Stats(context.Background()); err != nil || s.Pending != 0 || s.DeadLettered != 0 {
		t.Errorf("outbox: %+v (%v), want nothing pending or set aside", s, err)
	}
	collectAll(t, brokers, "invoices", want)
}

// The same when the cluster's metadata names no leader for the partition
// (an election under way): sarama's lookups of the leader fail, and after
// three of them its circuit breaker answers "circuit breaker is open"
// without asking. That answer is the cluster's state too: before it was
// taken for a refusal of the message, and the partition's first message
// was set aside in the fourth round.
func TestRelayThroughKafkaPublisher_SetsNothingAsideWhileTheMetadataNamesNoLeader(t *testing.T) {
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(partitions, "invoices"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	brokers := c.ListenAddrs()
	db, ob := newFailFastRelay(t, brokers)
	msgs, want := customerInvoices(40)
	writeOutputs(t, db, ob, "invoices", msgs[0]) // the producer learns the leaders
	relayAll(t, ob)
	leaderless := c.Fault(
		kfake.Fault{Keys: []kmsg.Key{kmsg.Metadata}, Topic: "invoices", Partitions: []int32{0}, Err: kerr.LeaderNotAvailable, Count: -1},
		kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: "invoices", Partitions: []int32{0}, Err: kerr.NotLeaderForPartition, Count: -1},
	)
	writeOutputs(t, db, ob, "invoices", msgs[1:]...)
	for range 8 {
		if r := ob.RelayOnce(context.Background()); r.DeadLettered != 0 {
			t.Fatalf("a round while the metadata names no leader for partition 0 set %d messages aside", r.DeadLettered)
		}
		time.Sleep(20 * time.Millisecond)
	}
	leaderless.Remove()
	waitForRelayed(t, ob)
	if s, err := ob.Stats(context.Background()); err != nil || s.Pending != 0 || s.DeadLettered != 0 {
		t.Errorf("outbox: %+v (%v), want nothing pending or set aside", s, err)
	}
	collectAll(t, brokers, "invoices", want)
}

// A produce request the broker refuses (MESSAGE_TOO_LARGE, once) does not
// let the later messages of its partition be written before it: a relay
// round's messages go in one request (sarama gathers them for
// Producer.Flush.Frequency) and are refused or sent again together. A
// consumer that drops repeats by UUID sees them in the order written.
// (Without the flush frequency, sarama sent the first message alone and
// the first arrivals came as 1, 2, … 29, 0, every time.)
func TestRelayThroughKafkaPublisher_KeepsAPartitionsOrderWhenTheBrokerRefusesARequest(t *testing.T) {
	brokers, refuseNext, refused := faultyCluster(t, "invoices")
	db, ob := newRelay(t, brokers, kafkaoutbox.DefaultSaramaConfig(), 0)
	warm := message.NewMessage(watermill.NewUUID(), []byte("warm-up")) // the producer's metadata and id
	warm.Metadata.Set("key", "customer-1")
	writeOutputs(t, db, ob, "invoices", warm)
	relayAll(t, ob)
	var msgs []*message.Message
	for seq := range 30 {
		m := message.NewMessage(watermill.NewUUID(), []byte("invoice"))
		m.Metadata.Set("key", "customer-1")
		m.Metadata.Set("seq", strconv.Itoa(seq))
		msgs = append(msgs, m)
	}
	writeOutputs(t, db, ob, "invoices", msgs...)
	refuseNext(kerr.MessageTooLarge.Code)
	relayAll(t, ob)
	if n := refused(); n != len(msgs) {
		// Handing the call to sarama outlasted Producer.Flush.Frequency (a
		// loaded machine): the documented exception, nothing to check.
		t.Skipf("the refused request carried %d of the %d messages: sarama split the call", n, len(msgs))
	}
	var order []string // the seq of each message's first arrival
	collect(t, subscribe(t, brokers, "audit"), "invoices", func(got []*message.Message) bool {
		order = order[:0]
		seen := map[string]bool{}
		for _, m := range got {
			if !seen[m.UUID] && m.UUID != warm.UUID {
				seen[m.UUID] = true
				order = append(order, m.Metadata.Get("seq"))
			}
		}
		return len(order) == len(msgs)
	})
	for i, seq := range order {
		if seq != strconv.Itoa(i) {
			t.Fatalf("first arrivals by seq: %v, want 0 to 29 in order", order)
		}
	}
}

// A partition that refuses its messages, with a retriable error or not
// (an election, a producer out of sequence, an error Kafka does not name),
// holds back its own messages and none of the other partitions': the
// broker took theirs in the first round, and the relay deleted them (the
// call's error says which were acked) instead of sending the whole call
// again each round. Nothing is set aside, however many rounds the
// partition refuses: the messages the other partitions took are no
// evidence against its own. Once it takes them again, each message is in
// the log once, in its key's order.
func TestRelayThroughKafkaPublisher_APartitionThatRefusesHoldsBackOnlyItsOwnMessages(t *testing.T) {
	for _, code := range []int16{kerr.OutOfOrderSequenceNumber.Code, kerr.UnknownServerError.Code, kerr.LeaderNotAvailable.Code} {
		t.Run(kerr.ErrorForCode(code).(*kerr.Error).Message, func(t *testing.T) {
			var sick atomic.Bool
			sick.Store(true)
			var written atomic.Int64 // records of the produce requests the cluster took
			c := controlledCluster(t, 2, func(c *kfake.Cluster, req *kmsg.ProduceRequest) kmsg.Response {
				if c.CurrentNode() == 1 && sick.Load() {
					return produceError(req, code)
				}
				for _, t := range req.Topics {
					for _, p := range t.Partitions {
						var batch kmsg.RecordBatch
						if batch.ReadFrom(p.Records) == nil {
							written.Add(int64(batch.NumRecords))
						}
					}
				}
				return nil
			}, "invoices")
			partitionZeroAlone(t, c, "invoices")
			brokers := c.ListenAddrs()
			db, ob := newFailFastRelay(t, brokers) // MaxAttempts 2
			var msgs []*message.Message
			want := map[string]bool{}
			for i := range 40 {
				m := message.NewMessage(watermill.NewUUID(), []byte("invoice"))
				m.Metadata.Set("key", "customer-"+strconv.Itoa(i%8))
				m.Metadata.Set("seq", strconv.Itoa(i))
				msgs = append(msgs, m)
				want[m.UUID] = true
			}
			writeOutputs(t, db, ob, "invoices", msgs...)
			first := ob.RelayOnce(context.Background())
			if first.Relayed == 0 || first.Relayed == len(msgs) || !errors.Is(first.Err, inbox.ErrBrokerUnavailable) {
				t.Fatalf("first round: %d relayed of %d, error %v: want the other partitions' relayed, and partition 0's refusal the broker's state (inbox.ErrBrokerUnavailable)", first.Relayed, len(msgs), first.Err)
			}
			held := len(msgs) - first.Relayed
			for range 4 {
				r := ob.RelayOnce(context.Background())
				if r.DeadLettered != 0 || r.Relayed != 0 {
					t.Fatalf("a round while partition 0 refuses: %d relayed, %d set aside, want none", r.Relayed, r.DeadLettered)
				}
			}
			if s, err := ob.Stats(context.Background()); err != nil || s.Pending != int64(held) {
				t.Fatalf("outbox while partition 0 refuses: %+v (%v), want its %d messages pending", s, err, held)
			}
			if n := written.Load(); n != int64(first.Relayed) {
				t.Errorf("the cluster took %d records while partition 0 refused, want the %d relayed once each", n, first.Relayed)
			}
			sick.Store(false)
			waitForRelayed(t, ob)
			if s, err := ob.Stats(context.Background()); err != nil || s.DeadLettered != 0 {
				t.Errorf("outbox: %+v (%v), want nothing set aside", s, err)
			}
			got := collectAll(t, brokers, "invoices", want)
			if n := written.Load(); n != int64(len(msgs)) {
				t.Errorf("the cluster took %d records for %d messages, want each once", n, len(msgs))
			}
			last := map[string]int{} // per key, the seq of the latest first arrival
			seen := map[string]bool{}
			for _, m := range got {
				if seen[m.UUID] {
					continue
				}
				seen[m.UUID] = true
				seq, _ := strconv.Atoi(m.Metadata.Get("seq"))
				if prev, ok := last[m.Metadata.Get("key")]; ok && seq < prev {
					t.Errorf("key %s: seq %d arrived after seq %d", m.Metadata.Get("key"), seq, prev)
				}
				last[m.Metadata.Get("key")] = seq
			}
		})
	}
}

// A topic name no Kafka cluster accepts is refused before anything is sent,
// as a refusal of the messages themselves (inbox.ErrMessageRejected): sarama
// asked the cluster's metadata, its circuit breaker opened, and the
// messages waited for good as if the broker were down. A message the
// marshaler refuses (watermill-kafka reserves a metadata key) is refused
// alone: the others of the call are sent, and the error says each one's
// outcome.
func TestPublisher_RefusesWhatKafkaCannotTakeAsTheMessagesOwnFault(t *testing.T) {
	brokers, produces := startCluster(t, 0, "invoices")
	pub, err := kafkaoutbox.NewPublisher(publisherConfig(brokers, kafkaoutbox.DefaultSaramaConfig()), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pub.Close() })
	for _, topic := range []string{"invoices for customers", strings.Repeat("t", 250), "..", ""} {
		err := pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("invoice")))
		if !errors.Is(err, inbox.ErrMessageRejected) {
			t.Errorf("Publish to %q: %v, want an error wrapping inbox.ErrMessageRejected", topic, err)
		}
	}
	if n := produces.Load(); n != 0 {
		t.Errorf("%d produce requests for topics Kafka cannot hold, want none", n)
	}
	good1 := message.NewMessage(watermill.NewUUID(), []byte("invoice"))
	bad := message.NewMessage(watermill.NewUUID(), []byte("invoice"))
	bad.Metadata.Set(kafka.UUIDHeaderKey, "mine")
	good2 := message.NewMessage(watermill.NewUUID(), []byte("invoice"))
	err = pub.Publish("invoices", good1, bad, good2)
	var pe *inbox.PublishError
	if !errors.As(err, &pe) || len(pe.MessageErrors) != 3 || pe.MessageErrors[0] != nil || pe.MessageErrors[2] != nil ||
		!errors.Is(pe.MessageErrors[1], inbox.ErrMessageRejected) || !errors.Is(err, inbox.ErrMessageRejected) {
		t.Fatalf("Publish with a message the marshaler refuses: %v, want an inbox.PublishError refusing it alone", err)
	}
	got := collect(t, subscribe(t, brokers, "audit"), "invoices", count(2))
	if got[0].UUID != good1.UUID || got[1].UUID != good2.UUID {
		t.Errorf("sent %s, %s; want %s, %s", got[0].UUID, got[1].UUID, good1.UUID, good2.UUID)
	}
}

// A message over the broker's limits is set aside once it used its
// attempts, whichever limit refuses it: MESSAGE_TOO_LARGE (message.max.bytes)
// or RECORD_LIST_TOO_LARGE (a batch over the topic's segment.bytes, which
// Kafka does not retry either). The second was taken as the broker's state
// (inbox.ErrBrokerUnavailable): no attempt used, the message first in line
// on its partition for good.
func TestRelayThroughKafkaPublisher_SetsAsideWhatTheBrokerRefusesAsTooLarge(t *testing.T) {
	for _, code := range []int16{kerr.MessageTooLarge.Code, kerr.RecordListTooLarge.Code} {
		t.Run(kerr.ErrorForCode(code).(*kerr.Error).Message, func(t *testing.T) {
			c := controlledCluster(t, 1, func(_ *kfake.Cluster, req *kmsg.ProduceRequest) kmsg.Response {
				for _, tp := range req.Topics {
					for _, p := range tp.Partitions {
						if len(p.Records) > 5000 {
							return produceError(req, code)
						}
					}
				}
				return nil
			}, "invoices")
			db, ob := newFailFastRelay(t, c.ListenAddrs()) // MaxAttempts 2
			msgs, want := customerInvoicesOversized(3, func(i int) bool { return i == 1 })
			writeOutputs(t, db, ob, "invoices", msgs...)
			for range 6 {
				ob.RelayOnce(context.Background())
			}
			if s, err := ob.Stats(context.Background()); err != nil || s.Pending != 0 || s.DeadLettered != 1 {
				t.Fatalf("outbox after 6 rounds (MaxAttempts 2): %+v (%v), want nothing pending and the oversized message set aside", s, err)
			}
			collectAll(t, c.ListenAddrs(), "invoices", want)
		})
	}
}

// One customer's invoices a, big (over the broker's message.max.bytes) and
// c go to partition 0 in one call, which the broker refuses whole
// (MESSAGE_TOO_LARGE), so the relay tries each alone; while a is tried
// (and sarama retries it once), the partition has no leader (an election),
// back right after. c reaches Kafka after a, not ahead of it: the round
// stops at a's "cannot take it now", and big is set aside once it used its
// attempts.
func TestRelayThroughKafkaPublisher_KeepsAPartitionsOrderThroughAnElectionWhileItsMessagesAreTriedAlone(t *testing.T) {
	var partitionZero atomic.Int32 // produce requests for partition 0
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(partitions, "invoices"),
		kfake.BrokerConfigs(map[string]string{"message.max.bytes": "10000"}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	c.ControlKey(kmsg.Produce.Int16(), func(r kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		req := r.(*kmsg.ProduceRequest)
		for _, tp := range req.Topics {
			for _, p := range tp.Partitions {
				if p.Partition != 0 {
					continue
				}
				if n := partitionZero.Add(1); n == 2 || n == 3 { // a alone, and sarama's retry
					return produceError(req, kerr.LeaderNotAvailable.Code), nil, true
				}
			}
		}
		return nil, nil, false
	})
	brokers := c.ListenAddrs()
	db, ob := newFailFastRelay(t, brokers) // MaxAttempts 2, one sarama retry
	key := keysOfPartitions(t, "invoices", 1)[0]
	invoice := func(payload []byte) *message.Message {
		m := message.NewMessage(watermill.NewUUID(), payload)
		m.Metadata.Set("key", key)
		return m
	}
	a, big, cc := invoice([]byte("invoice a")), invoice(bytes.Repeat([]byte("x"), 20_000)), invoice([]byte("invoice c"))
	writeOutputs(t, db, ob, "invoices", a, big, cc)
	for range 6 {
		ob.RelayOnce(context.Background())
	}
	if s, err := ob.Stats(context.Background()); err != nil || s.Pending != 0 || s.DeadLettered != 1 {
		t.Errorf("outbox after 6 rounds: %+v (%v), want nothing pending and the oversized invoice set aside", s, err)
	}
	var order []string
	for _, m := range collectAll(t, brokers, "invoices", map[string]bool{a.UUID: true, cc.UUID: true}) {
		order = append(order, m.UUID)
	}
	if want := []string{a.UUID, cc.UUID}; fmt.Sprint(order) != fmt.Sprint(want) {
		t.Errorf("partition 0 got %v, want %v", order, want)
	}
}

// keysOfPartitions returns, for each partition p below n, a message key
// that sarama's hash partitioner (kafkaoutbox's) puts on p in topic.
func keysOfPartitions(t *testing.T, topic string, n int) []string {
	t.Helper()
	keys := make([]string, n)
	found := 0
	for i := 0; found < n && i < 10_000; i++ {
		k := "customer-" + strconv.Itoa(i)
		p, err := sarama.NewHashPartitioner(topic).Partition(&sarama.ProducerMessage{Key: sarama.StringEncoder(k)}, partitions)
		if err != nil {
			t.Fatal(err)
		}
		if int(p) < n && keys[p] == "" {
			keys[p] = k
			found++
		}
	}
	if found < n {
		t.Fatalf("no key for each of %d partitions", n)
	}
	return keys
}
