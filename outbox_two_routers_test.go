package inbox_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// jitterBroker takes each call after 0 to 3 ms.
type jitterBroker struct{ *brokerStub }

func (b jitterBroker) Publish(topic string, msgs ...*message.Message) error {
	time.Sleep(time.Duration(rand.IntN(4)) * time.Millisecond)
	return b.brokerStub.Publish(topic, msgs...)
}

// Two routers in one process, each adding the same Outbox's RouterPlugin,
// relay one at a time: one writer's outputs, committed one transaction after
// another, arrive in commit order, and when the router whose relay ran
// closes, the other's takes over. Two relays ran side by side, and 17 of
// 400 arrivals came before an earlier commit of the same writer, with
// nothing crashing or refused.
func TestTwoRoutersSharingOneOutboxRelayOneAtATime(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	broker := newBrokerStub()
	ob := newTestOutbox(t, db, inbox.PostgreSQL, inbox.OutboxConfig{Publisher: jitterBroker{broker}, BatchSize: 4,
		PollInterval: 5 * time.Millisecond, Linger: time.Millisecond})
	var routers []*message.Router
	for range 2 {
		routers = append(routers, runRouter(t, func(r *message.Router) {
			r.AddPlugin(ob.RouterPlugin)
			r.AddConsumerHandler("idle", "nothing", newFeed(), func(*message.Message) error { return nil })
		}))
	}
	var written []string
	write := func(n int) {
		for range n {
			tx := db.MustBegin()
			pub, err := ob.Publisher(tx)
			if err != nil {
				t.Fatal(err)
			}
			m := message.NewMessage(watermill.NewUUID(), []byte(strconv.Itoa(len(written))))
			if err := pub.Publish("payments", m); err != nil {
				t.Fatal(err)
			}
			if err := tx.Commit(); err != nil {
				t.Fatal(err)
			}
			written = append(written, m.UUID)
		}
	}
	inOrder := func() {
		t.Helper()
		waitFor(t, func() bool { return len(broker.uuids("payments")) >= len(written) })
		sentOnceInOrder(t, written, broker.uuids("payments"))
	}
	write(400)
	inOrder()
	// Both routers close; a Run of its own waits while another relays,
	// and takes over when that one stops.
	for _, r := range routers {
		if err := r.Close(); err != nil {
			t.Fatal(err)
		}
	}
	if err := ob.WaitStopped(context.Background()); err != nil {
		t.Fatal(err)
	}
	first, stopFirst := context.WithCancel(context.Background())
	second, stopSecond := context.WithCancel(context.Background())
	defer stopSecond()
	firstDone, secondDone := make(chan struct{}), make(chan struct{})
	go func() { defer close(firstDone); _ = ob.Run(first) }()
	write(50)
	inOrder()
	go func() { defer close(secondDone); _ = ob.Run(second) }()
	write(50)
	inOrder()
	stopFirst()
	<-firstDone
	write(50)
	waitFor(t, func() bool { return count(t, db, relayTable(t, ob), "1=1") == 0 })
	stopSecond()
	<-secondDone
}

// RelayOnce called while Run relays (a "flush now" endpoint, a drain at
// shutdown while RouterPlugin's relay is still ending its round) takes turns
// with Run's rounds: side by side, on SQLite a message went twice, and one
// writer's messages went out of order.
func TestRelayOnceBesideRunTakesTurns(t *testing.T) {
	db := sqliteDB(t)
	broker := newBrokerStub()
	ob := newTestOutbox(t, db, inbox.SQLite, inbox.OutboxConfig{Publisher: jitterBroker{broker}, BatchSize: 4,
		PollInterval: 2 * time.Millisecond})
	stop := runRelay(ob)
	defer stop()
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-done:
				return
			default:
				ob.RelayOnce(context.Background())
			}
		}
	}()
	var written []string
	for i := range 200 {
		tx, pub := beginOutbox(t, db, ob)
		m := message.NewMessage(watermill.NewUUID(), []byte(strconv.Itoa(i)))
		if err := pub.Publish("payments", m); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		written = append(written, m.UUID)
	}
	waitFor(t, func() bool { return count(t, db, ob.Table(), "1=1") == 0 })
	close(done)
	wg.Wait()
	sentOnceInOrder(t, written, broker.uuids("payments"))
}

// An OnRound that starts another round with RelayOnce (here: drain at once
// after a round that relayed a full batch) gets its turn: the round's turn
// ends before OnRound. It waited for the turn its own round held, and with
// context.Background() the relay (Run, RouterPlugin) hung for ever, and
// WaitStopped with it; here the inner call has a deadline.
func TestRelayOnceFromOnRoundGetsItsTurn(t *testing.T) {
	db := sqliteDB(t)
	var ob *inbox.Outbox
	var inner []inbox.OutboxRound
	broker := newBrokerStub()
	ob = newTestOutbox(t, db, inbox.SQLite, inbox.OutboxConfig{
		Publisher: broker, BatchSize: 2,
		OnRound: func(r inbox.OutboxRound) {
			if r.Relayed == 2 && len(inner) < 5 {
				ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
				defer cancel()
				inner = append(inner, ob.RelayOnce(ctx))
			}
		},
	})
	ids := writeOutbox(t, db, ob, "orders", 3)
	r := ob.RelayOnce(context.Background())
	t.Logf("outer round: %+v", r)
	for _, in := range inner {
		if in.Err != nil {
			t.Fatalf("RelayOnce from OnRound: %v (it waits for the round that called OnRound: a deadlock with context.Background)", in.Err)
		}
	}
	if got := broker.uuids("orders"); len(got) != len(ids) {
		t.Errorf("sent %d of %d", len(got), len(ids))
	}
}

// Two Runs of one Outbox (two routers that each add ob.RouterPlugin) share
// its memory of the topics the broker refuses: each kept its own, and a
// topic one Run left out for its wait the other read and published at once,
// about twice as often as one Run, its attempts used up twice as fast.
func TestTwoRunsShareOneTopicBackoff(t *testing.T) {
	count := func(runs int) int64 {
		db := sqliteDB(t)
		broker := newBrokerStub()
		var tries atomic.Int64
		broker.setRefuse(func(topic string, m *message.Message) error {
			tries.Add(1)
			return errors.New("no leader")
		})
		ob := newTestOutbox(t, db, inbox.SQLite, inbox.OutboxConfig{Publisher: broker, MaxAttempts: 1000,
			MaxBackoff: 400 * time.Millisecond, PollInterval: 10 * time.Millisecond})
		writeOutbox(t, db, ob, "refused", 1)
		var stops []func()
		for range runs {
			stops = append(stops, runRelay(ob))
		}
		time.Sleep(2 * time.Second)
		for _, stop := range stops {
			stop()
		}
		return tries.Load()
	}
	one, two := count(1), count(2)
	t.Logf("publishes of the refused topic in 2 s: one Run %d, two Runs %d", one, two)
	if two > one*3/2+2 {
		t.Errorf("two Runs tried the refused topic %d times, one Run %d: the topic's backoff is per Run", two, one)
	}
}

// sentOnceInOrder checks that got, the UUIDs the broker took, are written,
// the UUIDs one writer committed one transaction after another, each once
// and in that order.
func sentOnceInOrder(t *testing.T, written, got []string) {
	t.Helper()
	pos := map[string]int{}
	for i, id := range written {
		pos[id] = i
	}
	inversions := 0
	for i := 1; i < len(got); i++ {
		if pos[got[i]] < pos[got[i-1]] {
			inversions++
		}
	}
	if inversions > 0 || len(got) != len(written) {
		t.Errorf("%d arrivals for %d messages, %d of them before an earlier commit of the same writer", len(got), len(written), inversions)
	}
}
