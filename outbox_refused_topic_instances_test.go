package inbox_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// slowRefusal refuses every message of its topic after a moment (a broker's
// round trip), counting the tries, and takes the others.
type slowRefusal struct {
	topic string
	tries atomic.Int64
}

func (b *slowRefusal) Publish(topic string, _ ...*message.Message) error {
	if topic != b.topic {
		return nil
	}
	b.tries.Add(1)
	time.Sleep(150 * time.Millisecond)
	return errors.New("no leader for the partition")
}

func (b *slowRefusal) Close() error { return nil }

// With two relay instances on one table, a topic the broker keeps refusing
// is tried about as often as one instance alone would try it, each at most
// once a MaxBackoff: a row the other instance held (SKIP LOCKED) looked
// gone, each instance forgot the topic's wait and started it again from
// 50 ms, and the two took turns trying it nearly back to back (44 tries in
// 10 s at a MaxBackoff of 5 s, against 1 for one instance), each try
// holding up the other topics of the round and using an attempt.
func TestRefusedTopicWaitsItsBackoffWithTwoRelayInstances(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if tdb.Name != "postgres" && tdb.Name != "mysql" {
			t.Skip("postgres and mysql: the databases whose relays share a table (SKIP LOCKED)")
		}
		const maxBackoff = time.Second
		broker := &slowRefusal{topic: "payments"}
		first := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, MaxBackoff: maxBackoff, PollInterval: 10 * time.Millisecond})
		writeOutbox(t, db, first, "payments", 1)
		ctx, cancel := context.WithCancel(context.Background())
		var wg sync.WaitGroup
		for _, ob := range []*inbox.Outbox{first, newInstance(t, tdb, first, broker, maxBackoff)} {
			wg.Go(func() { _ = ob.Run(ctx) })
		}
		time.Sleep(3 * time.Second) // both waits at MaxBackoff by then
		warm := broker.tries.Load()
		const window = 4 * time.Second
		time.Sleep(window)
		cancel()
		wg.Wait()
		tries := broker.tries.Load() - warm
		// One instance tries at most once per MaxBackoff; two, twice as
		// often, and a few more for the rare forgetting that remains.
		if limit := int64(2*window/maxBackoff) + 4; tries > limit {
			t.Errorf("two relay instances tried the refused topic %d times in %v at a MaxBackoff of %v; want at most %d", tries, window, maxBackoff, limit)
		}
		t.Logf("%d tries in %v (%d during the warm-up)", tries, window, warm)
	})
}

// newInstance returns a second Outbox on the table of ob (another relay
// instance), on a pool of its own.
func newInstance(t *testing.T, tdb testDB, ob *inbox.Outbox, broker *slowRefusal, maxBackoff time.Duration) *inbox.Outbox {
	t.Helper()
	other, err := inbox.NewOutbox(inbox.OutboxConfig{DB: tdb.Open(t), Dialect: tdb.Dialect, Table: ob.Table(), Publisher: broker,
		MaxBackoff: maxBackoff, PollInterval: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	return other
}
