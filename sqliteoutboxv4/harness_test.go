package sqliteoutboxv4_test

import (
	"context"
	"encoding/json"
	"errors"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/sqliteoutboxv4"
)

// newDBFile returns the path of a new SQLite file in t's temporary folder.
func newDBFile(t *testing.T) string { return filepath.Join(t.TempDir(), "outbox.db") }

// outboxTopic returns a topic of its own for t, so that every test has its
// own outbox table.
func outboxTopic() string { return "outbox_" + testdb.RandomSuffix() }

// queueSubscriber is the forwarder's subscriber over the queue schema with
// DeleteOnAck, on db, with a batch of batch messages and the default ack
// deadline (30 s), its tables created.
func queueSubscriber(t *testing.T, db *sqlx.DB, topic string, batch int) *wsql.Subscriber {
	return queueSubscriberWithDeadline(t, db, topic, batch, 30*time.Second)
}

// queueSubscriberWithDeadline is queueSubscriber with the given ack
// deadline.
func queueSubscriberWithDeadline(t *testing.T, db *sqlx.DB, topic string, batch int, ackDeadline time.Duration) *wsql.Subscriber {
	t.Helper()
	sub, err := wsql.NewSubscriber(wsql.BeginnerFromStdSQL(db.DB), wsql.SubscriberConfig{
		AckDeadline:    &ackDeadline,
		PollInterval:   10 * time.Millisecond,
		ResendInterval: 10 * time.Millisecond,
		RetryInterval:  10 * time.Millisecond,
		SchemaAdapter:  sqliteoutboxv4.QueueSchema{SubscribeBatchSize: batch},
		OffsetsAdapter: sqliteoutboxv4.QueueOffsetsAdapter{DeleteOnAck: true},
	}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	if err := sub.SubscribeInitialize(topic); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sub.Close() })
	return sub
}

// outboxPublisher publishes through the forwarder's envelope to topic's
// queue table, on exec (a transaction or the pool).
func outboxPublisher(t *testing.T, exec wsql.ContextExecutor, topic string) message.Publisher {
	t.Helper()
	pub, err := wsql.NewPublisher(exec, wsql.PublisherConfig{SchemaAdapter: sqliteoutboxv4.QueueSchema{}}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	return forwarder.NewPublisher(pub, forwarder.PublisherConfig{ForwarderTopic: topic})
}

// runningForwarder is a Watermill forwarder from sub to dest, running until
// stopped.
type runningForwarder struct {
	fwd  *forwarder.Forwarder
	done chan error
	once sync.Once
}

func startForwarder(t *testing.T, sub message.Subscriber, dest message.Publisher, topic string) *runningForwarder {
	t.Helper()
	fwd, err := forwarder.NewForwarder(sub, dest, watermill.NopLogger{}, forwarder.Config{
		ForwarderTopic: topic,
		// Close waits this long for a handler stuck in the destination
		// publish, then gives up on it.
		CloseTimeout: 200 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	f := &runningForwarder{fwd: fwd, done: make(chan error, 1)}
	go func() { f.done <- fwd.Run(context.Background()) }()
	<-fwd.Running()
	t.Cleanup(func() { f.stop() })
	return f
}

// stop closes the forwarder and waits for Run to return. A handler stuck
// in the destination publish makes Close report a timeout: that is the
// hard stop the tests want, so the error is not returned.
func (f *runningForwarder) stop() {
	f.once.Do(func() {
		_ = f.fwd.Close() // "router close timeout" when a publish is stuck
		<-f.done
	})
}

// stallingPublisher forwards to next, except the message with the UUID
// stallOn: until released, a publish of that one records it and then does
// not return, as a broker that took the message and hangs before it
// confirms. Once released, the stuck publishes fail and new ones go to
// next.
type stallingPublisher struct {
	next     message.Publisher
	stallOn  string
	stalled  chan struct{} // closed once stallOn arrived
	release  chan struct{}
	stall    sync.Once
	released sync.Once
}

func newStallingPublisher(t *testing.T, next message.Publisher, stallOn string) *stallingPublisher {
	p := &stallingPublisher{next: next, stallOn: stallOn, stalled: make(chan struct{}), release: make(chan struct{})}
	t.Cleanup(p.unblock)
	return p
}

var errReleased = errors.New("stalled publish released")

func (p *stallingPublisher) Publish(topic string, msgs ...*message.Message) error {
	for _, msg := range msgs {
		if msg.UUID != p.stallOn {
			continue
		}
		select {
		case <-p.release:
		default:
			p.stall.Do(func() { close(p.stalled) })
			<-p.release
			return errReleased
		}
	}
	return p.next.Publish(topic, msgs...)
}

func (p *stallingPublisher) unblock()     { p.released.Do(func() { close(p.release) }) }
func (p *stallingPublisher) Close() error { return nil }

// newDestination is the destination broker: persistent, so that a
// subscriber that comes late still gets every message, and blocking each
// publish until the subscriber acked it, so that messages arrive in the
// order they were published (GoChannel delivers each message from a
// goroutine of its own otherwise). Closed when t ends.
func newDestination(t *testing.T) *gochannel.GoChannel {
	return newGoChannel(t, gochannel.Config{Persistent: true, BlockPublishUntilSubscriberAck: true})
}

// newGoChannel returns a GoChannel closed when t ends.
func newGoChannel(t *testing.T, config gochannel.Config) *gochannel.GoChannel {
	ch := gochannel.NewGoChannel(config, watermill.NopLogger{})
	t.Cleanup(func() { ch.Close() })
	return ch
}

// receive subscribes to topic of ch and returns a function that returns the
// UUID of the next message (acked), failing t after a minute without one.
func receive(t *testing.T, ch *gochannel.GoChannel, topic string) func() string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	msgs, err := ch.Subscribe(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	return func() string {
		t.Helper()
		select {
		case msg := <-msgs:
			msg.Ack()
			return msg.UUID
		case <-time.After(time.Minute):
			t.Fatal("no message forwarded within a minute")
			return ""
		}
	}
}

// queuedUUIDs returns the UUIDs of the messages (inside the forwarder's
// envelopes) in topic's queue table, in offset order.
func queuedUUIDs(t *testing.T, db *sqlx.DB, topic string) []string {
	t.Helper()
	var payloads [][]byte
	if err := db.Select(&payloads, `SELECT payload FROM `+sqliteoutboxv4.QueueSchema{}.MessagesTable(topic)+` ORDER BY "offset"`); err != nil {
		t.Fatal(err)
	}
	uuids := []string{}
	for _, p := range payloads {
		var envelope struct {
			UUID string `json:"uuid"`
		}
		if err := json.Unmarshal(p, &envelope); err != nil {
			t.Fatalf("outbox row %q: %v", p, err)
		}
		uuids = append(uuids, envelope.UUID)
	}
	return uuids
}

// waitEmpty waits until topic's queue table has no row, failing t after a
// minute.
func waitEmpty(t *testing.T, db *sqlx.DB, topic string) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		left := queuedUUIDs(t, db, topic)
		if len(left) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("rows %v still in the outbox a minute after they were forwarded", left)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
