package inbox_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
)

// walkingBroker refuses every call of more than one message, with an
// error that says nothing of each, so that the relay walks the call's
// messages one by one; each single publish takes delay.
type walkingBroker struct {
	delay  time.Duration
	mu     sync.Mutex
	single int // single-message publishes so far
	first  chan struct{}
	once   sync.Once
	// call, when set, is closed as a call of several messages starts, and
	// that call waits for release before it is refused.
	call, release chan struct{}
}

func (b *walkingBroker) Publish(_ string, msgs ...*message.Message) error {
	if len(msgs) > 1 {
		if b.call != nil {
			close(b.call)
			<-b.release
		}
		return errors.New("the request is refused whole")
	}
	b.once.Do(func() { close(b.first) })
	time.Sleep(b.delay)
	b.mu.Lock()
	defer b.mu.Unlock()
	b.single++
	return nil
}

func (b *walkingBroker) Close() error { return nil }

func (b *walkingBroker) singles() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.single
}

// A relay stopped while it walks a refused call's messages one by one
// stops walking: it went on to the end of the batch, one broker round trip
// a message, so that Run (and WaitStopped under RouterPlugin) returned
// only after BatchSize publishes, each of them sent again by the next
// round, since a stopped round records nothing. At most the publish in
// progress ends after the stop.
func TestOutboxRelayStoppedMidWalkStopsWalking(t *testing.T) {
	db := sqliteDB(t)
	broker := &walkingBroker{delay: 20 * time.Millisecond, first: make(chan struct{})}
	ob := newTestOutbox(t, db, inbox.SQLite, inbox.OutboxConfig{Publisher: broker, BatchSize: 200})
	writeOutbox(t, db, ob, "documents", 200)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = ob.Run(ctx) }()
	<-broker.first
	time.Sleep(3 * broker.delay) // a few messages into the walk
	cancel()
	before := broker.singles() // the publish in progress at the stop may end after this
	<-done
	if after := broker.singles(); after > before+1 {
		t.Errorf("%d publishes after the stop, want at most the one in progress", after-before)
	}
	if s, err := ob.Stats(context.Background()); err != nil || s.Pending != 200 {
		t.Errorf("pending %d (%v), want the 200 messages kept for the next round (a stopped round records nothing)", s.Pending, err)
	}
}

// A stop while the call of several messages is in progress starts no walk
// at all after it: the walk's first single publish started after the stop,
// and Run waited one more broker round trip (a broker's whole timeout,
// behind one that does not answer).
func TestOutboxRelayStoppedDuringTheCallStartsNoWalk(t *testing.T) {
	db := sqliteDB(t)
	broker := &walkingBroker{first: make(chan struct{}), call: make(chan struct{}), release: make(chan struct{})}
	ob := newTestOutbox(t, db, inbox.SQLite, inbox.OutboxConfig{Publisher: broker, BatchSize: 20})
	writeOutbox(t, db, ob, "documents", 20)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = ob.Run(ctx) }()
	<-broker.call
	cancel()
	close(broker.release)
	<-done
	if n := broker.singles(); n != 0 {
		t.Errorf("%d single publishes after the stop, want none", n)
	}
}
