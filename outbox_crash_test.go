//go:build unix

package inbox_test

// The outbox relay under crashes and shutdowns: a relay process SIGKILLed at
// any point, a relay stopped while the broker has its batch, two relays on
// one table while writers commit, and a relay beside transactions that stay
// open. Each time: every committed message reaches the broker at least once,
// a message sent again carries the same UUID, payload and metadata, and the
// table ends empty.

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"net/url"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// crashDBs are the databases the crash tests run on: one of each server
// (the outbox does not depend on the inbox's dialect variants).
func crashDBs(t *testing.T, names ...string) []testDB {
	t.Helper()
	var dbs []testDB
	for _, tdb := range testDBs {
		for _, n := range names {
			if tdb.Name == n {
				dbs = append(dbs, tdb)
			}
		}
	}
	return dbs
}

// outboxLedger commits messages to an outbox and remembers what it
// committed.
type outboxLedger struct {
	t    *testing.T
	db   *sqlx.DB
	ob   *inbox.Outbox // writes only
	mu   sync.Mutex
	sent map[string]outboxMessage // by UUID
	seq  int
}

func newOutboxLedger(t *testing.T, db *sqlx.DB, ob *inbox.Outbox) *outboxLedger {
	return &outboxLedger{t: t, db: db, ob: ob, sent: map[string]outboxMessage{}}
}

// commit writes n messages to topic in one transaction and commits it.
// Payloads hold bytes that are not UTF-8, metadata a few keys of its own.
func (l *outboxLedger) commit(topic string, n int) error {
	tx, err := l.db.Beginx()
	if err != nil {
		return err
	}
	defer tx.Rollback()
	pub, err := l.ob.Publisher(tx)
	if err != nil {
		return err
	}
	written := map[string]outboxMessage{}
	var msgs []*message.Message
	for range n {
		l.mu.Lock()
		l.seq++
		seq := l.seq
		l.mu.Unlock()
		payload := fmt.Appendf([]byte{0xff, 0x00, 0xfe}, "message %d", seq)
		m := message.NewMessage(watermill.NewUUID(), payload)
		m.Metadata.Set("seq", fmt.Sprint(seq))
		m.Metadata.Set("trace", watermill.NewShortUUID())
		msgs = append(msgs, m)
		written[m.UUID] = outboxMessage{topic: topic, payload: bytes.Clone(payload), metadata: m.Metadata}
	}
	if err := pub.Publish(topic, msgs...); err != nil {
		return err
	}
	if err := tx.Commit(); err != nil {
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	for id, m := range written {
		l.sent[id] = m
	}
	return nil
}

// commitMany commits total messages to topics, in transactions of 2 to 10
// messages of one topic each.
func (l *outboxLedger) commitMany(topics []string, total int) {
	l.t.Helper()
	for i := 0; total > 0; i++ {
		n := min(total, 2+mrand.IntN(9))
		if err := l.commit(topics[i%len(topics)], n); err != nil {
			l.t.Fatal(err)
		}
		total -= n
	}
}

// check compares what the broker got with what was committed: every
// message arrived, each copy identical to what was committed, nothing else
// arrived. It returns the number of copies beyond the first.
func (l *outboxLedger) check(got []brokerLine) (duplicates int) {
	l.t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	copies := map[string]int{}
	for _, g := range got {
		want, ok := l.sent[g.UUID]
		if !ok {
			l.t.Errorf("the broker got message %s, which was never committed", g.UUID)
			continue
		}
		copies[g.UUID]++
		if g.Topic != want.topic || !bytes.Equal(g.Payload, want.payload) || fmt.Sprint(g.Metadata) != fmt.Sprint(want.metadata) {
			l.t.Errorf("message %s arrived as topic %q payload %q metadata %v, committed as %v", g.UUID, g.Topic, g.Payload, g.Metadata, want)
		}
	}
	missing := 0
	for id := range l.sent {
		if copies[id] == 0 {
			missing++
			if missing <= 10 {
				l.t.Errorf("message %s was committed and never reached the broker", id)
			}
		} else {
			duplicates += copies[id] - 1
		}
	}
	if missing > 0 {
		l.t.Errorf("%d of %d committed messages never reached the broker", missing, len(l.sent))
	}
	return duplicates
}

func (l *outboxLedger) committed() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.sent)
}

// A relay process SIGKILLed again and again, at every point of a round
// (before the broker publish, with part of a batch at the broker, after the
// broker took the batch and before the delete, after the delete and before
// COMMIT, and at random moments chosen by the test), while messages keep
// being committed, then restarted: once a last relay has drained the table,
// every committed message has reached the broker, every copy of a message
// has its UUID, payload and metadata, and the table is empty.
//
// The broker is a file the relay process appends to and fsyncs before
// Publish returns (outbox_crash_harness_test.go says why that models an ack
// exactly); on SQLite the database is a file shared by the test and the
// relay processes.
func TestOutboxRelayLosesNothingWhenItsProcessIsKilled(t *testing.T) {
	// Each point twice (At 1 and 2, so that a kill also comes after a
	// completed round), then random kills, then a relay that drains.
	type run struct {
		kill  string
		at    int
		batch int
	}
	var runs []run
	for i, point := range []string{killBeforePublish, killMidBatch, killAfterPublish, killBeforeCommit} {
		runs = append(runs, run{point, 1, []int{5, 20}[i%2]}, run{point, 2, []int{20, 7}[i%2]})
	}
	for i := range 4 {
		runs = append(runs, run{killByTest, 0, []int{1, 5, 20, 50}[i]})
	}
	runs = append(runs, run{killNever, 0, 50})
	topics := []string{"invoices", "mails", "ledger"}

	for _, tdb := range crashDBs(t, "sqlite", "postgres", "mysql") {
		t.Run(tdb.Name, func(t *testing.T) {
			t.Parallel()
			var db *sqlx.DB
			var driverName, dsn string
			switch tdb.Name {
			case "sqlite":
				path := filepath.Join(t.TempDir(), "outbox.db")
				db = testdb.OpenSQLite(t, path)
				driverName, dsn = "sqlite", "file:"+path+"?"+testdb.SQLiteParams
			case "postgres":
				db = testdb.OpenPostgres(t, "")
				driverName, dsn = "pgx", testdb.PostgresDSN()
			default:
				db = testdb.OpenMySQL(t, "")
				driverName, dsn = "mysql", testdb.MySQLDSN()
			}
			ob, table := newNamedTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: newBrokerStub()})
			ledger := newOutboxLedger(t, db, ob)
			brokerFile := filepath.Join(t.TempDir(), "broker.jsonl")
			// A backlog that no run before the random kills can drain: a
			// self-killed run deletes at most (At-1) batches.
			ledger.commitMany(topics, 300)

			kills := map[string]int{}
			for i, r := range runs {
				p := startRelayProcess(t, relayProcessConfig{
					Driver: driverName, DSN: dsn, Table: table, Broker: brokerFile,
					BatchSize: r.batch, Kill: r.kill, At: r.at,
				})
				select {
				case <-p.Ready:
				case <-p.Done:
				case <-time.After(caseTimeout):
					t.Fatalf("run %d: relay process not ready within %v:\n%s", i, caseTimeout, p.output())
				}
				if r.kill != killNever {
					// Commits while the relay runs; SIGKILL at a random
					// moment of the relay's rounds.
					ledger.commitMany(topics, 20)
					if r.kill == killByTest {
						time.Sleep(time.Duration(mrand.IntN(200)) * time.Millisecond)
						p.Cmd.Process.Kill()
					}
				}
				state := p.wait(t, caseTimeout)
				switch {
				case r.kill == killNever:
					if !state.Success() {
						t.Fatalf("draining relay exited with %v:\n%s", state, p.output())
					}
				case !killedBySIGKILL(state):
					t.Fatalf("run %d (%s #%d): relay process exited with %v, want SIGKILL:\n%s", i, r.kill, r.at, state, p.output())
				case r.kill != killByTest && p.killed != r.kill:
					t.Fatalf("run %d: relay process killed at %q, want %q:\n%s", i, p.killed, r.kill, p.output())
				}
				kills[r.kill]++
				if len(p.errs) > 0 {
					t.Logf("run %d (%s): failed relay rounds: %q", i, r.kill, p.errs)
				}
			}
			assertOutboxEmpty(t, ob)
			got := readBrokerFile(t, brokerFile)
			dups := ledger.check(got)
			t.Logf("%d messages committed, %d copies at the broker (%d sent again) after SIGKILLs %v",
				ledger.committed(), len(got), dups, kills)
		})
	}
}

// blockingBroker holds every Publish until released, then accepts it (the
// broker has the batch while the relay that sent it is being stopped), or,
// with refuse set, fails it as a publisher closed on shutdown does.
type blockingBroker struct {
	*brokerStub
	entered chan struct{} // receives once per Publish call that blocks
	release chan struct{} // closed: Publish proceeds
	refuse  error
}

func (b *blockingBroker) Publish(topic string, msgs ...*message.Message) error {
	select {
	case b.entered <- struct{}{}:
	default:
	}
	<-b.release
	if b.refuse != nil {
		return b.refuse
	}
	return b.brokerStub.Publish(topic, msgs...)
}

// relayStopping reports whether the relay of ob, closed by its router, has
// seen its context end: on PostgreSQL and MySQL/MariaDB its transaction is
// then rolled back and another reader can lock every row; on SQLite, where
// the relay holds no transaction while it publishes, once the router's
// plugin has had three of its polls (100 ms each) to see the router closed.
func relayStopping(t *testing.T, db *sqlx.DB, d inbox.Dialect, ob *inbox.Outbox) bool {
	t.Helper()
	if d == inbox.SQLite {
		time.Sleep(300 * time.Millisecond)
		return true
	}
	table := relayTable(t, ob)
	var ids []int64
	if err := db.Select(&ids, "SELECT id FROM "+table+" FOR UPDATE SKIP LOCKED"); err != nil {
		t.Fatal(err)
	}
	return len(ids) == count(t, db, table, "")
}

// A relay whose context ends while the broker holds the messages of the
// topics it publishes to at once (TopicConcurrency, 2 here) publishes no
// other topic in that round: it could not record what it sends any more,
// and the publisher may be closing (the router's shutdown order closes it
// a second after the router). Before, the round went on through every
// topic of its batch, each publish a duplicate to come. The next relay
// sends every message.
func TestOutboxRelayStoppedMidRoundPublishesNoFurtherTopic(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		const atOnce = 2
		blocked := &blockingBroker{brokerStub: newBrokerStub(), entered: make(chan struct{}, atOnce), release: make(chan struct{})}
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: blocked, TopicConcurrency: atOnce})
		topics := []string{"invoices", "mails", "payments", "refunds"}
		want := map[string][]string{}
		for _, topic := range topics {
			want[topic] = writeOutbox(t, db, ob, topic, 2)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { defer close(done); _ = ob.Run(ctx) }()
		for range atOnce {
			select {
			case <-blocked.entered:
			case <-time.After(caseTimeout):
				t.Fatal("the relay did not publish to two topics at once")
			}
		}
		cancel()
		close(blocked.release)
		<-done
		for _, topic := range topics[atOnce:] {
			if got := blocked.uuids(topic); len(got) > 0 {
				t.Errorf("the stopped relay published %d messages of %q after its context ended, want none", len(got), topic)
			}
		}
		// Its transaction ends on the server after Run returned (database/sql
		// rolls it back when its context ends): until then the next round
		// skips the rows it locked and reads an empty outbox.
		waitFor(t, func() bool { return relayStopping(t, db, tdb.Dialect, ob) })
		relayUntilEmpty(t, ob)
		for _, topic := range topics {
			var first []string // each message's first arrival, in order
			for _, id := range blocked.uuids(topic) {
				if !slices.Contains(first, id) {
					first = append(first, id)
				}
			}
			if got := first; !slices.Equal(got, want[topic]) {
				t.Errorf("%q: sent %v, want %v (again, at least once)", topic, got, want[topic])
			}
		}
	})
}

// A relay stopped while the broker publish is in flight (its Run context
// cancelled, or its router closed) loses nothing, whether the broker then
// takes the batch or fails it (a publisher closed on shutdown): the next
// relay sends every message not deleted, with the same UUIDs, payloads and
// metadata; none is set aside, and the table ends empty.
func TestOutboxRelayStoppedMidPublishLosesNothing(t *testing.T) {
	for _, c := range []struct{ how, broker string }{
		{"context cancelled", "takes the batch"}, {"context cancelled", "fails"},
		{"router closed", "takes the batch"}, {"router closed", "fails"},
	} {
		how := c.how
		t.Run(c.how+"/broker "+c.broker, func(t *testing.T) {
			forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
				blocked := &blockingBroker{brokerStub: newBrokerStub(), entered: make(chan struct{}, 1), release: make(chan struct{})}
				if c.broker == "fails" {
					blocked.refuse = errors.New("publisher closed")
				}
				rounds := make(chan inbox.OutboxRound, 16)
				ob, table := newNamedTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{
					Publisher: blocked, PollInterval: 10 * time.Millisecond,
					OnRound: func(r inbox.OutboxRound) { rounds <- r },
				})
				ledger := newOutboxLedger(t, db, ob)
				ledger.commitMany([]string{"invoices"}, 30)

				stopped := make(chan struct{})
				var stop func()
				switch how {
				case "context cancelled":
					ctx, cancel := context.WithCancel(context.Background())
					go func() {
						defer close(stopped)
						_ = ob.Run(ctx)
					}()
					stop = cancel
				default:
					r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
					if err != nil {
						t.Fatal(err)
					}
					r.AddPlugin(ob.RouterPlugin)
					r.AddConsumerHandler("idle", "nothing", newFeed(), func(*message.Message) error { return nil })
					go func() {
						defer close(stopped)
						_ = r.Run(context.Background())
					}()
					stop = func() { _ = r.Close() }
				}
				select {
				case <-blocked.entered:
				case <-time.After(caseTimeout):
					t.Fatal("the relay did not publish")
				}
				// Stop the relay while the broker holds the batch, then let
				// the broker take it.
				stopDone := make(chan struct{})
				go func() {
					defer close(stopDone)
					stop()
				}()
				if how == "router closed" {
					waitFor(t, func() bool { return relayStopping(t, db, tdb.Dialect, ob) })
				} else {
					<-stopDone // cancel returns once the context is done
				}
				close(blocked.release)
				<-stopDone
				select { // the round that published ends, and the relay with it
				case r := <-rounds:
					t.Logf("the stopped relay's round: %+v", r)
				case <-time.After(caseTimeout):
					t.Fatal("the relay's round did not end")
				}
				select {
				case <-stopped:
				case <-time.After(caseTimeout):
					t.Fatal("the relay did not stop")
				}
				left := count(t, db, relayTable(t, ob), "")

				next := newBrokerStub()
				again, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Dialect: tdb.Dialect, Table: table, Publisher: next})
				if err != nil {
					t.Fatal(err)
				}
				relayUntilNothingPending(t, again)
				var got []brokerLine
				for _, stub := range []*brokerStub{blocked.brokerStub, next} {
					for _, m := range stub.messages("invoices") {
						got = append(got, brokerLine{Topic: "invoices", UUID: m.UUID, Payload: m.Payload, Metadata: m.Metadata})
					}
				}
				dups := ledger.check(got)
				assertOutboxEmpty(t, ob)
				t.Logf("%d messages; the broker took %d from the stopped relay, whose rows stayed for %d of them; %d sent again",
					ledger.committed(), len(blocked.uuids("invoices")), left, dups)
			})
		})
	}
}

// Two relays (Run) on one table while four writers keep committing: every
// committed message reaches the broker, each copy as it was committed, and
// the table ends empty, and no message is sent twice: their locked reads
// (FOR UPDATE SKIP LOCKED) skip each other's rows, and neither round waits
// for the other's rows (on MariaDB a deadlock between their deletes rolled
// one back after its publish, which sent its messages again).
func TestOutboxTwoRelaysWhileWritersCommit(t *testing.T) {
	for _, tdb := range crashDBs(t, "postgres", "mysql") {
		t.Run(tdb.Name, func(t *testing.T) {
			t.Parallel()
			db := tdb.Open(t)
			ob, table := newNamedTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: newBrokerStub()})
			ledger := newOutboxLedger(t, db, ob)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			brokers := []*brokerStub{newBrokerStub(), newBrokerStub()}
			var relays sync.WaitGroup
			for _, broker := range brokers {
				relay, err := inbox.NewOutbox(inbox.OutboxConfig{
					DB: db, Dialect: tdb.Dialect, Table: table, Publisher: broker,
					BatchSize: 20, PollInterval: 5 * time.Millisecond,
				})
				if err != nil {
					t.Fatal(err)
				}
				relays.Go(func() { _ = relay.Run(ctx) })
			}
			topics := []string{"invoices", "mails"}
			var writers sync.WaitGroup
			for w := range 4 {
				writers.Go(func() {
					for i := range 40 {
						if err := ledger.commit(topics[(w+i)%2], 1+mrand.IntN(5)); err != nil {
							t.Error(err)
							return
						}
					}
				})
			}
			writers.Wait()
			arrived := func() []brokerLine {
				var got []brokerLine
				for _, b := range brokers {
					for _, topic := range topics {
						for _, m := range b.messages(topic) {
							got = append(got, brokerLine{Topic: topic, UUID: m.UUID, Payload: m.Payload, Metadata: m.Metadata})
						}
					}
				}
				return got
			}
			waitFor(t, func() bool { // every message sent, and its row deleted
				distinct := map[string]bool{}
				for _, l := range arrived() {
					distinct[l.UUID] = true
				}
				stats, err := ob.Stats(ctx)
				return err == nil && stats.Pending == 0 && len(distinct) >= ledger.committed()
			})
			cancel()
			relays.Wait()
			got := arrived()
			dups := ledger.check(got)
			assertOutboxEmpty(t, ob)
			t.Logf("%d messages committed by 4 writers; relayed %d and %d by the two relays",
				ledger.committed(), len(brokers[0].messages("invoices"))+len(brokers[0].messages("mails")),
				len(brokers[1].messages("invoices"))+len(brokers[1].messages("mails")))
			if dups > 0 {
				t.Errorf("%d messages sent twice by the two relays, want none", dups)
			}
		})
	}
}

// On PostgreSQL, a write transaction left open in another session for the
// whole test, and a session idle in a transaction in another database, do
// not hold the relay back: messages committed meanwhile reach the broker
// while both are still open. The open transaction wrote a message to the
// outbox (a lower id than those after it), which never leaves, and holds a
// row lock on a committed message (as a stuck relay would), which the relay
// skips and sends once the lock is gone; the table ends empty.
func TestOutboxRelayDoesNotWaitForOpenTransactions(t *testing.T) {
	t.Parallel()
	db := testdb.OpenPostgres(t, "")
	broker := newBrokerStub()
	ob := newTestOutbox(t, db, inbox.PostgreSQL, inbox.OutboxConfig{Publisher: broker, PollInterval: 10 * time.Millisecond})
	ledger := newOutboxLedger(t, db, ob)
	other := "unrelated_" + randomSuffix()
	exec(t, db, "CREATE TABLE "+other+" (id bigint PRIMARY KEY)")
	dropLater(t, db, other)
	ledger.commitMany([]string{"invoices"}, 2) // the first is locked below

	open, err := db.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	defer open.Rollback()
	if _, err := open.Exec("INSERT INTO " + other + " (id) VALUES (1)"); err != nil {
		t.Fatal(err)
	}
	if _, err := open.Exec("UPDATE " + relayTable(t, ob) + " SET attempts = attempts WHERE id = (SELECT min(id) FROM " + relayTable(t, ob) + ")"); err != nil {
		t.Fatal(err)
	}
	pub, err := ob.Publisher(open)
	if err != nil {
		t.Fatal(err)
	}
	uncommitted := message.NewMessage(watermill.NewUUID(), []byte("never committed"))
	if err := pub.Publish("invoices", uncommitted); err != nil {
		t.Fatal(err)
	}
	idle := otherDatabaseIdleInTransaction(t)

	ctx, cancel := context.WithCancel(context.Background())
	relayDone := make(chan struct{})
	go func() {
		defer close(relayDone)
		_ = ob.Run(ctx)
	}()
	defer func() { cancel(); <-relayDone }()
	ledger.commitMany([]string{"invoices"}, 50)
	waitFor(t, func() bool { return len(broker.uuids("invoices")) >= 51 }) // all but the locked one

	// Both transactions are still open, and usable.
	var xid int64
	if err := open.Get(&xid, "SELECT txid_current()"); err != nil {
		t.Fatalf("the open transaction: %v", err)
	}
	if err := idle.QueryRowContext(context.Background(), "SELECT txid_current()").Scan(&xid); err != nil {
		t.Fatalf("the idle transaction in the other database: %v", err)
	}
	cancel()
	<-relayDone
	if err := open.Rollback(); err != nil {
		t.Fatal(err)
	}
	relayUntilNothingPending(t, ob)
	for _, id := range broker.uuids("invoices") {
		if id == uncommitted.UUID {
			t.Errorf("the open transaction's message %s was sent", id)
		}
	}
	ledger.check(brokerLinesOf(broker, "invoices"))
	assertOutboxEmpty(t, ob)
}

// otherDatabaseIdleInTransaction opens a session to the database "postgres"
// of the test server that holds a transaction with an xid open, idle, until
// the test ends.
func otherDatabaseIdleInTransaction(t *testing.T) *sql.Conn {
	t.Helper()
	u, err := url.Parse(testdb.PostgresDSN())
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/postgres"
	db, err := sql.Open("pgx", u.String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	conn, err := db.Conn(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	var xid int64
	if _, err := conn.ExecContext(context.Background(), "BEGIN"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.ExecContext(context.Background(), "ROLLBACK") })
	if err := conn.QueryRowContext(context.Background(), "SELECT txid_current()").Scan(&xid); err != nil {
		t.Fatal(err)
	}
	return conn
}

// brokerLinesOf returns what broker accepted on topic, as broker lines.
func brokerLinesOf(broker *brokerStub, topic string) []brokerLine {
	var got []brokerLine
	for _, m := range broker.messages(topic) {
		got = append(got, brokerLine{Topic: topic, UUID: m.UUID, Payload: m.Payload, Metadata: m.Metadata})
	}
	return got
}
