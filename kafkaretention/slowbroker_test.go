package kafkaretention_test

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/kafkaretention"
)

const day = 24 * time.Hour

// Issue 6, "Purge against a slow broker": retention is 7 days, but a segment
// has not rolled and the consumer group's offsets expired, so the broker
// replays day-8 messages from the start. The safe window (retention.ms +
// segment.ms + timestamps ahead + margin: 15 days and an hour) keeps their inbox rows, so the replay is
// skipped; rows processed beyond it are deleted; a naive 7-day window is
// refused. On every database.
//
// The broker is kfake, which applies retention.ms per record batch, by the
// batch's newest timestamp, as Kafka does per segment. The day-8 messages
// are produced in one batch with a message of today (a segment that has not
// rolled); an older batch of day-9 messages alone (a rolled segment) is
// really removed by the retention run, as a control.
func TestPurgeAgainstSlowBroker(t *testing.T) {
	for _, tdb := range testdb.All {
		if tdb.Name == "mysql-clientFoundRows" { // only the claim's rows affected differ
			continue
		}
		t.Run(tdb.Name, func(t *testing.T) {
			t.Parallel()
			slowBroker(t, tdb)
		})
	}
}

func slowBroker(t *testing.T, tdb testdb.DB) {
	ctx := context.Background()
	d := tdb.Dialect
	c, err := kfake.NewCluster(kfake.NumBrokers(1))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	brokers := c.ListenAddrs()
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V2_8_0_0
	admin, err := sarama.NewClusterAdmin(brokers, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { admin.Close() })
	const topic = "orders"
	week := fmt.Sprint((7 * day).Milliseconds())
	if err := admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1,
		ConfigEntries: map[string]*string{"retention.ms": &week, "segment.ms": &week}}, false); err != nil {
		t.Fatal(err)
	}

	// The broker's log: 5 day-9 messages alone in their batch, then 20
	// day-8 messages and one of today in one batch.
	day9 := produce(t, brokers, topic, []time.Duration{9 * day, 9 * day, 9 * day, 9 * day, 9 * day})
	agesB := make([]time.Duration, 21)
	for i := range 20 {
		agesB[i] = 8 * day
	}
	batchB := produce(t, brokers, topic, agesB)
	day8, today := batchB[:20], batchB[20]

	var db *sqlx.DB
	if d == inbox.SQLite {
		db = testdb.OpenSQLite(t, filepath.Join(t.TempDir(), "inbox.db"))
	} else {
		db = tdb.Open(t)
	}
	table := "inbox_" + testdb.RandomSuffix()
	testdb.DropLater(t, db, table)
	var duplicates atomic.Int64
	ib, err := inbox.New(inbox.Config{DB: db, Dialect: d, Table: table,
		OnDuplicate: func(inbox.Event) { duplicates.Add(1) }})
	if err != nil {
		t.Fatal(err)
	}
	if d == inbox.PostgreSQLPartitioned {
		// Daily partitions: the naive 7-day purge below must be able to
		// drop day 8's rows (a weekly partition holding them is dropped
		// only once all of its week is older than the window).
		if err := inbox.InitializePartitions(ctx, db, table, inbox.PartitionDay); err != nil {
			t.Fatal(err)
		}
	}
	if err := ib.InitializeSchema(ctx); err != nil {
		t.Fatal(err)
	}
	if d == inbox.PostgreSQLPartitioned {
		var now time.Time
		if err := db.Get(&now, "SELECT now()"); err != nil {
			t.Fatal(err)
		}
		if err := inbox.CreatePartitions(ctx, db, table, now.Add(-18*day), 18); err != nil {
			t.Fatal(err)
		}
	}
	calls := map[string]int{}
	var mu sync.Mutex
	handler := func(msg *message.Message) error {
		mu.Lock()
		calls[msg.UUID]++
		mu.Unlock()
		return nil
	}
	callsOf := func(ids []string) (n int) {
		mu.Lock()
		defer mu.Unlock()
		for _, id := range ids {
			n += calls[id]
		}
		return n
	}

	// Days ago, the consumer processed everything as it arrived.
	if n := replayThroughRouter(t, brokers, topic, ib, handler); n != 26 {
		t.Fatalf("first consumption delivered %d messages, want 26", n)
	}
	if n := callsOf(append(slices.Clone(day9), batchB...)); n != 26 {
		t.Fatalf("handler calls = %d, want 26", n)
	}
	exec(t, db, "UPDATE "+table+" SET processed_at = "+agoSQL(d, 8*day)+" WHERE message_id <> ?", today)
	exec(t, db, "UPDATE "+table+" SET processed_at = "+agoSQL(d, 9*day)+" WHERE message_id IN (?, ?, ?, ?, ?)", anys(day9)...)
	// Rows of messages the broker dropped long ago, beyond the safe window
	// (17 days), and of messages within it (14 days).
	for i := range 10 {
		exec(t, db, "INSERT INTO "+table+" (consumer, message_id, processed_at) VALUES ('billing', ?, "+agoSQL(d, 17*day)+")", fmt.Sprintf("gone-%d", i))
		exec(t, db, "INSERT INTO "+table+" (consumer, message_id, processed_at) VALUES ('billing', ?, "+agoSQL(d, 14*day)+")", fmt.Sprintf("kept-%d", i))
	}

	// The broker's retention runs: the day-9 batch goes, the batch with
	// the day-8 messages stays, for its newest message is today's.
	c.ApplyRetention()

	src, err := kafkaretention.New(kafkaretention.Config{Admin: admin, Topics: []string{topic}})
	if err != nil {
		t.Fatal(err)
	}
	if w, err := src.SafeWindow(ctx); err != nil || w != 15*day+kafkaretention.DefaultFutureTimestamps {
		t.Fatalf("safe window = %v, %v; want 15 days and 1 hour (7 d retention + 7 d segment + 1 h of timestamps ahead + 1 d margin)", w, err)
	}
	rows := func(where string) int {
		var n int
		if err := db.Get(&n, db.Rebind("SELECT COUNT(*) FROM "+table+" WHERE "+where)); err != nil {
			t.Fatal(err)
		}
		return n
	}
	// A naive window of the retention alone is refused, and deletes nothing.
	if n, err := inbox.Purge(ctx, inbox.PurgeConfig{DB: db, Dialect: d, Table: table, OlderThan: 7 * day, Window: src}); !errors.Is(err, inbox.ErrWindowTooShort) || n != 0 {
		t.Errorf("Purge with a 7-day window: %d, %v; want ErrWindowTooShort", n, err)
	}
	naive, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Dialect: d, Table: table, OlderThan: 7 * day, Window: src}})
	if err != nil {
		t.Fatal(err)
	}
	if r := naive.RunOnce(ctx); !errors.Is(r.Err, inbox.ErrWindowTooShort) || r.Deleted != 0 {
		t.Errorf("Purger round with a 7-day window: %+v; want ErrWindowTooShort", r)
	}
	if n := rows("1 = 1"); n != 46 {
		t.Fatalf("rows after the refused purges = %d, want all 46", n)
	}

	// The Purger with the window from Kafka deletes exactly the rows beyond
	// the safe window.
	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Dialect: d, Table: table, Window: src}})
	if err != nil {
		t.Fatal(err)
	}
	if r := p.RunOnce(ctx); r.Err != nil || r.Deleted != 10 {
		t.Fatalf("Purger round with the safe window: %+v; want the 10 rows of 17 days ago deleted", r)
	}
	if gone, kept, left := rows("message_id LIKE 'gone-%'"), rows("message_id LIKE 'kept-%'"), rows("1 = 1"); gone != 0 || kept != 10 || left != 36 {
		t.Fatalf("after the purge: %d rows of 17 days ago, %d of 14 days ago, %d in all; want 0, 10, 36", gone, kept, left)
	}

	// The group's offsets expired: it starts again from the oldest record
	// the broker still has. The replay reaches the handler not once.
	if n := replayThroughRouter(t, brokers, topic, ib, handler); n != 21 {
		t.Fatalf("replay delivered %d messages, want the 21 of the unrolled batch", n)
	}
	if n := callsOf(batchB); n != 21 {
		t.Errorf("handler calls for the replayed messages = %d, want 21 (each once, days ago): the replay was processed again", n)
	}
	if n := duplicates.Load(); n != 21 {
		t.Errorf("duplicates skipped = %d, want 21", n)
	}

	// Control: had the purge used the naive window, the replay would have
	// been processed again.
	if d == inbox.PostgreSQLPartitioned {
		if _, err := inbox.DropPartitions(ctx, db, table, 7*day, nil); err != nil {
			t.Fatal(err)
		}
	} else if _, err := inbox.Purge(ctx, inbox.PurgeConfig{DB: db, Dialect: d, Table: table, OlderThan: 7 * day}); err != nil {
		t.Fatal(err)
	}
	replayThroughRouter(t, brokers, topic, ib, handler)
	if n := callsOf(day8); n != 40 {
		t.Errorf("after a naive 7-day purge the day-8 messages were handled %d times in all, want 40 (processed again)", n)
	}
}

// produce sends one message per age to topic, with a record timestamp that
// old, in one batch, and returns their UUIDs.
func produce(t *testing.T, brokers []string, topic string, ages []time.Duration) []string {
	t.Helper()
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V2_8_0_0
	cfg.Producer.Return.Successes = true
	cfg.Producer.Flush.Messages = len(ages) // all in one batch
	cfg.Producer.Flush.Frequency = 10 * time.Second
	producer, err := sarama.NewSyncProducer(brokers, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer producer.Close()
	var msgs []*sarama.ProducerMessage
	var ids []string
	for _, age := range ages {
		id := watermill.NewUUID()
		ids = append(ids, id)
		msgs = append(msgs, &sarama.ProducerMessage{
			Topic:     topic,
			Value:     sarama.StringEncoder("order"),
			Headers:   []sarama.RecordHeader{{Key: []byte("_watermill_message_uuid"), Value: []byte(id)}},
			Timestamp: time.Now().Add(-age),
		})
	}
	if err := producer.SendMessages(msgs); err != nil {
		t.Fatal(err)
	}
	return ids
}

// replayThroughRouter consumes topic from the oldest record the broker has
// up to its end, as a consumer group without committed offsets does, through
// a router whose handler "billing" runs behind the inbox, and returns how
// many records were delivered (each acked).
func replayThroughRouter(t *testing.T, brokers []string, topic string, ib *inbox.Inbox, h message.NoPublishHandlerFunc) int {
	t.Helper()
	sub := &replaySubscriber{brokers: brokers, done: make(chan struct{}), closing: make(chan struct{})}
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r.AddMiddleware(ib.Middleware)
	r.AddConsumerHandler("billing", topic, sub, h)
	errc := make(chan error, 1)
	go func() { errc <- r.Run(context.Background()) }()
	select {
	case <-sub.done:
	case err := <-errc:
		t.Fatalf("router stopped: %v", err)
	case <-time.After(60 * time.Second):
		t.Fatal("replay not finished within 60s")
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	sub.wg.Wait()
	if sub.err != nil {
		t.Fatal(sub.err)
	}
	return int(sub.acked.Load())
}

// replaySubscriber is a message.Subscriber that reads partition 0 of a topic
// from the oldest record the broker still has up to the end it has when
// subscribing, converts each record as watermill-kafka's default marshaler
// does (the UUID from the _watermill_message_uuid header), delivers one at a
// time and waits for the ack (a nack delivers the record again). done is
// closed once every record was acked.
type replaySubscriber struct {
	brokers   []string
	done      chan struct{}
	closing   chan struct{}
	closeOnce sync.Once
	wg        sync.WaitGroup
	acked     atomic.Int64
	err       error
}

func (s *replaySubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V2_8_0_0
	client, err := sarama.NewClient(s.brokers, cfg)
	if err != nil {
		return nil, err
	}
	end, err := client.GetOffset(topic, 0, sarama.OffsetNewest)
	if err != nil {
		client.Close()
		return nil, err
	}
	consumer, err := sarama.NewConsumerFromClient(client)
	if err != nil {
		client.Close()
		return nil, err
	}
	pc, err := consumer.ConsumePartition(topic, 0, sarama.OffsetOldest)
	if err != nil {
		consumer.Close()
		client.Close()
		return nil, err
	}
	out := make(chan *message.Message)
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer client.Close()
		defer consumer.Close()
		defer pc.Close()
		defer close(out)
		for next := int64(-1); next < end-1; {
			select {
			case rec := <-pc.Messages():
				next = rec.Offset
				if !s.deliver(ctx, out, rec) {
					return
				}
			case err := <-pc.Errors():
				s.err = err
				return
			case <-s.closing:
				return
			case <-ctx.Done():
				return
			}
		}
		close(s.done)
		select {
		case <-s.closing:
		case <-ctx.Done():
		}
	}()
	return out, nil
}

func (s *replaySubscriber) deliver(ctx context.Context, out chan<- *message.Message, rec *sarama.ConsumerMessage) bool {
	var uuid string
	for _, h := range rec.Headers {
		if string(h.Key) == "_watermill_message_uuid" {
			uuid = string(h.Value)
		}
	}
	for {
		msg := message.NewMessage(uuid, rec.Value)
		select {
		case out <- msg:
		case <-s.closing:
			return false
		case <-ctx.Done():
			return false
		}
		select {
		case <-msg.Acked():
			s.acked.Add(1)
			return true
		case <-msg.Nacked():
		case <-s.closing:
			return false
		}
	}
}

func (s *replaySubscriber) Close() error {
	s.closeOnce.Do(func() { close(s.closing) })
	return nil
}

// agoSQL is "the database's now minus ago" in processed_at's representation.
func agoSQL(d inbox.Dialect, ago time.Duration) string {
	us := ago.Microseconds()
	switch d {
	case inbox.PostgreSQL, inbox.PostgreSQLPartitioned:
		return fmt.Sprintf("now() - interval '%d microseconds'", us)
	case inbox.MySQL:
		return fmt.Sprintf("UTC_TIMESTAMP(6) - INTERVAL %d MICROSECOND", us)
	default:
		return fmt.Sprintf("CAST(unixepoch('subsec') * 1000000 AS INTEGER) - %d", us)
	}
}

func exec(t *testing.T, db *sqlx.DB, query string, args ...any) {
	t.Helper()
	if _, err := db.Exec(db.Rebind(query), args...); err != nil {
		t.Fatalf("%s: %v", query, err)
	}
}

func anys(s []string) []any {
	out := make([]any, len(s))
	for i, v := range s {
		out[i] = v
	}
	return out
}
