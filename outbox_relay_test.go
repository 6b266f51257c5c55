package inbox_test

// The outbox relay (inbox.Outbox): what a handler's transaction writes is
// sent if and only if it commits, at least once, in order per topic, and
// its row is deleted; a message the broker keeps refusing is set aside
// without holding back the rest, and a broker that is down sets nothing
// aside.

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// brokerStub is the broker the relay publishes to: it records what it
// accepted, per topic in order, and refuses what refuse says.
type brokerStub struct {
	mu       sync.Mutex
	accepted map[string][]*message.Message
	refuse   func(topic string, m *message.Message) error
}

func newBrokerStub() *brokerStub { return &brokerStub{accepted: map[string][]*message.Message{}} }

func (b *brokerStub) Publish(topic string, msgs ...*message.Message) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, m := range msgs {
		if b.refuse != nil {
			if err := b.refuse(topic, m); err != nil {
				return err
			}
		}
		b.accepted[topic] = append(b.accepted[topic], m)
	}
	return nil
}

func (b *brokerStub) Close() error { return nil }

func (b *brokerStub) setRefuse(f func(topic string, m *message.Message) error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.refuse = f
}

// refuseUUIDs returns a refuse function for setRefuse that refuses the
// messages of uuids, on any topic, with err.
func refuseUUIDs(err error, uuids ...string) func(string, *message.Message) error {
	return func(_ string, m *message.Message) error {
		if slices.Contains(uuids, m.UUID) {
			return err
		}
		return nil
	}
}

// uuids returns the UUIDs accepted on topic, in order.
func (b *brokerStub) uuids(topic string) []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	var ids []string
	for _, m := range b.accepted[topic] {
		ids = append(ids, m.UUID)
	}
	return ids
}

// newTestOutbox returns an Outbox on a table of its own, created, with cfg's
// other fields.
func newTestOutbox(t *testing.T, db *sqlx.DB, d inbox.Dialect, cfg inbox.OutboxConfig) *inbox.Outbox {
	t.Helper()
	table := "outbox_" + randomSuffix()
	dropLater(t, db, table)
	dropLater(t, db, table+"_dead")
	cfg.DB, cfg.Dialect, cfg.Table = db, d, table
	ob, err := inbox.NewOutbox(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	return ob
}

// beginOutbox begins a transaction on db, rolled back when the test ends
// unless committed, and returns it with ob's publisher in it.
func beginOutbox(t *testing.T, db *sqlx.DB, ob *inbox.Outbox) (*sqlx.Tx, message.Publisher) {
	t.Helper()
	tx, err := db.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback() })
	pub, err := ob.Publisher(tx)
	if err != nil {
		t.Fatal(err)
	}
	return tx, pub
}

// writeOutbox commits n messages to topic through ob's publisher, in one
// transaction, and returns their UUIDs.
func writeOutbox(t *testing.T, db *sqlx.DB, ob *inbox.Outbox, topic string, n int) []string {
	t.Helper()
	tx, pub := beginOutbox(t, db, ob)
	var ids []string
	var msgs []*message.Message
	for i := range n {
		m := message.NewMessage(watermill.NewUUID(), []byte("payload "+strconv.Itoa(i)))
		m.Metadata.Set("n", strconv.Itoa(i))
		msgs = append(msgs, m)
		ids = append(ids, m.UUID)
	}
	if err := pub.Publish(topic, msgs...); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	return ids
}

// runRelay runs ob.Run in a goroutine of its own; the returned function
// stops it and waits until it returned.
func runRelay(ob *inbox.Outbox) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = ob.Run(ctx) }()
	return func() { cancel(); <-done }
}

// relayUntilEmpty runs relay rounds until one relays nothing.
func relayUntilEmpty(t *testing.T, ob *inbox.Outbox) {
	t.Helper()
	for range 1000 {
		round := ob.RelayOnce(context.Background())
		if round.Err == nil && round.Relayed == 0 && round.DeadLettered == 0 {
			return
		}
	}
	t.Fatal("the relay did not empty the outbox in 1,000 rounds")
}

// Through a real router: the messages a handler returns and those it
// publishes through OutboxFromContext reach the broker once its transaction
// commits, with their UUID, payload and metadata; a failed handler's reach
// it never; a duplicate delivery sends nothing again; the table ends empty.
// The relay runs as a router plugin and is woken by the commit (its poll
// interval is an hour).
func TestOutboxRelaySendsWhatCommittedOnly(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		broker := newBrokerStub()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, PollInterval: time.Hour})
		f := newFixture(t, db)
		ib := f.newInbox(inbox.Config{Outbox: ob.Publisher})
		in := newFeed()
		runRouter(t, func(r *message.Router) {
			r.AddPlugin(ob.RouterPlugin)
			r.AddMiddleware(ib.Middleware)
			r.AddHandler("billing", "orders", in, "invoices", broker, func(msg *message.Message) ([]*message.Message, error) {
				pub, ok := inbox.OutboxFromContext(msg.Context())
				if !ok {
					return nil, errors.New("no outbox publisher")
				}
				mail := message.NewMessage(msg.UUID+"-mail", []byte("mail"))
				if err := pub.Publish("mails", mail); err != nil {
					return nil, err
				}
				if msg.Metadata.Get("fail") != "" {
					return nil, errors.New("payment service unavailable")
				}
				invoice := message.NewMessage(msg.UUID+"-invoice", []byte("invoice of "+msg.UUID))
				invoice.Metadata.Set("order", msg.UUID)
				return []*message.Message{invoice}, nil
			})
		})
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		ok := message.NewMessage(watermill.NewUUID(), nil)
		failing := message.NewMessage(watermill.NewUUID(), nil)
		failing.Metadata.Set("fail", "yes")
		for _, m := range []*message.Message{ok, delivery(ok, "again"), failing} {
			want := m.Metadata.Get("fail") == ""
			if acked, err := in.send(ctx, m.Copy()); err != nil || acked != want {
				t.Fatalf("delivery of %s: acked %v (%v), want %v", m.UUID, acked, err, want)
			}
		}
		waitFor(t, func() bool { // the plugin's relay, woken by the commit
			stats, err := ob.Stats(ctx)
			return err == nil && stats.Pending == 0 && len(broker.uuids("invoices")) >= 1 && len(broker.uuids("mails")) >= 1
		})
		if got := broker.uuids("invoices"); len(got) != 1 || got[0] != ok.UUID+"-invoice" {
			t.Errorf("invoices sent: %v, want [%s-invoice]", got, ok.UUID)
		}
		if got := broker.uuids("mails"); len(got) != 1 || got[0] != ok.UUID+"-mail" {
			t.Errorf("mails sent: %v, want [%s-mail]", got, ok.UUID)
		}
		broker.mu.Lock()
		invoice := broker.accepted["invoices"][0]
		broker.mu.Unlock()
		if string(invoice.Payload) != "invoice of "+ok.UUID || invoice.Metadata.Get("order") != ok.UUID {
			t.Errorf("invoice sent with payload %q and metadata %v", invoice.Payload, invoice.Metadata)
		}
		stats, err := ob.Stats(ctx)
		if err != nil || stats.Pending != 0 || stats.DeadLettered != 0 {
			t.Errorf("stats after the relay: %+v (%v), want an empty outbox", stats, err)
		}
	})
}

// Messages written in many transactions leave in the order they were
// written, per topic, whatever the batch size.
func TestOutboxRelayKeepsTheOrderOfATopic(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		broker := newBrokerStub()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, BatchSize: 7})
		var want []string
		for range 20 {
			want = append(want, writeOutbox(t, db, ob, "ledger", 5)...)
			writeOutbox(t, db, ob, "audit", 1)
		}
		relayUntilEmpty(t, ob)
		if got := broker.uuids("ledger"); fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("ledger order:\n got %v\nwant %v", got, want)
		}
		if n := len(broker.uuids("audit")); n != 20 {
			t.Errorf("audit messages sent: %d, want 20", n)
		}
	})
}

// One message the broker refuses for ever: after MaxAttempts tries, once
// the next message of its topic is accepted, it is set aside in the
// dead-letter table and every message behind it is sent, in order.
func TestOutboxRelaySetsAsideAMessageTheBrokerKeepsRefusing(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		broker := newBrokerStub()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, MaxAttempts: 3, BatchSize: 20})
		ids := writeOutbox(t, db, ob, "payments", 50)
		poison := ids[0]
		broker.setRefuse(refuseUUIDs(errors.New("message too large"), poison))
		relayUntilEmpty(t, ob)
		if got := broker.uuids("payments"); fmt.Sprint(got) != fmt.Sprint(ids[1:]) {
			t.Errorf("sent %d messages %v, want the 49 behind the refused one, in order", len(got), got)
		}
		stats, err := ob.Stats(context.Background())
		if err != nil || stats.Pending != 0 || stats.DeadLettered != 1 {
			t.Errorf("stats: %+v (%v), want nothing pending and one dead letter", stats, err)
		}
	})
}

// Whatever the text of a refusal (a publisher may quote a response body or
// a payload: a NUL, bytes that are not UTF-8, characters a latin1 column
// lacks, over the 65,535 bytes of MariaDB's text), the relay stores it as
// the row's last error: the refused message uses its attempts and is set
// aside, and the messages behind it are sent once each. The database
// refused such a text, and the round failed after its publishes: nothing
// was set aside nor deleted, and every message of the round was sent again
// in every round.
func TestOutboxRelayStoresARefusalWhateverItsText(t *testing.T) {
	refusals := map[string]string{
		"NUL and not UTF-8":        "webhook said: \xff\x00\xfe done",
		"beyond latin1":            "le courtier refuse : message trop grand → 📦",
		"longer than 65,535 bytes": strings.Repeat("response body ", 6000),
	}
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		for name, text := range refusals {
			t.Run(name, func(t *testing.T) {
				broker := newBrokerStub()
				ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, MaxAttempts: 2})
				if strings.HasPrefix(tdb.Name, "mysql") {
					// A table of a database whose default character set is
					// latin1 (MariaDB's before 11.6).
					for _, table := range []string{ob.Table(), ob.Table() + "_dead"} {
						exec(t, db, "ALTER TABLE "+table+" MODIFY last_error text CHARACTER SET latin1")
					}
				}
				ids := writeOutbox(t, db, ob, "payments", 3)
				var tries atomic.Int32
				broker.setRefuse(func(_ string, m *message.Message) error {
					if m.UUID == ids[0] {
						tries.Add(1)
						return errors.New(text)
					}
					return nil
				})
				relayUntilEmpty(t, ob)
				wantRelayed(t, ob, broker, ids[1:], 0, 1)
				var stored string
				if err := db.Get(&stored, "SELECT last_error FROM "+ob.Table()+"_dead"); err != nil {
					t.Fatal(err)
				}
				if !utf8.ValidString(stored) || strings.ContainsRune(stored, 0) || len(stored) > 4096 || !strings.HasPrefix(stored, strings.ToValidUTF8(text[:10], "")) {
					t.Errorf("stored last error %.120q (%d bytes), want the refusal's text, printable, at most 4,096 bytes", stored, len(stored))
				}
				if n := tries.Load(); n > 4 {
					t.Errorf("the refused message was published %d times, want its 2 attempts (and the round's first call)", n)
				}
			})
		}
	})
}

// panickyError is an error whose Error method reads its receiver: returned
// as a typed nil pointer, the relay's call of Error panics.
type panickyError struct{ reason string }

func (e *panickyError) Error() string { return e.reason }

// A publisher that panics on a message, or returns a typed nil pointer as
// its error whose Error method panics, is a refusal of that message: it
// uses its attempts and is set aside, and the messages behind it are sent.
// The panic ended the relay's goroutine before, and with it the process
// (RouterPlugin starts the relay on a goroutine of its own), at every start
// while the message stayed first in line.
func TestOutboxRelaySurvivesAPublisherThatPanics(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		for name, how := range map[string]string{"a panic in Publish": "panic", "a typed nil error": "nil"} {
			t.Run(name, func(t *testing.T) {
				broker := newBrokerStub()
				ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, MaxAttempts: 2})
				ids := writeOutbox(t, db, ob, "payments", 3)
				broker.setRefuse(func(_ string, m *message.Message) error {
					if m.UUID != ids[0] {
						return nil
					}
					if how == "panic" {
						panic("index out of range")
					}
					var e *panickyError
					return e
				})
				relayUntilEmpty(t, ob)
				wantRelayed(t, ob, broker, ids[1:], 0, 1)
			})
		}
	})
}

// slowPublisher takes delay before each Publish call to its broker, after
// calling before when it is set.
type slowPublisher struct {
	*brokerStub
	delay  time.Duration
	before *atomic.Pointer[func()]
}

func (p slowPublisher) Publish(topic string, msgs ...*message.Message) error {
	if p.before != nil {
		if f := p.before.Load(); f != nil {
			(*f)()
		}
	}
	time.Sleep(p.delay)
	return p.brokerStub.Publish(topic, msgs...)
}

// A round's transaction stays open, idle, while it publishes: a session
// idle-transaction timeout shorter than a publish (PostgreSQL's
// idle_in_transaction_session_timeout, MariaDB's idle_transaction_timeout,
// set by a DBA on the server or the role) no longer ends the session under
// the round, and the session's own setting is as it was once the round
// ends. The server ended it before: the round failed after its publishes,
// and so did every round after it, each sending the same messages again.
func TestOutboxRelayPublishesForLongerThanTheIdleTransactionTimeout(t *testing.T) {
	cases := []struct {
		name    string
		open    func(t *testing.T) *sqlx.DB
		dialect inbox.Dialect
		delay   time.Duration
		setting string // reads the session's timeout
		want    string
	}{
		{"postgres", func(t *testing.T) *sqlx.DB { return testdb.OpenPostgres(t, "idle_in_transaction_session_timeout=300") },
			inbox.PostgreSQL, 800 * time.Millisecond, "SHOW idle_in_transaction_session_timeout", "300ms"},
		{"mysql", func(t *testing.T) *sqlx.DB { return testdb.OpenMySQL(t, "idle_transaction_timeout=1") },
			inbox.MySQL, 2500 * time.Millisecond, "SELECT @@session.idle_transaction_timeout", "1"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			db := c.open(t)
			db.SetMaxOpenConns(1) // the relay's session is the one read after it
			broker := newBrokerStub()
			var before atomic.Pointer[func()]
			ob := newTestOutbox(t, db, c.dialect, inbox.OutboxConfig{Publisher: slowPublisher{broker, c.delay, &before}})
			ids := writeOutbox(t, db, ob, "payments", 5)
			round := ob.RelayOnce(context.Background())
			if round.Err != nil || round.Relayed != 5 {
				t.Errorf("round: %+v, want the 5 messages relayed", round)
			}
			wantRelayed(t, ob, broker, ids, 0, 0)
			wantSetting := func(when string) {
				t.Helper()
				var setting string
				if err := db.Get(&setting, c.setting); err != nil || setting != c.want {
					t.Errorf("the session's timeout %s: %q (%v), want %q as it was", when, setting, err, c.want)
				}
			}
			wantSetting("after the round")

			// A round whose context ends while it publishes (the router
			// closing) puts it back too: database/sql rolled its transaction
			// back at once, before the round could.
			ctx, cancel := context.WithCancel(context.Background())
			stop := func() { cancel() }
			before.Store(&stop)
			writeOutbox(t, db, ob, "payments", 1)
			ob.RelayOnce(ctx)
			before.Store(nil)
			wantSetting("after a round whose context ended")

			// A round that fails after its publishes puts it back too.
			refuseDeletes(t, db, testDB{Dialect: c.dialect}, ob.Table())
			writeOutbox(t, db, ob, "payments", 1)
			if round := ob.RelayOnce(context.Background()); round.Err == nil {
				t.Errorf("round whose DELETE the database refuses: %+v, want its error", round)
			}
			wantSetting("after a round that failed")
		})
	}
}

// A broker that refuses everything for longer than MaxAttempts rounds sets
// nothing aside: once it is back, every message is sent, in order.
func TestOutboxRelaySetsNothingAsideWhileTheBrokerIsDown(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		broker := newBrokerStub()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, MaxAttempts: 2})
		ids := writeOutbox(t, db, ob, "payments", 30)
		broker.setRefuse(func(string, *message.Message) error { return errors.New("broker unavailable") })
		for range 10 {
			if round := ob.RelayOnce(context.Background()); round.Err == nil || round.Relayed != 0 || round.DeadLettered != 0 {
				t.Fatalf("round while the broker is down: %+v, want an error and nothing relayed or set aside", round)
			}
		}
		// The first in line shows why it waits.
		if st, err := ob.Stats(context.Background()); err != nil || !strings.Contains(st.FirstLastError, "broker unavailable") {
			t.Errorf("stats while the broker is down: %+v (%v), want the first message's last error", st, err)
		}
		sendsAllOnceTheBrokerIsBack(t, ob, broker, ids)
	})
}

// sendsAllOnceTheBrokerIsBack lets broker take everything, relays until
// ob's table is empty and checks that the messages ids of "payments" were
// sent in order with none set aside.
func sendsAllOnceTheBrokerIsBack(t *testing.T, ob *inbox.Outbox, broker *brokerStub, ids []string) {
	t.Helper()
	broker.setRefuse(nil)
	relayUntilEmpty(t, ob)
	wantRelayed(t, ob, broker, ids, 0, 0)
}

// wantRelayed checks that broker took exactly want on "payments", in order,
// and that ob holds pending messages and dead dead letters.
func wantRelayed(t *testing.T, ob *inbox.Outbox, broker *brokerStub, want []string, pending, dead int64) {
	t.Helper()
	if got := broker.uuids("payments"); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("sent %v, want %v, in order, each once", got, want)
	}
	if stats, err := ob.Stats(context.Background()); err != nil || stats.Pending != pending || stats.DeadLettered != dead {
		t.Errorf("stats: %+v (%v), want %d pending and %d dead letters", stats, err, pending, dead)
	}
}

// A message whose refusals wrap ErrBrokerUnavailable (its Kafka partition
// has no leader while the topic's others take messages) is never set
// aside, however many attempts fail: once the broker takes it, every
// message is sent, in order.
func TestOutboxRelayNeverSetsAsideWhatTheBrokerCannotTakeNow(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		broker := newBrokerStub()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, MaxAttempts: 2})
		ids := writeOutbox(t, db, ob, "payments", 30)
		broker.setRefuse(refuseUUIDs(fmt.Errorf("partition 0 has no leader: %w", inbox.ErrBrokerUnavailable), ids[0]))
		for range 6 {
			if round := ob.RelayOnce(context.Background()); round.DeadLettered != 0 {
				t.Fatalf("round while the broker cannot take the first message: %+v, want nothing set aside", round)
			}
		}
		// Those refusals used none of its attempts: refused now for itself,
		// it has its second attempt left.
		broker.setRefuse(refuseUUIDs(errors.New("the broker refuses the message"), ids[0]))
		if round := ob.RelayOnce(context.Background()); round.DeadLettered != 0 || round.Failed != 1 {
			t.Fatalf("first refusal of the message itself: %+v, want one failed attempt and nothing set aside", round)
		}
		broker.setRefuse(nil)
		relayUntilEmpty(t, ob)
		if got := broker.uuids("payments"); fmt.Sprint(got) != fmt.Sprint(ids) {
			t.Errorf("sent %v, want all 30 in order", got)
		}
		if stats, err := ob.Stats(context.Background()); err != nil || stats.DeadLettered != 0 {
			t.Errorf("stats: %+v (%v), want no dead letter", stats, err)
		}
	})
}

// Messages whose refusals wrap ErrMessageRejected (the publisher knows the
// broker refuses them for what they are) are set aside once they used
// their attempts, without waiting for the next message of their topic:
// two in a row no longer hold their topic back for good, and the messages
// behind them are sent, in order.
func TestOutboxRelaySetsAsideRejectedMessagesInARow(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		broker := newBrokerStub()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, MaxAttempts: 2})
		ids := writeOutbox(t, db, ob, "payments", 7)
		broker.setRefuse(refuseUUIDs(fmt.Errorf("%w: too large", inbox.ErrMessageRejected), ids[0], ids[1]))
		for range 4 {
			ob.RelayOnce(context.Background())
		}
		if got := broker.uuids("payments"); fmt.Sprint(got) != fmt.Sprint(ids[2:]) {
			t.Errorf("sent %v, want %v", got, ids[2:])
		}
		if stats, err := ob.Stats(context.Background()); err != nil || stats.Pending != 0 || stats.DeadLettered != 2 {
			t.Errorf("stats: %+v (%v), want the two rejected set aside and nothing pending", stats, err)
		}
	})
}

// Messages the broker keeps refusing with errors that say nothing of why
// (a publisher that does not wrap ErrMessageRejected) are set aside, each
// after MaxAttempts, once a message behind them is accepted: two or three
// in a row no longer hold their topic back for good, nor does one in a
// round of one message (BatchSize 1), whose evidence the relay reads. The
// messages behind them are sent, in order.
func TestOutboxRelaySetsAsideRefusedMessagesInARow(t *testing.T) {
	cases := []struct {
		name      string
		batchSize int
		refused   int // the first messages of the topic, refused for ever
	}{
		{"two in a row", 0, 2},
		{"three in a row", 0, 3},
		{"one in a batch of one", 1, 1},
		{"two in a row in batches of one", 1, 2},
	}
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		for _, c := range cases {
			t.Run(c.name, func(t *testing.T) {
				broker := newBrokerStub()
				ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, MaxAttempts: 2, BatchSize: c.batchSize})
				ids := writeOutbox(t, db, ob, "payments", 6)
				broker.setRefuse(refuseUUIDs(errors.New("the broker refuses the message"), ids[:c.refused]...))
				relayUntilEmpty(t, ob)
				wantRelayed(t, ob, broker, ids[c.refused:], 0, int64(c.refused))
			})
		}
	})
}

// After the outbox's ids start again (an operator's TRUNCATE … RESTART
// IDENTITY, a restored table), a message to set aside can have the id of a
// dead letter already there. It stays first in line, the round's error and
// its last error saying why, and nothing behind it is sent; once that old
// dead letter is moved out, it is set aside and the rest follows, in order.
// (The move failed the whole round before, and the round's other messages
// were sent again in every round; then the messages behind it were sent
// past it.)
func TestOutboxRelayKeepsAMessageWhoseIDTheDeadLetterTableHolds(t *testing.T) {
	refusals := map[string]error{
		"plain refusal":      errors.New("the broker refuses the message"),
		"ErrMessageRejected": fmt.Errorf("%w: too large", inbox.ErrMessageRejected),
	}
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		for name, refusal := range refusals {
			t.Run(name, func(t *testing.T) {
				broker := newBrokerStub()
				ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, MaxAttempts: 1})
				var refused []string
				broker.setRefuse(func(_ string, m *message.Message) error {
					if slices.Contains(refused, m.UUID) {
						return refusal
					}
					return nil
				})
				before := writeOutbox(t, db, ob, "payments", 3)
				refused = append(refused, before[0])
				relayUntilEmpty(t, ob) // the first set aside, with the first id

				restart := map[string]string{
					"postgres": "TRUNCATE TABLE " + ob.Table() + " RESTART IDENTITY",
					"mysql":    "TRUNCATE TABLE " + ob.Table(),
					"sqlite":   "DELETE FROM sqlite_sequence WHERE name = '" + ob.Table() + "'",
				}[strings.SplitN(tdb.Name, "-", 2)[0]]
				exec(t, db, restart)
				after := writeOutbox(t, db, ob, "payments", 3)
				refused = append(refused, after[0])

				for i := range 3 {
					round := ob.RelayOnce(context.Background())
					if round.Err == nil || !strings.Contains(round.Err.Error(), "already holds outbox id") || round.Relayed != 0 || round.DeadLettered != 0 {
						t.Errorf("round %d: %+v, want nothing relayed or set aside and an error that says the dead-letter table holds the id", i+1, round)
					}
				}
				var lastError string
				if err := db.Get(&lastError, db.Rebind("SELECT last_error FROM "+ob.Table()+" WHERE uuid = ?"), after[0]); err != nil || !strings.Contains(lastError, "already holds outbox id") {
					t.Errorf("last error %q (%v), want it to say that the dead-letter table holds the id", lastError, err)
				}
				wantRelayed(t, ob, broker, before[1:], 3, 1)

				exec(t, db, "DELETE FROM "+ob.Table()+"_dead") // the operator moves the old dead letter out
				relayUntilEmpty(t, ob)
				wantRelayed(t, ob, broker, append(slices.Clone(before[1:]), after[1:]...), 0, 1)
			})
		}
	})
}

// A broker that stays down and refuses with errors that say nothing of why
// uses up the attempts of one more message every MaxAttempts rounds, and
// the relay tries each of those again, one by one, to find one the broker
// accepts: the tries of a round stay bounded however long it is down (a
// publisher that fails after a timeout would otherwise spend longer on
// each round), and once the broker is back nothing is set aside and every
// message is sent, in order.
func TestOutboxRelayTriesBoundedlyManyMessagesPerRoundWhileTheBrokerIsDown(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		broker := newBrokerStub()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, MaxAttempts: 1})
		ids := writeOutbox(t, db, ob, "payments", 30)
		var tries atomic.Int32
		broker.setRefuse(func(string, *message.Message) error {
			tries.Add(1)
			return errors.New("connection reset by peer")
		})
		for i := range 25 {
			tries.Store(0)
			if round := ob.RelayOnce(context.Background()); round.Relayed != 0 || round.DeadLettered != 0 {
				t.Fatalf("round %d while the broker is down: %+v, want nothing sent or set aside", i+1, round)
			}
			// The call with every message, then at most 8 that used their
			// attempts, and the one that ends the walk.
			if n := tries.Load(); n > 10 {
				t.Fatalf("round %d while the broker is down tried %d publishes, want at most 10", i+1, n)
			}
		}
		sendsAllOnceTheBrokerIsBack(t, ob, broker, ids)
	})
}

// The next message of a refused message's topic is looked for among the
// 1,000 rows that follow it only (the table has no index on topic): one
// further behind is found once the rows between have left, and nothing is
// lost or sent out of order meanwhile.
func TestOutboxRelaySetsAsideARefusedMessageWhoseNextIsFarBehind(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		broker := newBrokerStub()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, MaxAttempts: 1, BatchSize: 100})
		refused := writeOutbox(t, db, ob, "payments", 1)
		between := writeOutbox(t, db, ob, "orders", 1500)
		behind := writeOutbox(t, db, ob, "payments", 1)
		broker.setRefuse(refuseUUIDs(errors.New("the broker refuses the message"), refused[0]))
		relayUntilEmpty(t, ob)
		wantRelayed(t, ob, broker, behind, 0, 1)
		if got := broker.uuids("orders"); fmt.Sprint(got) != fmt.Sprint(between) {
			t.Errorf("sent %d of the other topic's 1,500, want each once, in order", len(got))
		}
	})
}

// A set-aside ends its topic's walk in that round, and the running relay
// sends the rest of the topic in the next round at once: not a poll
// interval later (an hour here), although nothing commits meanwhile.
func TestOutboxRelaySendsTheRestOfATopicRightAfterASetAside(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		broker := newBrokerStub()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, MaxAttempts: 1, PollInterval: time.Hour})
		ids := writeOutbox(t, db, ob, "payments", 6)
		broker.setRefuse(refuseUUIDs(errors.New("the broker refuses the message"), ids[0]))
		stop := runRelay(ob)
		defer stop()
		for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
			if s, err := ob.Stats(context.Background()); err == nil && s.Pending == 0 {
				break
			}
		}
		stop()
		wantRelayed(t, ob, broker, ids[1:], 0, 1)
	})
}

// A round that published and then could not record it (the database
// refuses the DELETE of the sent rows) leaves its messages in the table, to
// go again. Run then backs off as after any database error, the wait
// doubling from round to round however many commits wake it meanwhile,
// also when the broker refused a message in the same round: otherwise a
// database that keeps failing has the same messages published every few
// milliseconds.
func TestOutboxRelayBacksOffWhileItCannotRecordWhatItSent(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		broker := newBrokerStub()
		var mu sync.Mutex
		var failed []time.Time // when each round that failed ended
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{
			Publisher: broker, MaxAttempts: 1000, MaxBackoff: time.Minute,
			OnRound: func(r inbox.OutboxRound) {
				if r.Err != nil {
					mu.Lock()
					failed = append(failed, time.Now())
					mu.Unlock()
				}
			},
		})
		refuseDeletes(t, db, tdb, relayTable(t, ob))
		refused := writeOutbox(t, db, ob, "payments", 1)
		broker.setRefuse(refuseUUIDs(errors.New("the broker refuses the message"), refused...))
		sent := writeOutbox(t, db, ob, "invoices", 1)
		// A handler whose commits wake the relay all along.
		f := newFixture(t, db)
		ib := f.newInbox(inbox.Config{Outbox: ob.Publisher})
		in := newFeed()
		runRouter(t, func(r *message.Router) {
			r.AddMiddleware(ib.Middleware)
			r.AddHandler("billing", "orders", in, "orders-billed", broker, func(msg *message.Message) ([]*message.Message, error) {
				return []*message.Message{message.NewMessage(watermill.NewUUID(), nil)}, f.writeBusinessRow(msg)
			})
		})
		stop := runRelay(ob)
		failedRounds := func() int {
			mu.Lock()
			defer mu.Unlock()
			return len(failed)
		}
		// Commits wake the relay all along, until it has failed three
		// rounds (about 350 ms of backoff; a loaded machine takes longer).
		for end := time.Now().Add(30 * time.Second); failedRounds() < 3 && time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
			if !in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
				t.Fatal("the handler's message was not acked")
			}
		}
		stop()
		mu.Lock()
		defer mu.Unlock()
		if len(failed) < 3 {
			t.Fatalf("%d failed rounds in 30 s, want at least 3", len(failed))
		}
		wait := inbox.OutboxRetryFirst
		for i := 1; i < len(failed); i++ {
			if gap := failed[i].Sub(failed[i-1]); gap < wait {
				t.Errorf("failed round %d came %v after the one before, want at least the backoff of %v", i+1, gap, wait)
			}
			wait *= 2
		}
		if got := broker.uuids("invoices"); len(got) == 0 || len(got) > len(failed) || got[0] != sent[0] {
			t.Errorf("sent %v in %d rounds, want %s once a round", got, len(failed), sent[0])
		}
	})
}

// refuseDeletes makes the database refuse every DELETE of table's rows (a
// trigger that raises an error).
func refuseDeletes(t *testing.T, db *sqlx.DB, tdb testDB, table string) {
	t.Helper()
	trigger := table + "_no_delete"
	switch tdb.Dialect {
	case inbox.SQLite:
		exec(t, db, "CREATE TRIGGER "+trigger+" BEFORE DELETE ON "+table+" BEGIN SELECT RAISE(ABORT, 'the database refuses the delete'); END")
	case inbox.MySQL:
		exec(t, db, "CREATE TRIGGER "+trigger+" BEFORE DELETE ON "+table+" FOR EACH ROW SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'the database refuses the delete'")
	default:
		exec(t, db, "CREATE FUNCTION "+trigger+"() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN RAISE EXCEPTION 'the database refuses the delete'; END$$")
		t.Cleanup(func() { db.Exec("DROP FUNCTION IF EXISTS " + trigger + "() CASCADE") })
		exec(t, db, "CREATE TRIGGER "+trigger+" BEFORE DELETE ON "+table+" FOR EACH ROW EXECUTE FUNCTION "+trigger+"()")
	}
}

// On SQLite, which reads without locks, a refused message whose row leaves
// the table while the round publishes (an operator's DELETE, another relay)
// is neither set aside nor reported as an id the dead-letter table holds:
// it is gone, and the messages behind it are sent.
func TestOutboxRelayForgetsARefusedMessageWhoseRowLeftDuringTheRound(t *testing.T) {
	db := sqliteDB(t)
	broker := newBrokerStub()
	ob := newTestOutbox(t, db, inbox.SQLite, inbox.OutboxConfig{Publisher: broker, MaxAttempts: 1})
	ids := writeOutbox(t, db, ob, "payments", 3)
	broker.setRefuse(func(_ string, m *message.Message) error {
		if m.UUID != ids[0] {
			return nil
		}
		if _, err := db.Exec("DELETE FROM "+ob.Table()+" WHERE uuid = ?", ids[0]); err != nil {
			t.Error(err)
		}
		return errors.New("the broker refuses the message")
	})
	round := ob.RelayOnce(context.Background())
	if round.Err != nil && strings.Contains(round.Err.Error(), "already holds") || round.DeadLettered != 0 {
		t.Errorf("round: %+v, want no dead letter and no word of a dead-letter id", round)
	}
	relayUntilEmpty(t, ob)
	wantRelayed(t, ob, broker, ids[1:], 0, 0)
}

// A message refused on its last attempt waits for a message behind it to be
// accepted; while the one behind it is refused too and has attempts left,
// nothing is set aside nor sent past it, and once the broker takes that one
// it is sent, not set aside, followed by the rest in order.
func TestOutboxRelaySendsTheMessageBehindOneThatWaitsOnceTheBrokerTakesIt(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		broker := newBrokerStub()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, MaxAttempts: 3})
		ids := writeOutbox(t, db, ob, "payments", 6)
		refuse := func(secondToo bool) func(string, *message.Message) error {
			return func(_ string, m *message.Message) error {
				if m.UUID == ids[0] || (secondToo && m.UUID == ids[1]) {
					return errors.New("the broker refuses the message")
				}
				return nil
			}
		}
		broker.setRefuse(refuse(true))
		for i := range 4 { // the first's 3 attempts, then one more round
			if round := ob.RelayOnce(context.Background()); round.Relayed != 0 || round.DeadLettered != 0 {
				t.Fatalf("round %d while the first two are refused: %+v, want nothing sent or set aside", i+1, round)
			}
		}
		broker.setRefuse(refuse(false))
		relayUntilEmpty(t, ob)
		wantRelayed(t, ob, broker, ids[1:], 0, 1)
	})
}

// A topic the broker keeps refusing, and slowly (a topic that does not
// exist: sarama spends its metadata retries on it), does not slow the
// relay's other topics down: Run tries it again only after a wait that
// doubles, while every message of the other topic is relayed, in order.
func TestOutboxRelayKeepsGoingPastATopicTheBrokerKeepsRefusing(t *testing.T) {
	t.Parallel()
	db := sqliteDB(t)
	broker := newBrokerStub()
	var strayTries atomic.Int32
	broker.setRefuse(func(topic string, _ *message.Message) error {
		if topic != "typo" {
			return nil
		}
		strayTries.Add(1)
		time.Sleep(100 * time.Millisecond)
		return errors.New("unknown topic")
	})
	ob := newTestOutbox(t, db, inbox.SQLite, inbox.OutboxConfig{Publisher: broker, BatchSize: 50, MaxBackoff: time.Minute})
	stray := writeOutbox(t, db, ob, "typo", 1)
	var ids []string
	for range 20 {
		ids = append(ids, writeOutbox(t, db, ob, "payments", 50)...)
	}
	defer runRelay(ob)()
	waitFor(t, func() bool { return len(broker.uuids("payments")) >= len(ids) })
	if got := broker.uuids("payments"); fmt.Sprint(got) != fmt.Sprint(ids) {
		t.Errorf("payments sent: %d messages, want the %d written, in order", len(got), len(ids))
	}
	// 20 rounds at least; a wait that doubles from 50 ms allows a handful
	// of tries in the time they take.
	if n := strayTries.Load(); n > 12 {
		t.Errorf("the refused topic was tried %d times while 20 rounds relayed the other, want a few", n)
	}
	waitFor(t, func() bool { // the last round's deletes commit after its publish
		stats, err := ob.Stats(context.Background())
		return err == nil && stats.Pending == 1
	})
	if stats, err := ob.Stats(context.Background()); err != nil || stats.Pending != 1 || stats.DeadLettered != 0 {
		t.Errorf("stats: %+v (%v), want the refused message (%s) alone pending", stats, err, stray[0])
	}
}

// A topic the broker keeps refusing with a whole batch of messages or more
// at the head of the table does not hold the other topics back: while it
// waits for its next try, Run's reads leave its rows out, so the batch goes
// to the rows behind them. On every database, for a broker that cannot take
// the topic now (ErrBrokerUnavailable: a topic that does not exist yet) and
// for one that refuses the messages themselves.
func TestOutboxRelayKeepsGoingPastABatchOfARefusedTopicAtTheHead(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		for _, refusal := range []error{
			fmt.Errorf("%w: unknown topic", inbox.ErrBrokerUnavailable),
			errors.New("the broker refuses the message"),
		} {
			broker := newBrokerStub()
			broker.setRefuse(func(topic string, _ *message.Message) error {
				if topic == "typo" {
					return refusal
				}
				return nil
			})
			ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, BatchSize: 20, MaxBackoff: time.Minute})
			writeOutbox(t, db, ob, "typo", 40)
			ids := writeOutbox(t, db, ob, "payments", 5)
			stop := runRelay(ob)
			waitFor(t, func() bool { return len(broker.uuids("payments")) >= len(ids) })
			stop()
			if got := broker.uuids("payments"); fmt.Sprint(got) != fmt.Sprint(ids) {
				t.Errorf("%v: payments sent %v, want %v", refusal, got, ids)
			}
		}
	})
}

// A refused topic whose messages leave the table by another way (another
// relay instance sent them, an operator deleted them) is not waited for:
// Run goes back to its poll interval instead of reading the empty table
// again and again, which it did thousands of times a second. Counted in
// the relay's reads of the table, through a pool that records them.
func TestOutboxRelayForgetsARefusedTopicWhoseMessagesLeftAnotherWay(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "outbox.db")
	plain := openSQLite(t, path)
	reads := &statementLog{}
	db := openRecording(t, plain.Driver(), "file:"+path+"?"+testdb.SQLiteParams, "sqlite", reads)
	broker := newBrokerStub()
	broker.setRefuse(func(topic string, _ *message.Message) error {
		if topic == "typo" {
			return errors.New("unknown topic")
		}
		return nil
	})
	ob := newTestOutbox(t, db, inbox.SQLite, inbox.OutboxConfig{Publisher: broker, PollInterval: 200 * time.Millisecond, MaxBackoff: 50 * time.Millisecond})
	writeOutbox(t, db, ob, "typo", 1)
	defer runRelay(ob)()
	waitFor(t, func() bool { // refused once
		var attempts int
		return plain.Get(&attempts, "SELECT COALESCE(MAX(attempts), 0) FROM "+relayTable(t, ob)) == nil && attempts > 0
	})
	exec(t, plain, "DELETE FROM "+relayTable(t, ob)) // the operator removes it
	time.Sleep(100 * time.Millisecond)
	reads.take()
	time.Sleep(time.Second)
	selects := 0
	for _, q := range reads.take() {
		if strings.HasPrefix(q, "SELECT id, topic") {
			selects++
		}
	}
	if selects > 15 {
		t.Errorf("the relay read the empty table %d times in a second, want about 5 (PollInterval 200 ms)", selects)
	}
}

// A transaction that wrote to the outbox first (lower id) and commits last
// is not skipped: the relay keeps no offset, it sends what is there.
func TestOutboxRelaySendsWhatCommitsOutOfIDOrder(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if tdb.Dialect == inbox.SQLite {
			t.Skip("SQLite has one writer at a time: two write transactions cannot interleave")
		}
		broker := newBrokerStub()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker})
		slow, err := db.Beginx()
		if err != nil {
			t.Fatal(err)
		}
		defer slow.Rollback()
		pub, err := ob.Publisher(slow)
		if err != nil {
			t.Fatal(err)
		}
		first := message.NewMessage(watermill.NewUUID(), nil)
		if err := pub.Publish("orders", first); err != nil {
			t.Fatal(err)
		}
		later := writeOutbox(t, db, ob, "orders", 1)
		relayUntilEmpty(t, ob)
		if err := slow.Commit(); err != nil {
			t.Fatal(err)
		}
		relayUntilEmpty(t, ob)
		if got := broker.uuids("orders"); fmt.Sprint(got) != fmt.Sprint([]string{later[0], first.UUID}) {
			t.Errorf("sent %v, want the later commit's message, then the earlier write's", got)
		}
	})
}

// Two relays on one table at once send every message, none twice (their
// locked reads skip each other's rows), and empty the table.
func TestOutboxRelaysShareTheWork(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if tdb.Dialect == inbox.SQLite {
			t.Skip("SQLite has no row locks: a second relay on one database sends messages twice (docs/outbox.md)")
		}
		broker := newBrokerStub()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, BatchSize: 50})
		var ids []string
		for range 10 {
			ids = append(ids, writeOutbox(t, db, ob, "orders", 100)...)
		}
		var wg sync.WaitGroup
		for range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				relayUntilEmpty(t, ob)
			}()
		}
		wg.Wait()
		got := broker.uuids("orders")
		seen := map[string]int{}
		for _, id := range got {
			seen[id]++
		}
		for _, id := range ids {
			switch {
			case seen[id] == 0:
				t.Errorf("message %s never sent", id)
			case seen[id] > 1:
				t.Errorf("message %s sent %d times, want once", id, seen[id])
			}
		}
	})
}

// A relay round reads, checks and deletes only the rows it locked: a row
// another relay instance holds (locked by its round, not yet deleted) is
// skipped, and the round relays and deletes the others without waiting for
// that instance. On MariaDB a DELETE or locking read by a list of ids
// scanned the whole of a small table and waited for every row another
// round held: two relays deadlocked, and the victim, whose messages were
// already at the broker, rolled its deletes back and sent them again.
func TestOutboxRelayDoesNotWaitForRowsAnotherRelayHolds(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if tdb.Dialect == inbox.SQLite {
			t.Skip("SQLite has no row locks: one relay per database (docs/outbox.md)")
		}
		broker := newBrokerStub()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker})
		ids := writeOutbox(t, db, ob, "orders", 20)
		table := relayTable(t, ob)

		// Another relay's round holds the 10th row.
		other, err := db.BeginTxx(context.Background(), &sql.TxOptions{Isolation: sql.LevelReadCommitted})
		if err != nil {
			t.Fatal(err)
		}
		defer other.Rollback()
		var held int64
		if err := other.Get(&held, other.Rebind("SELECT id FROM "+table+" WHERE uuid = ? FOR UPDATE"), ids[9]); err != nil {
			t.Fatal(err)
		}

		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		round := ob.RelayOnce(ctx)
		if round.Err != nil || round.Relayed != 19 {
			t.Fatalf("round beside a held row: relayed %d, error %v; want the 19 other messages at once", round.Relayed, round.Err)
		}
		if err := other.Rollback(); err != nil {
			t.Fatal(err)
		}
		relayUntilEmpty(t, ob)
		want := append(append(append([]string{}, ids[:9]...), ids[10:]...), ids[9])
		if got := broker.uuids("orders"); fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("sent %v, want %v (each once; the held one when its holder let go)", got, want)
		}
	})
}

// Ids are 64-bit: past 2^31 inserts the outbox still takes and relays
// messages (a 32-bit SERIAL fails every insert from there on).
func TestOutboxIDsDoNotRunOutAt32Bits(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		broker := newBrokerStub()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker})
		table := relayTable(t, ob)
		switch tdb.Dialect {
		case inbox.MySQL:
			exec(t, db, "ALTER TABLE "+table+" AUTO_INCREMENT = 2147483640")
		case inbox.SQLite:
			exec(t, db, "INSERT INTO sqlite_sequence (name, seq) VALUES ('"+table+"', 2147483640)")
		default:
			exec(t, db, "ALTER TABLE "+table+" ALTER COLUMN id RESTART WITH 2147483640")
		}
		ids := writeOutbox(t, db, ob, "orders", 20)
		var maxID int64
		if err := db.Get(&maxID, "SELECT MAX(id) FROM "+table); err != nil || maxID < 1<<31 {
			t.Fatalf("largest id %d (%v), want past 2^31", maxID, err)
		}
		relayUntilEmpty(t, ob)
		if got := broker.uuids("orders"); fmt.Sprint(got) != fmt.Sprint(ids) {
			t.Errorf("sent %v, want the 20 messages written past id 2^31", got)
		}
	})
}

// relayTable returns the name of ob's table (from its DDL), unquoted.
func relayTable(t *testing.T, ob *inbox.Outbox) string {
	t.Helper()
	var name string
	if _, err := fmt.Sscanf(ob.SchemaSQL(), "CREATE TABLE IF NOT EXISTS %s", &name); err != nil {
		t.Fatal(err)
	}
	return strings.Trim(name, "`\"")
}

// A handler that ends the transaction itself (a ROLLBACK statement) and then
// publishes: nothing is written to the outbox (the insert would commit on
// its own, outside any transaction), the message is nacked and nothing is
// sent.
func TestOutboxWritesNothingOnceTheTransactionEnded(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if tdb.Dialect == inbox.SQLite {
			t.Skip("modernc.org/sqlite does not say whether a transaction is open (docs/outbox.md)")
		}
		broker := newBrokerStub()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, PollInterval: time.Hour})
		f := newFixture(t, db)
		ib := f.newInbox(inbox.Config{Outbox: ob.Publisher})
		var publishErr error
		in := newFeed()
		runRouter(t, func(r *message.Router) {
			r.AddMiddleware(ib.Middleware)
			r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
				tx, _ := inbox.TxFromContext(msg.Context())
				if _, err := tx.ExecContext(msg.Context(), "ROLLBACK"); err != nil {
					return err
				}
				pub, _ := inbox.OutboxFromContext(msg.Context())
				publishErr = pub.Publish("mails", message.NewMessage(watermill.NewUUID(), nil))
				return nil // a handler that ignores the publish error
			})
		})
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if acked, err := in.send(ctx, message.NewMessage(watermill.NewUUID(), nil)); err != nil || acked {
			t.Fatalf("delivery: acked %v (%v), want a nack", acked, err)
		}
		want := inbox.ErrTransactionEnded // as at the COMMIT without outputs
		if tdb.Dialect == inbox.MySQL || tdb.Dialect == inbox.SQLite {
			want = inbox.ErrTxRolledBack // a ROLLBACK looks like the database's own
		}
		if !errors.Is(publishErr, want) {
			t.Errorf("publish after ROLLBACK: %v, want %v", publishErr, want)
		}
		relayUntilEmpty(t, ob)
		if got := broker.uuids("mails"); len(got) != 0 {
			t.Errorf("sent %v, want nothing", got)
		}
	})
}

// A router whose outbox tables are missing does not start: RouterPlugin
// fails with ErrTableNotFound naming the table and the fix.
func TestOutboxRouterPluginRefusesMissingTables(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		table := "outbox_" + randomSuffix()
		ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Dialect: tdb.Dialect, Table: table, Publisher: newBrokerStub()})
		if err != nil {
			t.Fatal(err)
		}
		r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		r.AddPlugin(ob.RouterPlugin)
		r.AddConsumerHandler("billing", "orders", newFeed(), func(*message.Message) error { return nil })
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		err = r.Run(ctx)
		if !errors.Is(err, inbox.ErrTableNotFound) || !strings.Contains(err.Error(), table) || !strings.Contains(err.Error(), "InitializeSchema") {
			t.Errorf("router.Run: %v, want ErrTableNotFound naming %s and the fix", err, table)
		}
		dropLater(t, db, table)
		dropLater(t, db, table+"_dead")
		if err := ob.InitializeSchema(ctx); err != nil {
			t.Fatal(err)
		}
		if err := ob.Verify(ctx); err != nil {
			t.Errorf("Verify after InitializeSchema: %v", err)
		}
	})
}

// A slow outbox insert (a trigger that sleeps) of a returned message is
// bounded by Config.CommitTimeout (300 ms): the delivery is nacked with
// ErrCommitTimeout, nothing is committed and nothing is sent, and on
// PostgreSQL the insert itself is cancelled on the server (its trigger
// would sleep a minute).
func TestOutboxInsertIsBoundedByCommitTimeout(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		broker := newBrokerStub()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, PollInterval: time.Hour})
		table := relayTable(t, ob)
		switch tdb.Dialect {
		case inbox.SQLite:
			t.Skip("SQLite has no sleep to put in a trigger")
		case inbox.MySQL:
			exec(t, db, "CREATE TRIGGER "+table+"_slow BEFORE INSERT ON "+table+" FOR EACH ROW SET @slept = SLEEP(3)")
		default:
			fn := table + "_slow"
			exec(t, db, "CREATE FUNCTION "+fn+"() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN PERFORM pg_sleep(60); RETURN NEW; END$$")
			t.Cleanup(func() { db.Exec("DROP FUNCTION IF EXISTS " + fn + "() CASCADE") })
			exec(t, db, "CREATE TRIGGER "+fn+" BEFORE INSERT ON "+table+" FOR EACH ROW EXECUTE FUNCTION "+fn+"()")
		}
		f := newFixture(t, db)
		ib := f.newInbox(inbox.Config{Outbox: ob.Publisher, CommitTimeout: 300 * time.Millisecond})
		rec := &recorder{}
		in := newFeed()
		runRouter(t, func(r *message.Router) {
			r.AddMiddleware(rec.Middleware, ib.Middleware)
			r.AddHandler("billing", "orders", in, "invoices", broker, func(msg *message.Message) ([]*message.Message, error) {
				if err := f.writeBusinessRow(msg); err != nil {
					return nil, err
				}
				return []*message.Message{message.NewMessage(watermill.NewUUID(), nil)}, nil
			})
		})
		if in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
			t.Fatal("acked although the outbox insert outlived CommitTimeout")
		}
		if err := rec.last(); !errors.Is(err, inbox.ErrCommitTimeout) {
			t.Errorf("error %v, want ErrCommitTimeout", err)
		}
		if tdb.Dialect != inbox.MySQL {
			waitFor(t, func() bool { // the insert cancelled, not left sleeping
				var running int
				err := db.Get(&running, "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND query LIKE $1", "%INSERT INTO%"+table+"%")
				return err == nil && running == 0
			})
		}
		relayUntilEmpty(t, ob)
		if b, i, sent := f.businessRows(), f.inboxRows(), broker.uuids("invoices"); b != 0 || i != 0 || len(sent) != 0 {
			t.Errorf("business rows %d, inbox rows %d, sent %v; want nothing", b, i, sent)
		}
	})
}

// The relay's rounds commit without waiting for the WAL flush on
// PostgreSQL (synchronous_commit off for their own transaction); the
// pooled connection keeps the session's setting for whatever runs on it
// next, such as a handler's transaction that must be durable.
func TestOutboxRelayLeavesSynchronousCommitAsItWas(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if !isPostgres(tdb.Dialect) {
			t.Skip("a PostgreSQL setting")
		}
		db.SetMaxOpenConns(1)
		broker := newBrokerStub()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker})
		sent := writeOutbox(t, db, ob, "invoices", 3)
		var before string
		if err := db.Get(&before, "SHOW synchronous_commit"); err != nil {
			t.Fatal(err)
		}
		if round := ob.RelayOnce(context.Background()); round.Err != nil || round.Relayed != len(sent) {
			t.Fatalf("relay round: %+v, want %d relayed", round, len(sent))
		}
		var after string
		if err := db.Get(&after, "SHOW synchronous_commit"); err != nil {
			t.Fatal(err)
		}
		if after != before {
			t.Errorf("synchronous_commit after a relay round = %q, want %q as before", after, before)
		}
		assertOutboxEmpty(t, ob)
	})
}

// Messages committed to the outbox while no relay runs in the process (the
// router has no RouterPlugin, nothing calls Run) would stay in the table in
// silence: the Outbox says so once, at Info, a few PollIntervals after the
// first commit. With the relay running it says nothing.
func TestOutboxSaysSoWhenNoRelayRunsInTheProcess(t *testing.T) {
	for _, withRelay := range []bool{false, true} {
		name := map[bool]string{false: "NoRelay", true: "RelayRunning"}[withRelay]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db := sqliteDB(t)
			logger := newCaptureLogger()
			broker := newBrokerStub()
			ob := newTestOutbox(t, db, inbox.SQLite, inbox.OutboxConfig{Publisher: broker, PollInterval: 20 * time.Millisecond, Logger: logger})
			f := newFixture(t, db)
			ib := f.newInbox(inbox.Config{Outbox: ob.Publisher})
			in := newFeed()
			runRouter(t, func(r *message.Router) {
				if withRelay {
					r.AddPlugin(ob.RouterPlugin)
				}
				r.AddMiddleware(ib.Middleware)
				r.AddHandler("billing", "orders", in, "invoices", nil, func(msg *message.Message) ([]*message.Message, error) {
					return []*message.Message{message.NewMessage(msg.UUID+"-invoice", nil)}, nil
				})
			})
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			if acked, err := in.send(ctx, message.NewMessage(watermill.NewUUID(), nil)); err != nil || !acked {
				t.Fatalf("delivery: acked %v (%v)", acked, err)
			}
			said := func() int {
				logger.mu.Lock()
				defer logger.mu.Unlock()
				n := 0
				for _, l := range *logger.lines {
					if strings.Contains(l.msg, "no relay runs in this process") {
						n++
					}
				}
				return n
			}
			if !withRelay {
				waitFor(t, func() bool { return said() > 0 })
				if _, err := in.send(ctx, message.NewMessage(watermill.NewUUID(), nil)); err != nil {
					t.Fatal(err)
				}
				time.Sleep(10 * 20 * time.Millisecond)
				if n := said(); n != 1 {
					t.Errorf("said %d times that no relay runs, want once", n)
				}
				return
			}
			waitFor(t, func() bool { return len(broker.uuids("invoices")) == 1 })
			time.Sleep(10 * 20 * time.Millisecond) // twice the grace
			if n := said(); n != 0 {
				t.Errorf("said %d times that no relay runs while the relay ran", n)
			}
		})
	}
}

// The age of the oldest pending message counts from its write, not from the
// start of the transaction that wrote it: on PostgreSQL created_at was
// now(), the transaction's start, so a slow handler's message read as old
// as the handler's time the moment it committed (and an alert on the age
// fired on handlers, not on the relay).
func TestOutboxOldestAgeCountsFromTheWrite(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: newBrokerStub()})
		tx, pub := beginOutbox(t, db, ob)
		const handler = time.Second // the handler's work before it publishes
		time.Sleep(handler)
		written := time.Now()
		if err := pub.Publish("invoices", message.NewMessage(watermill.NewUUID(), []byte("invoice"))); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		stats, err := ob.Stats(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if since := time.Since(written); stats.Pending != 1 || stats.OldestAge > since+handler/2 {
			t.Errorf("stats %+v, %v after the write: want one message, its age at most about that", stats, since)
		}
	})
}

// inbox.OutboxSchemaSQL gives, without an Outbox (whose publisher may need
// a broker), the DDL an Outbox of the same table gives; a nil dialect and a
// bad name are refused.
func TestOutboxSchemaSQLIsTheOutboxsWithoutABroker(t *testing.T) {
	for _, d := range []inbox.Dialect{inbox.PostgreSQL, inbox.PostgreSQLPartitioned, inbox.MySQL, inbox.SQLite} {
		for _, table := range []string{"", "billing.outbox"} {
			got, err := inbox.OutboxSchemaSQL(d, table)
			if err != nil {
				t.Fatal(err)
			}
			ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: sqlx.NewDb(nil, "pgx"), Dialect: d, Table: table, Publisher: newBrokerStub()})
			if err != nil {
				t.Fatal(err)
			}
			if want := ob.SchemaSQL(); got != want {
				t.Errorf("OutboxSchemaSQL(%v, %q):\n%s\nwant Outbox.SchemaSQL's:\n%s", d, table, got, want)
			}
		}
	}
	if _, err := inbox.OutboxSchemaSQL(nil, ""); !errors.Is(err, inbox.ErrUnknownDialect) {
		t.Errorf("nil dialect: %v, want ErrUnknownDialect", err)
	}
	if _, err := inbox.OutboxSchemaSQL(inbox.SQLite, "a.b.c"); !errors.Is(err, inbox.ErrInvalidTableName) {
		t.Errorf("bad name: %v, want ErrInvalidTableName", err)
	}
}
