package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// partitionedBroker is a publisher to a broker whose topics have
// partitions (a message's "n" metadata modulo 4), each written or refused
// as a whole per call, as Kafka writes a partition's batch of one produce
// request: a call's messages of a partition that holds a bad message, or
// of a partition that is down, are all refused, the others acked. It says
// each message's outcome with inbox.PublishError when it took some and
// refused others, as kafkaoutbox's Publisher does.
type partitionedBroker struct {
	mu       sync.Mutex
	down     map[int]error   // partitions that refuse everything, with their error
	bad      map[string]bool // UUIDs of the messages refused for what they are
	plain    map[string]bool // UUIDs of the messages refused alone, with an error of neither kind
	accepted map[string]int  // UUID → times acked
	order    map[int][]string
	calls    int  // Publish calls
	whole    bool // a call refused whole says each message's refusal too
}

func newPartitionedBroker() *partitionedBroker {
	return &partitionedBroker{down: map[int]error{}, bad: map[string]bool{}, plain: map[string]bool{},
		accepted: map[string]int{}, order: map[int][]string{}}
}

func brokerPartition(m *message.Message) int {
	n, _ := strconv.Atoi(m.Metadata.Get("n"))
	return n % 4
}

func (b *partitionedBroker) Publish(_ string, msgs ...*message.Message) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.calls++
	refused := map[int]error{}
	for p, err := range b.down {
		refused[p] = err
	}
	for _, m := range msgs {
		if b.bad[m.UUID] {
			if _, ok := refused[brokerPartition(m)]; !ok {
				refused[brokerPartition(m)] = fmt.Errorf("%w: record %s is invalid", inbox.ErrMessageRejected, m.UUID)
			}
		}
	}
	errs := make([]error, len(msgs))
	var first error
	n := 0
	for i, m := range msgs {
		if b.plain[m.UUID] {
			errs[i] = errors.New("the broker refuses the message")
			if first == nil {
				first = errs[i]
			}
			n++
			continue
		}
		if err, ok := refused[brokerPartition(m)]; ok {
			errs[i] = err
			if first == nil {
				first = err
			}
			n++
			continue
		}
		b.accepted[m.UUID]++
		b.order[brokerPartition(m)] = append(b.order[brokerPartition(m)], m.UUID)
	}
	switch n {
	case 0:
		return nil
	case len(msgs):
		if !b.whole {
			return first
		}
	}
	return fmt.Errorf("%d of %d refused: %w", n, len(msgs), &inbox.PublishError{MessageErrors: errs})
}

func (b *partitionedBroker) Close() error { return nil }

// timesAccepted returns how many times the broker acked each of uuids.
func (b *partitionedBroker) timesAccepted(uuids []string) []int {
	b.mu.Lock()
	defer b.mu.Unlock()
	var n []int
	for _, id := range uuids {
		n = append(n, b.accepted[id])
	}
	return n
}

// A partition that is down holds back its own messages only: the relay
// deletes the messages the publisher says the broker acked, wherever they
// stand in the call, instead of sending the whole call again in every
// round, and sets none of the partition's messages aside (refusals that
// wrap ErrBrokerUnavailable use no attempt). Once it is back, its messages
// go, in order, and every message was acked once.
func TestOutboxRelayHoldsBackOnlyTheMessagesThePublisherSaysWereRefused(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		broker := newPartitionedBroker()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, MaxAttempts: 2})
		broker.down[0] = fmt.Errorf("%w: partition 0 has no leader", inbox.ErrBrokerUnavailable)
		ids := writeOutbox(t, db, ob, "payments", 20) // 5 on each partition
		if round := ob.RelayOnce(context.Background()); round.Relayed != 15 || round.DeadLettered != 0 {
			t.Fatalf("first round while partition 0 is down: %+v, want the other partitions' 15 relayed", round)
		}
		for range 5 {
			if round := ob.RelayOnce(context.Background()); round.Relayed != 0 || round.DeadLettered != 0 {
				t.Fatalf("round while partition 0 is down: %+v, want nothing relayed or set aside", round)
			}
		}
		if stats, err := ob.Stats(context.Background()); err != nil || stats.Pending != 5 {
			t.Fatalf("stats while partition 0 is down: %+v (%v), want its 5 messages pending", stats, err)
		}
		broker.mu.Lock()
		delete(broker.down, 0)
		broker.mu.Unlock()
		relayUntilEmpty(t, ob)
		assertOutboxEmpty(t, ob)
		for i, n := range broker.timesAccepted(ids) {
			if n != 1 {
				t.Errorf("message %d acked %d times, want once", i, n)
			}
		}
		if got, want := broker.order[0], []string{ids[0], ids[4], ids[8], ids[12], ids[16]}; fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("partition 0 got %v, want %v", got, want)
		}
	})
}

// A message the broker refuses for what it is takes down with it the
// other messages of its partition's batch. Before the relay sets a message
// aside it publishes it alone: the bad one is set aside, the one refused
// beside it goes, and the other partitions' messages were acked once.
func TestOutboxRelaySetsAsideOnlyTheMessageRefusedAlone(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		broker := newPartitionedBroker()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, MaxAttempts: 1})
		ids := writeOutbox(t, db, ob, "payments", 12)
		broker.bad[ids[1]] = true // partition 1, with ids[5] and ids[9] behind it
		round := ob.RelayOnce(context.Background())
		if round.Relayed != 11 || round.DeadLettered != 1 || !errors.Is(round.Err, inbox.ErrMessageRejected) {
			t.Fatalf("round: %+v, want 11 relayed and the bad message set aside", round)
		}
		want := []int{1, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}
		if got := broker.timesAccepted(ids); fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("times each message was acked: %v, want %v", got, want)
		}
		if got, want := broker.order[1], []string{ids[5], ids[9]}; fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("partition 1 got %v, want %v", got, want)
		}
		var dead []string
		if err := db.Select(&dead, "SELECT uuid FROM "+ob.DeadLetterTable()); err != nil {
			t.Fatal(err)
		}
		if fmt.Sprint(dead) != fmt.Sprint([]string{ids[1]}) {
			t.Errorf("set aside: %v, want only %s", dead, ids[1])
		}
	})
}

// A message the broker refused beside a bad one of its partition's batch
// is tried alone in the same round and goes, however many rounds the bad
// one has left: it waited about MaxAttempts rounds each, its attempts used
// up for another message's fault, whenever other partitions had traffic.
func TestOutboxRelaySendsTheMessagesRefusedBesideABadOneInTheSameRound(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		broker := newPartitionedBroker()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, MaxAttempts: 10})
		ids := writeOutbox(t, db, ob, "payments", 20)
		broker.bad[ids[17]] = true // the last of partition 1: 1, 5, 9, 13, 17
		if round := ob.RelayOnce(context.Background()); round.Relayed != 19 || round.Failed != 1 {
			t.Fatalf("round: %+v, want 19 relayed and the bad one's attempt counted", round)
		}
		if got, want := broker.order[1], []string{ids[1], ids[5], ids[9], ids[13]}; fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("partition 1 got %v, want %v", got, want)
		}
	})
}

// When a message the publisher refused waits for evidence (its last
// attempt, an error of neither kind), the read of the messages behind it
// starts after the whole call: the messages the call published are neither
// sent again nor taken as evidence against it.
func TestOutboxRelayTakesNoMessageThePublisherAckedAsEvidence(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		broker := newPartitionedBroker()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, MaxAttempts: 1})
		ids := writeOutbox(t, db, ob, "payments", 3)
		broker.plain[ids[0]] = true
		round := ob.RelayOnce(context.Background())
		if round.Relayed != 2 || round.DeadLettered != 0 {
			t.Errorf("round: %+v, want the 2 acked relayed and nothing set aside", round)
		}
		if got := broker.timesAccepted(ids); fmt.Sprint(got) != "[0 1 1]" {
			t.Errorf("times each message was acked: %v, want [0 1 1]", got)
		}
	})
}

// A PublishError whose acked entries are typed nil pointers (an error type
// of the publisher's own, returned as a nil *T) says acked too: the call
// was taken as refused whole, and its acked messages were sent again.
func TestOutboxRelayTakesATypedNilEntryAsAcked(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		var sent []string
		pub := publisherFunc(func(_ string, msgs ...*message.Message) error {
			errs := make([]error, len(msgs))
			for i, m := range msgs {
				if i == 0 {
					errs[i] = fmt.Errorf("%w: partition down", inbox.ErrBrokerUnavailable)
					continue
				}
				var none *refusal
				errs[i] = none
				sent = append(sent, m.UUID)
			}
			return &inbox.PublishError{MessageErrors: errs}
		})
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: pub})
		ids := writeOutbox(t, db, ob, "payments", 3)
		if round := ob.RelayOnce(context.Background()); round.Relayed != 2 {
			t.Errorf("round: %+v, want the 2 acked relayed", round)
		}
		if fmt.Sprint(sent) != fmt.Sprint(ids[1:]) {
			t.Errorf("sent %v, want %v once", sent, ids[1:])
		}
	})
}

// refusal is an error type of a publisher's own.
type refusal struct{ reason string }

func (r *refusal) Error() string { return r.reason }

// publisherFunc is a message.Publisher made of its Publish.
type publisherFunc func(topic string, msgs ...*message.Message) error

func (f publisherFunc) Publish(topic string, msgs ...*message.Message) error {
	return f(topic, msgs...)
}
func (publisherFunc) Close() error { return nil }

// Two partitions each hold a message the broker refuses for what it is:
// the messages refused beside either go in the first round, and each bad
// one has its attempt counted in every round. The walk stopped at the
// first bad one while it had attempts left: partition 1's healthy messages
// waited for partition 0's bad one to be set aside.
func TestOutboxRelayGoesOnPastAMessageRefusedForWhatItIs(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		broker := newPartitionedBroker()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, MaxAttempts: 3})
		ids := writeOutbox(t, db, ob, "payments", 20)
		broker.bad[ids[0]], broker.bad[ids[5]] = true, true // partition 0's first, partition 1's second
		round := ob.RelayOnce(context.Background())
		if round.Relayed != 18 || round.Failed != 2 {
			t.Fatalf("round: %+v, want the 18 healthy relayed and both bad ones' attempts counted", round)
		}
		if got, want := broker.order[1], []string{ids[1], ids[9], ids[13], ids[17]}; fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("partition 1 got %v, want %v", got, want)
		}
		relayUntilEmpty(t, ob)
		if stats, err := ob.Stats(context.Background()); err != nil || stats.Pending != 0 || stats.DeadLettered != 2 {
			t.Errorf("stats: %+v (%v), want the two bad ones set aside and nothing pending", stats, err)
		}
		for i, n := range broker.timesAccepted(ids) {
			if want := map[bool]int{true: 0, false: 1}[i == 0 || i == 5]; n != want {
				t.Errorf("message %d acked %d times, want %d", i, n, want)
			}
		}
	})
}

// A call the publisher refused whole, saying of each message that the
// broker cannot take it now (ErrBrokerUnavailable: a partition without a
// leader), is not tried again message by message in the same round: with
// kafkaoutbox each try waits for sarama's retries of that partition (about
// 13 s), and the walk doubled every round's time while it was down. A call
// refused whole with no word of each message has its first message tried
// alone once (the call may have been refused for its size), and no more.
func TestOutboxRelayTriesACallRefusedWholeAsUnavailableOncePerRound(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		for _, each := range []bool{true, false} {
			t.Run(fmt.Sprintf("each message's refusal told %v", each), func(t *testing.T) {
				triesACallRefusedWholeAsUnavailableOncePerRound(t, tdb, db, each)
			})
		}
	})
}

func triesACallRefusedWholeAsUnavailableOncePerRound(t *testing.T, tdb testDB, db *sqlx.DB, each bool) {
	broker := newPartitionedBroker()
	broker.whole = each
	for p := range 4 {
		broker.down[p] = fmt.Errorf("%w: partition %d has no leader", inbox.ErrBrokerUnavailable, p)
	}
	ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, MaxAttempts: 2})
	writeOutbox(t, db, ob, "payments", 8)
	for range 3 {
		if round := ob.RelayOnce(context.Background()); round.Relayed != 0 || round.DeadLettered != 0 || round.Failed != 1 {
			t.Fatalf("round while every partition is down: %+v, want nothing relayed or set aside, and the refusal of the first message in line", round)
		}
	}
	broker.mu.Lock()
	calls := broker.calls
	broker.mu.Unlock()
	if want := map[bool]int{true: 3, false: 6}[each]; calls != want {
		t.Errorf("%d Publish calls in 3 rounds, want %d a round", calls, want/3)
	}
	broker.mu.Lock()
	broker.down = map[int]error{}
	broker.mu.Unlock()
	relayUntilEmpty(t, ob)
	assertOutboxEmpty(t, ob)
}

// leaderElectionBroker is partitionedBroker's Kafka (partitions by "n"
// modulo 4, a partition's messages of a call written or refused whole, a
// batch holding a bad message refused as ErrMessageRejected), whose
// partition 0 has no leader during the calls downDuring says.
type leaderElectionBroker struct {
	mu         sync.Mutex
	calls      int
	bad        map[string]bool
	downDuring func(call int) bool
	order      map[int][]string
}

func (b *leaderElectionBroker) Publish(_ string, msgs ...*message.Message) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.calls++
	refused := map[int]error{}
	if b.downDuring(b.calls) {
		refused[0] = fmt.Errorf("%w: partition 0 has no leader", inbox.ErrBrokerUnavailable)
	}
	for _, m := range msgs {
		if p := brokerPartition(m); b.bad[m.UUID] && refused[p] == nil {
			refused[p] = fmt.Errorf("%w: the batch holding %s is too large", inbox.ErrMessageRejected, m.UUID)
		}
	}
	errs := make([]error, len(msgs))
	n := 0
	for i, m := range msgs {
		if err := refused[brokerPartition(m)]; err != nil {
			errs[i] = err
			n++
			continue
		}
		b.order[brokerPartition(m)] = append(b.order[brokerPartition(m)], m.UUID)
	}
	if n == 0 {
		return nil
	}
	return fmt.Errorf("%d of %d refused: %w", n, len(msgs), &inbox.PublishError{MessageErrors: errs})
}

func (b *leaderElectionBroker) Close() error { return nil }

// Partition 0's batch (ids 0, 4, 8) is refused whole for its bad message
// (ids[4]), and the relay tries each alone; while ids[0] is tried, partition
// 0 has no leader (an election), back for the next publish. ids[8] leaves
// after ids[0], not ahead of it: the walk stops at a message the broker
// cannot take now, since the relay does not know whether a message behind
// it is of its partition.
func TestOutboxRelayKeepsAPartitionsOrderWhenItsFirstMessageCannotGoAlone(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		broker := &leaderElectionBroker{bad: map[string]bool{}, order: map[int][]string{},
			downDuring: func(call int) bool { return call == 2 }}
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, MaxAttempts: 3})
		ids := writeOutbox(t, db, ob, "payments", 12)
		broker.bad[ids[4]] = true
		for range 10 {
			ob.RelayOnce(context.Background())
		}
		broker.mu.Lock()
		defer broker.mu.Unlock()
		if got, want := broker.order[0], []string{ids[0], ids[8]}; fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("partition 0 got %v, want %v", got, want)
		}
	})
}

// Partition 0's batch of 10 is refused whole for a bad message, and right
// after that call the partition loses its leader. The round stops trying
// partition 0 at its first "cannot take it now": each publish to a
// partition without a leader waits for the publisher's retries (about 13 s
// with kafkaoutbox's defaults), and trying its 10 messages one by one held
// the round, its transaction and the other topics for minutes.
func TestOutboxRelayStopsTryingAPartitionThatLostItsLeaderMidRound(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		broker := &leaderElectionBroker{bad: map[string]bool{}, order: map[int][]string{},
			downDuring: func(call int) bool { return call >= 2 }}
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, MaxAttempts: 3})
		ids := writeOutbox(t, db, ob, "payments", 40) // partition 0: 0, 4, … 36
		broker.bad[ids[4]] = true
		ob.RelayOnce(context.Background())
		broker.mu.Lock()
		defer broker.mu.Unlock()
		if broker.calls > 2 {
			t.Errorf("%d publishes in a round whose partition 0 lost its leader, want 2 (the call, then ids[0] alone)", broker.calls)
		}
	})
}

// A publisher says of two messages of one key that the first cannot go now
// (ErrBrokerUnavailable) and that the second was refused with an error of
// neither kind (a request timeout): the second is not tried alone, ahead of
// the first; both go in order once the broker takes them.
func TestOutboxRelaySendsNothingBehindAMessageTheBrokerCannotTakeNow(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		var mu sync.Mutex
		var calls int
		var acked []string
		pub := publisherFunc(func(_ string, msgs ...*message.Message) error {
			mu.Lock()
			defer mu.Unlock()
			if calls++; calls == 1 {
				return &inbox.PublishError{MessageErrors: []error{
					fmt.Errorf("%w: no leader", inbox.ErrBrokerUnavailable), errors.New("request timed out"),
				}}
			}
			for _, m := range msgs {
				acked = append(acked, m.UUID)
			}
			return nil
		})
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: pub, MaxAttempts: 5})
		ids := writeOutbox(t, db, ob, "payments", 2)
		for range 3 {
			ob.RelayOnce(context.Background())
		}
		mu.Lock()
		defer mu.Unlock()
		if fmt.Sprint(acked) != fmt.Sprint(ids) {
			t.Errorf("acked %v, want %v in that order", acked, ids)
		}
	})
}

// A publisher that says of each call's messages, with a PublishError, that
// each is refused for what it is (ErrMessageRejected in its entry, not on
// the call's own error): tried alone, each has its own refusal taken from
// its call's one entry, and both are set aside once they used their
// attempts. The relay took the error of a call of one message as of
// neither kind: the first waited for a message behind it to go through,
// and the second held it back, for good.
func TestOutboxRelayTakesAOneMessageCallsRefusalFromItsPublishError(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		pub := publisherFunc(func(_ string, msgs ...*message.Message) error {
			errs := make([]error, len(msgs))
			for i := range msgs {
				errs[i] = fmt.Errorf("%w: record too large", inbox.ErrMessageRejected)
			}
			return &inbox.PublishError{MessageErrors: errs}
		})
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: pub, MaxAttempts: 2})
		writeOutbox(t, db, ob, "payments", 2)
		for range 4 {
			ob.RelayOnce(context.Background())
		}
		if s, err := ob.Stats(context.Background()); err != nil || s.Pending != 0 || s.DeadLettered != 2 {
			t.Errorf("after 4 rounds (MaxAttempts 2): %+v (%v), want both messages set aside", s, err)
		}
	})
}

// A publisher that refuses a call of several messages as the broker's state
// (a confirm deadline that a large batch outlasts) and takes each message
// alone: the relay's first try of the first message alone gets the topic
// moving, and every message goes. Sending the same call again in every
// round never moved it.
func TestOutboxRelayMovesPastACallRefusedWholeForItsSize(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		broker := &sizeLimitedBroker{}
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker})
		want := writeOutbox(t, db, ob, "payments", 5)
		for range 5 {
			ob.RelayOnce(context.Background())
		}
		broker.mu.Lock()
		defer broker.mu.Unlock()
		if !slices.Equal(broker.sent, want) {
			t.Errorf("sent %v after 5 rounds, want %v, in order", broker.sent, want)
		}
	})
}

// sizeLimitedBroker takes a call of one message and refuses a larger one
// as unavailable, without saying which messages it refused.
type sizeLimitedBroker struct {
	mu   sync.Mutex
	sent []string
}

func (b *sizeLimitedBroker) Publish(_ string, msgs ...*message.Message) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(msgs) > 1 {
		return fmt.Errorf("%w: no confirm within the deadline", inbox.ErrBrokerUnavailable)
	}
	b.sent = append(b.sent, msgs[0].UUID)
	return nil
}

func (b *sizeLimitedBroker) Close() error { return nil }
