package inbox_test

import (
	"context"
	"fmt"
	"path/filepath"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// meetingPublisher is a broker whose every Publish call waits, up to
// patience, for another call to be in flight beside it, as a broker's
// round trip keeps a call waiting: it tells whether a relay round calls it
// for several topics at once. It keeps each topic's messages in the order
// they arrived.
type meetingPublisher struct {
	patience time.Duration

	mu       sync.Mutex
	inFlight int
	most     int // the most calls in flight at once
	met      chan struct{}
	accepted map[string][]string // topic -> message UUIDs
}

func newMeetingPublisher(patience time.Duration) *meetingPublisher {
	return &meetingPublisher{patience: patience, met: make(chan struct{}), accepted: map[string][]string{}}
}

func (p *meetingPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.mu.Lock()
	p.inFlight++
	first := p.inFlight > p.most && p.inFlight == 2
	p.most = max(p.most, p.inFlight)
	if first {
		close(p.met) // the first time two are in flight
	}
	met := p.met
	p.mu.Unlock()
	select {
	case <-met:
	case <-time.After(p.patience):
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.inFlight--
	for _, m := range msgs {
		p.accepted[topic] = append(p.accepted[topic], m.UUID)
	}
	return nil
}

func (p *meetingPublisher) Close() error { return nil }

// mostInFlight returns the most calls that were in flight at once.
func (p *meetingPublisher) mostInFlight() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.most
}

// commitSpreadOverTopics commits, in one transaction through ob, perTopic
// messages to each of topics, interleaved; it returns each topic's UUIDs
// in the order they were written.
func commitSpreadOverTopics(t *testing.T, db *sqlx.DB, ob *inbox.Outbox, topics []string, perTopic int) map[string][]string {
	t.Helper()
	tx, pub := beginOutbox(t, db, ob)
	written := map[string][]string{}
	for i := range perTopic {
		for _, topic := range topics {
			uuid := fmt.Sprintf("%s-%d", topic, i)
			if err := pub.Publish(topic, message.NewMessage(uuid, []byte("p"))); err != nil {
				t.Fatal(err)
			}
			written[topic] = append(written[topic], uuid)
		}
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	return written
}

// A round whose messages go to several topics publishes to them at once
// (OutboxConfig.TopicConcurrency), each topic's messages in the order they
// were written: one topic after another, each call waiting for the broker,
// a relay of messages spread over 200 topics sent a few hundred a second.
func TestOutboxRoundPublishesToSeveralTopicsAtOnce(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		broker := newMeetingPublisher(5 * time.Second)
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker})
		topics := []string{"tenant-a", "tenant-b", "tenant-c", "tenant-d", "tenant-e", "tenant-f"}
		written := commitSpreadOverTopics(t, db, ob, topics, 5)
		start := time.Now()
		if r := ob.RelayOnce(context.Background()); r.Err != nil || r.Relayed != len(topics)*5 {
			t.Fatalf("round: %+v, want all %d messages relayed", r, len(topics)*5)
		}
		if most := broker.mostInFlight(); most < 2 {
			t.Errorf("the round's publishes to %d topics: at most %d in flight at once (round took %v), want them at once",
				len(topics), most, time.Since(start))
		}
		for _, topic := range topics {
			if got := broker.accepted[topic]; !slices.Equal(got, written[topic]) {
				t.Errorf("sent to %s: %v, want %v in that order", topic, got, written[topic])
			}
		}
		assertOutboxEmpty(t, ob)
	})
}

// TopicConcurrency 1 publishes to one topic at a time, for a publisher
// that is not safe for concurrent use.
func TestOutboxTopicConcurrencyOneCallsThePublisherOneAtATime(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		broker := newMeetingPublisher(20 * time.Millisecond)
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, TopicConcurrency: 1})
		topics := []string{"tenant-a", "tenant-b", "tenant-c", "tenant-d"}
		written := commitSpreadOverTopics(t, db, ob, topics, 3)
		if r := ob.RelayOnce(context.Background()); r.Err != nil || r.Relayed != len(topics)*3 {
			t.Fatalf("round: %+v, want all %d messages relayed", r, len(topics)*3)
		}
		if most := broker.mostInFlight(); most != 1 {
			t.Errorf("TopicConcurrency 1: %d publishes in flight at once, want 1", most)
		}
		for _, topic := range topics {
			if got := broker.accepted[topic]; !slices.Equal(got, written[topic]) {
				t.Errorf("sent to %s: %v, want %v in that order", topic, got, written[topic])
			}
		}
	})
}

// Topics whose first messages the broker refuses on their last attempt,
// walked at once in one round: each walk reads the messages behind on the
// round's transaction, one read at a time, and each topic's refused
// messages are set aside once one behind them is accepted, the rest of
// each topic sent in order.
func TestOutboxRoundWalksSeveralRefusingTopicsAtOnce(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		broker := newBrokerStub()
		broker.refuse = func(_ string, m *message.Message) error {
			if m.UUID[len(m.UUID)-2:] == "-0" {
				return fmt.Errorf("the broker refuses %s", m.UUID)
			}
			return nil
		}
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, MaxAttempts: 1, BatchSize: 8})
		topics := []string{"tenant-a", "tenant-b", "tenant-c", "tenant-d", "tenant-e", "tenant-f", "tenant-g", "tenant-h"}
		written := commitSpreadOverTopics(t, db, ob, topics, 3)
		relayUntilNothingPending(t, ob)
		for _, topic := range topics {
			if got := broker.uuids(topic); !slices.Equal(got, written[topic][1:]) {
				t.Errorf("sent to %s: %v, want %v in that order", topic, got, written[topic][1:])
			}
		}
		stats, err := ob.Stats(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if stats.DeadLettered != int64(len(topics)) {
			t.Errorf("%d messages set aside, want each topic's refused one (%d)", stats.DeadLettered, len(topics))
		}
	})
}

// goexitPublisher ends the goroutine that calls it (runtime.Goexit), as
// t.FailNow or require.* in a test's fake publisher do.
type goexitPublisher struct{}

func (goexitPublisher) Publish(string, ...*message.Message) error { runtime.Goexit(); return nil }
func (goexitPublisher) Close() error                              { return nil }

// A publisher that ends the goroutine of each call, in a round of more
// topics than TopicConcurrency, does not leave the round waiting for ever:
// the round ends, its rows unlocked and none deleted (their outcome is not
// known: they go again), and the next round runs. Every worker ended and the
// round waited to hand them the topics left, holding its rows' locks and
// the Outbox's turn for good, so every later round waited too.
func TestOutboxRoundEndsWhenThePublisherEndsItsGoroutines(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: goexitPublisher{}, TopicConcurrency: 2})
		commitSpreadOverTopics(t, db, ob, []string{"tenant-a", "tenant-b", "tenant-c", "tenant-d"}, 1)
		for round := range 2 {
			done := make(chan struct{})
			go func() {
				defer close(done)
				ob.RelayOnce(context.Background())
			}()
			select {
			case <-done:
			case <-time.After(caseTimeout):
				t.Fatalf("round %d did not end after its publisher's goroutines ended", round+1)
			}
		}
		stats, err := ob.Stats(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if stats.Pending != 4 {
			t.Errorf("%d messages pending after rounds whose publishes never returned, want all 4 (sent again later)", stats.Pending)
		}
	})
}

// goexitOncePublisher ends the goroutine of its first call (runtime.Goexit,
// as t.FailNow in a test's fake does) and hands the later ones to next.
type goexitOncePublisher struct {
	calls atomic.Int32
	next  message.Publisher
}

func (p *goexitOncePublisher) Publish(topic string, msgs ...*message.Message) error {
	if p.calls.Add(1) == 1 {
		runtime.Goexit()
	}
	return p.next.Publish(topic, msgs...)
}

func (p *goexitOncePublisher) Close() error { return nil }

// A publisher that ends the goroutine of one call does not end the relay:
// Run goes on, and the message is sent by a later round. A round of two
// topics or more does so (TestOutboxRoundEndsWhenThePublisherEndsItsGoroutines:
// its calls run on workers), but a round whose batch holds one topic, or
// TopicConcurrency 1, calls the publisher on Run's own goroutine: that
// goroutine ended, Run never returned nor ran another round, and the
// outbox was never relayed again (under RouterPlugin, while the router
// ran on, and WaitStopped returned nil).
func TestOutboxRelayKeepsRunningAfterThePublisherEndsTheGoroutineOfARoundsOnlyCall(t *testing.T) {
	t.Parallel()
	db := openSQLite(t, filepath.Join(t.TempDir(), "outbox.db"))
	broker := newBrokerStub()
	ob := newTestOutbox(t, db, inbox.SQLite, inbox.OutboxConfig{
		Publisher: &goexitOncePublisher{next: broker}, PollInterval: 10 * time.Millisecond,
	})
	commitOutputs(t, db, ob, "invoices", "only")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	returned := make(chan struct{})
	ended := make(chan struct{})
	go func() {
		defer close(ended) // also when the goroutine is ended
		_ = ob.Run(ctx)
		close(returned)
	}()
	deadline := time.After(5 * time.Second)
	for len(broker.uuids("invoices")) == 0 {
		select {
		case <-ended:
			select {
			case <-returned:
			default:
				t.Fatal("Run's goroutine ended inside the publisher's call: no round runs any more, the message stays in the outbox")
			}
			t.Fatal("Run returned before its context ended")
		case <-deadline:
			t.Fatal("the message was not relayed in 5 s")
		case <-time.After(10 * time.Millisecond):
		}
	}
	cancel()
	<-ended
}
