package inbox_test

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// commitOutputs commits one message per uuid to topic through ob, in one
// transaction.
func commitOutputs(t *testing.T, db *sqlx.DB, ob *inbox.Outbox, topic string, uuids ...string) {
	t.Helper()
	tx, pub := beginOutbox(t, db, ob)
	for _, id := range uuids {
		if err := pub.Publish(topic, message.NewMessage(id, []byte("p"))); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
}

// waitingBacklog writes n messages to topic gone, which then waits.
func waitingBacklog(t *testing.T, db *sqlx.DB, ob *inbox.Outbox, n int) []string {
	t.Helper()
	uuids := make([]string, n)
	for i := range uuids {
		uuids[i] = fmt.Sprintf("gone-%d", i)
	}
	commitOutputs(t, db, ob, "gone", uuids...)
	return uuids
}

// roundWhileGoneWaits runs a relay round while topic gone waits and fails
// the test on its error.
func roundWhileGoneWaits(t *testing.T, ob *inbox.Outbox) inbox.OutboxRound {
	t.Helper()
	r := ob.RelayRoundWhileTopicsWait(context.Background(), []string{"gone"})
	if r.Err != nil {
		t.Fatalf("round while gone waits: %v", r.Err)
	}
	return r
}

// roundsUntilFloor runs relay rounds while topics wait until the relay's
// floor is above above: each one waits for every transaction that wrote on the server
// when its candidate was found to end, which other tests' transactions on
// the same server can make take a while.
func roundsUntilFloor(t *testing.T, ob *inbox.Outbox, above int64, topics ...string) int64 {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		if r := ob.RelayRoundWhileTopicsWait(context.Background(), topics); r.Err != nil {
			t.Fatalf("round while %v wait: %v", topics, r.Err)
		}
		if f := ob.WaitingTopicsFloor(); f > above {
			return f
		}
		if time.Now().After(deadline) {
			t.Fatalf("floor not above %d after a minute of rounds while %v wait (0: every read starts at the head of the table)", above, topics)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// floorDBs runs f on every database.
func floorDBs(t *testing.T, f func(t *testing.T, db *sqlx.DB, d inbox.Dialect)) {
	t.Run("postgres", func(t *testing.T) { f(t, testdb.OpenPostgres(t, ""), inbox.PostgreSQL) })
	t.Run("mysql", func(t *testing.T) { f(t, testdb.OpenMySQL(t, ""), inbox.MySQL) })
	t.Run("sqlite", func(t *testing.T) { f(t, sqliteDB(t), inbox.SQLite) })
}

// While a topic waits, its backlog at the head of the table is read past
// once, and the rounds after read from where its rows end: every other
// topic's message is sent, in order, and the waiting topic's rows stay.
func TestOutboxRelayReadsPastAWaitingTopicsBacklogFromWhereItEnds(t *testing.T) {
	floorDBs(t, testOutboxRelayReadsPastAWaitingTopicsBacklogFromWhereItEnds)
}

func testOutboxRelayReadsPastAWaitingTopicsBacklogFromWhereItEnds(t *testing.T, db *sqlx.DB, d inbox.Dialect) {
	broker := newBrokerStub()
	ob := newTestOutbox(t, db, d, inbox.OutboxConfig{Publisher: broker})
	gone := waitingBacklog(t, db, ob, 700)
	commitOutputs(t, db, ob, "payments", "p-1")
	floor := roundsUntilFloor(t, ob, 0, "gone")
	var want []string
	for i := range 5 {
		id := fmt.Sprintf("p-%d", i+2)
		commitOutputs(t, db, ob, "payments", id)
		want = append(want, id)
		roundWhileGoneWaits(t, ob)
	}
	if got := broker.uuids("payments"); !slices.Equal(got, append([]string{"p-1"}, want...)) {
		t.Errorf("sent to payments: %v", got)
	}
	if n := count(t, db, relayTable(t, ob), "1=1"); n != len(gone) {
		t.Errorf("%d rows left, want the %d of the waiting topic", n, len(gone))
	}
	// It follows the rows written since: the waiting topic's, and the
	// other topics' once sent.
	commitOutputs(t, db, ob, "gone", "gone-later")
	commitOutputs(t, db, ob, "payments", "p-7")
	roundsUntilFloor(t, ob, floor, "gone")
	if got := broker.uuids("payments"); !slices.Equal(got, append(append([]string{"p-1"}, want...), "p-7")) {
		t.Errorf("sent to payments: %v", got)
	}
}

// A transaction that took its outbox id before a row the relay saw, and
// commits after, is not left behind the floor: its message goes, before
// the next message of its topic written after it committed (its consumed
// partition's order).
func TestOutboxRelayFloorWaitsForTheTransactionsThatRanAtItsProbe(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	broker := newBrokerStub()
	ob := newTestOutbox(t, db, inbox.PostgreSQL, inbox.OutboxConfig{Publisher: broker})
	waitingBacklog(t, db, ob, 50)
	// As the inbox's transaction: a row written (its claim), then the
	// output.
	late := p1WrittenThenLaterRows(t, db, ob, "SELECT txid_current()")
	roundWhileGoneWaits(t, ob)
	roundWhileGoneWaits(t, ob)
	roundWhileGoneWaits(t, ob)
	commitLateThenP2AndCheckOrder(t, db, ob, broker, late)
}

// p1WrittenThenLaterRows begins a transaction that runs first (when set)
// and writes message p-1 to payments through ob, then commits o-1 to orders
// and gone-after to gone in transactions of their own, and returns the
// first transaction, still open.
func p1WrittenThenLaterRows(t *testing.T, db *sqlx.DB, ob *inbox.Outbox, first string) *sqlx.Tx {
	t.Helper()
	late, latePub := beginOutbox(t, db, ob)
	if first != "" {
		if _, err := late.Exec(first); err != nil {
			t.Fatal(err)
		}
	}
	if err := latePub.Publish("payments", message.NewMessage("p-1", []byte("p"))); err != nil {
		t.Fatal(err)
	}
	commitOutputs(t, db, ob, "orders", "o-1")
	commitOutputs(t, db, ob, "gone", "gone-after")
	return late
}

// commitLateThenP2AndCheckOrder commits late (see p1WrittenThenLaterRows),
// then does what commitP2AndCheckOrder does, and checks that orders got
// o-1.
func commitLateThenP2AndCheckOrder(t *testing.T, db *sqlx.DB, ob *inbox.Outbox, broker *brokerStub, late *sqlx.Tx) {
	t.Helper()
	if err := late.Commit(); err != nil {
		t.Fatal(err)
	}
	commitP2AndCheckOrder(t, db, ob, broker)
	if got := broker.uuids("orders"); !slices.Equal(got, []string{"o-1"}) {
		t.Errorf("sent to orders: %v", got)
	}
}

// roundsWhileGoneWaitsFor runs relay rounds while topic gone waits, 50 ms
// apart, for d.
func roundsWhileGoneWaitsFor(t *testing.T, ob *inbox.Outbox, d time.Duration) {
	t.Helper()
	for end := time.Now().Add(d); time.Now().Before(end); {
		roundWhileGoneWaits(t, ob)
		time.Sleep(50 * time.Millisecond)
	}
}

// Rows another relay instance holds while the floor is found count as
// there: when it rolls back (stopped mid-round), this relay sends them,
// in order.
func TestOutboxRelayFloorCountsTheRowsAnotherRelayHolds(t *testing.T) {
	t.Run("postgres", func(t *testing.T) {
		testOutboxRelayFloorCountsTheRowsAnotherRelayHolds(t, testdb.OpenPostgres(t, ""), inbox.PostgreSQL)
	})
	t.Run("mysql", func(t *testing.T) {
		testOutboxRelayFloorCountsTheRowsAnotherRelayHolds(t, testdb.OpenMySQL(t, ""), inbox.MySQL)
	})
}

func testOutboxRelayFloorCountsTheRowsAnotherRelayHolds(t *testing.T, db *sqlx.DB, d inbox.Dialect) {
	broker := newBrokerStub()
	ob := newTestOutbox(t, db, d, inbox.OutboxConfig{Publisher: broker})
	waitingBacklog(t, db, ob, 50)
	commitOutputs(t, db, ob, "payments", "p-1")
	commitOutputs(t, db, ob, "orders", "o-1")
	// READ COMMITTED: MySQL/MariaDB's locking read then keeps only the
	// rows it returns locked, as the relay's does.
	other, err := db.BeginTxx(context.Background(), &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		t.Fatal(err)
	}
	defer other.Rollback() //nolint:errcheck
	var held string
	if err := other.Get(&held, "SELECT uuid FROM "+relayTable(t, ob)+" WHERE topic = 'payments' FOR UPDATE"); err != nil {
		t.Fatal(err)
	}
	// Rounds for longer than a candidate waits before its check on
	// MySQL/MariaDB, twice.
	roundsWhileGoneWaitsFor(t, ob, 2500*time.Millisecond)
	if d == inbox.MySQL && ob.WaitingTopicsFloor() == 0 {
		// (PostgreSQL waits for the holder, which took a transaction id.)
		t.Errorf("no floor found while another transaction holds a row above the waiting topic's")
	}
	if err := other.Rollback(); err != nil {
		t.Fatal(err)
	}
	commitP2AndCheckOrder(t, db, ob, broker)
}

// A topic that waited, its rows below the floor, is read from the head of
// the table when its wait is over, while another topic still waits: its
// messages go, in order, once the broker takes it again.
func TestOutboxRelaySendsAWaitingTopicsBacklogOnceItIsTakenAgain(t *testing.T) {
	floorDBs(t, testOutboxRelaySendsAWaitingTopicsBacklogOnceItIsTakenAgain)
}

func testOutboxRelaySendsAWaitingTopicsBacklogOnceItIsTakenAgain(t *testing.T, db *sqlx.DB, d inbox.Dialect) {
	broker := newBrokerStub()
	ob := newTestOutbox(t, db, d, inbox.OutboxConfig{Publisher: broker})
	gone := waitingBacklog(t, db, ob, 50)
	var back []string
	for i := range 30 {
		back = append(back, fmt.Sprintf("back-%d", i))
	}
	commitOutputs(t, db, ob, "back", back...)
	commitOutputs(t, db, ob, "payments", "p-0")
	roundsUntilFloor(t, ob, 0, "gone", "back")
	ob.EndTopicWait("back")
	roundWhileGoneWaits(t, ob)
	roundWhileGoneWaits(t, ob)
	if got := broker.uuids("back"); !slices.Equal(got, back) {
		t.Errorf("sent to back: %v, want its %d messages in order", got, len(back))
	}
	if got := broker.uuids("gone"); len(got) != 0 {
		t.Errorf("sent to gone while it waits: %v", got)
	}
	if n := count(t, db, relayTable(t, ob), "1=1"); n != len(gone) {
		t.Errorf("%d rows left, want the %d of the waiting topic", n, len(gone))
	}
}

// A hand-made table whose id comes from a sequence that caches its values
// (each session takes ids from its own range, not in the order they are
// written) has no floor: the reads start at the head of the table, and
// every message of the other topics goes, in order.
func TestOutboxRelayReadsFromTheHeadWhenTheIdSequenceCaches(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	broker := newBrokerStub()
	ob := newTestOutbox(t, db, inbox.PostgreSQL, inbox.OutboxConfig{Publisher: broker})
	exec(t, db, "ALTER TABLE "+relayTable(t, ob)+" ALTER COLUMN id SET CACHE 20")
	assertNoFloorAndInOrder(t, db, ob, broker)
}

// On MySQL/MariaDB an auto_increment_increment above 1 is a multi-primary
// cluster's (Galera's, Group Replication's), whose other nodes' running
// transactions the floor's check cannot see: no floor, and every message
// of the other topics goes, in order.
func TestOutboxRelayReadsFromTheHeadOnAMultiPrimaryMySQLCluster(t *testing.T) {
	db := testdb.OpenMySQL(t, "auto_increment_increment=3")
	broker := newBrokerStub()
	ob := newTestOutbox(t, db, inbox.MySQL, inbox.OutboxConfig{Publisher: broker})
	assertNoFloorAndInOrder(t, db, ob, broker)
	// Rounds for longer than a candidate waits before its check, twice.
	roundsWhileGoneWaitsFor(t, ob, 2500*time.Millisecond)
	if f := ob.WaitingTopicsFloor(); f != 0 {
		t.Errorf("floor %d with auto_increment_increment = 3", f)
	}
}

// Whether the ids are handed out in order is looked at again every while:
// a sequence given a cache (a cluster grown to several primaries, on
// MySQL/MariaDB) while a floor is set drops the floor.
func TestOutboxRelayDropsItsFloorOnceTheIDsAreNoLongerHandedOutInOrder(t *testing.T) {
	inbox.SetOutboxFloorSweep(t, 50*time.Millisecond)
	db := testdb.OpenPostgres(t, "")
	broker := newBrokerStub()
	ob := newTestOutbox(t, db, inbox.PostgreSQL, inbox.OutboxConfig{Publisher: broker})
	waitingBacklog(t, db, ob, 50)
	commitOutputs(t, db, ob, "payments", "p-1")
	roundsUntilFloor(t, ob, 0, "gone")
	exec(t, db, "ALTER TABLE "+relayTable(t, ob)+" ALTER COLUMN id SET CACHE 20")
	time.Sleep(60 * time.Millisecond)
	roundWhileGoneWaits(t, ob)
	if f := ob.WaitingTopicsFloor(); f != 0 {
		t.Errorf("floor %d once the id sequence caches", f)
	}
	commitP2AndCheckOrder(t, db, ob, broker)
}

// brokerRefusingGone returns a broker that refuses topic gone as one that
// does not have it (ErrBrokerUnavailable) and takes the others.
func brokerRefusingGone() *brokerStub {
	broker := newBrokerStub()
	broker.setRefuse(func(topic string, _ *message.Message) error {
		if topic == "gone" {
			return fmt.Errorf("no such topic: %w", inbox.ErrBrokerUnavailable)
		}
		return nil
	})
	return broker
}

// restartOutboxIDs empties ob's table so that its ids start again at 1:
// TRUNCATE … RESTART IDENTITY on PostgreSQL, TRUNCATE on MySQL/MariaDB,
// the tables dropped and created again on SQLite.
func restartOutboxIDs(t *testing.T, db *sqlx.DB, d inbox.Dialect, ob *inbox.Outbox) {
	t.Helper()
	switch d {
	case inbox.PostgreSQL:
		exec(t, db, "TRUNCATE "+relayTable(t, ob)+" RESTART IDENTITY")
		return
	case inbox.MySQL:
		exec(t, db, "TRUNCATE TABLE "+relayTable(t, ob))
		return
	}
	exec(t, db, "DROP TABLE "+ob.Table())
	exec(t, db, "DROP TABLE "+ob.DeadLetterTable())
	if err := ob.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// commitP2AndCheckOrder commits message p-2 to payments, runs a round while
// gone waits, and checks that payments got p-1 and then p-2.
func commitP2AndCheckOrder(t *testing.T, db *sqlx.DB, ob *inbox.Outbox, broker *brokerStub) {
	t.Helper()
	commitOutputs(t, db, ob, "payments", "p-2")
	roundWhileGoneWaits(t, ob)
	if got := broker.uuids("payments"); !slices.Equal(got, []string{"p-1", "p-2"}) {
		t.Errorf("sent to payments: %v, want p-1 then p-2", got)
	}
}

// assertNoFloorAndInOrder writes a waiting backlog to gone, then messages
// to payments, two rounds while gone waits after each, and checks that ob
// has no floor and sent payments in order.
func assertNoFloorAndInOrder(t *testing.T, db *sqlx.DB, ob *inbox.Outbox, broker *brokerStub) {
	t.Helper()
	waitingBacklog(t, db, ob, 50)
	var want []string
	for i := range 5 {
		id := fmt.Sprintf("p-%d", i)
		commitOutputs(t, db, ob, "payments", id)
		want = append(want, id)
		roundWhileGoneWaits(t, ob)
		roundWhileGoneWaits(t, ob)
	}
	if f := ob.WaitingTopicsFloor(); f != 0 {
		t.Errorf("floor %d on a table whose ids are not handed out in order", f)
	}
	if got := broker.uuids("payments"); !slices.Equal(got, want) {
		t.Errorf("sent to payments: %v, want %v", got, want)
	}
}

// A message whose id was taken before the floor was found, by a
// transaction that had written nothing yet (an outbox written in a
// transaction of the user's own, not the inbox's), and committed after, is
// found by the read from the head of the table that comes every while, and
// sent.
func TestOutboxRelaySweepFindsAMessageCommittedBelowTheFloor(t *testing.T) {
	inbox.SetOutboxFloorSweep(t, 50*time.Millisecond)
	db := testdb.OpenPostgres(t, "")
	broker := newBrokerStub()
	ob := newTestOutbox(t, db, inbox.PostgreSQL, inbox.OutboxConfig{Publisher: broker})
	waitingBacklog(t, db, ob, 50)
	table := relayTable(t, ob)
	late, err := db.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	defer late.Rollback() //nolint:errcheck
	var id int64
	if err := late.Get(&id, "SELECT nextval(pg_get_serial_sequence($1, 'id'))", table); err != nil {
		t.Fatal(err)
	}
	commitOutputs(t, db, ob, "payments", "p-1")
	commitOutputs(t, db, ob, "gone", "gone-after")
	// Past gone-after, so that late's row, below it, is not the last row
	// below the floor (which the probe would see change).
	floor := roundsUntilFloor(t, ob, id+2, "gone")
	if _, err := late.Exec("INSERT INTO "+table+" (id, topic, uuid, payload, metadata) VALUES ($1, 'payments', 'late', 'p', '{}')", id); err != nil {
		t.Fatal(err)
	}
	if err := late.Commit(); err != nil {
		t.Fatal(err)
	}
	// The next message of late's topic, committed after it, above the
	// floor: late goes first, in the round whose sweep finds it.
	commitOutputs(t, db, ob, "payments", "p-2")
	deadline := time.Now().Add(time.Minute)
	for !slices.Contains(broker.uuids("payments"), "late") {
		if time.Now().After(deadline) {
			t.Fatalf("message %d committed below the floor %d not sent after a minute of rounds", id, floor)
		}
		time.Sleep(60 * time.Millisecond) // the sweep due
		roundWhileGoneWaits(t, ob)
	}
	roundWhileGoneWaits(t, ob)
	if got := broker.uuids("payments"); !slices.Equal(got, []string{"p-1", "late", "p-2"}) {
		t.Errorf("sent to payments: %v, want p-1, late, then p-2 (committed after late)", got)
	}
}

// The floor waits for a transaction that took its transaction id after the
// last one to end on the server (the probe snapshot's xmax is that last
// one's id plus one, so such a transaction runs beyond it, in no list of the
// snapshot): an inbox transaction that took its outbox id before a row the
// probe saw, and commits after, has its message sent before the next one of
// its topic.
func TestOutboxRelayFloorWaitsForATransactionNewerThanTheLastOneToEnd(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	broker := newBrokerStub()
	ob := newTestOutbox(t, db, inbox.PostgreSQL, inbox.OutboxConfig{Publisher: broker})
	waitingBacklog(t, db, ob, 50)
	early, earlyPub := beginOutbox(t, db, ob)
	defer early.Rollback() //nolint:errcheck
	if _, err := early.Exec("SELECT txid_current()"); err != nil {
		t.Fatal(err)
	}
	late, latePub := beginOutbox(t, db, ob)
	defer late.Rollback() //nolint:errcheck
	if _, err := late.Exec("SELECT txid_current()"); err != nil {
		t.Fatal(err)
	}
	if err := latePub.Publish("payments", message.NewMessage("p-1", []byte("p"))); err != nil {
		t.Fatal(err)
	}
	if err := earlyPub.Publish("gone", message.NewMessage("gone-after", []byte("p"))); err != nil {
		t.Fatal(err)
	}
	if err := early.Commit(); err != nil {
		t.Fatal(err)
	}
	roundWhileGoneWaits(t, ob)
	roundWhileGoneWaits(t, ob)
	roundWhileGoneWaits(t, ob)
	commitLateAndP2ThenCheckOrder(t, db, ob, broker, late, 2)
}

// commitLateAndP2ThenCheckOrder notes ob's floor, commits late (which
// wrote p-1 to payments), then p-2, runs rounds rounds while gone waits,
// and checks that payments got p-1 and then p-2.
func commitLateAndP2ThenCheckOrder(t *testing.T, db *sqlx.DB, ob *inbox.Outbox, broker *brokerStub, late *sqlx.Tx, rounds int) {
	t.Helper()
	floor := ob.WaitingTopicsFloor()
	if err := late.Commit(); err != nil {
		t.Fatal(err)
	}
	commitOutputs(t, db, ob, "payments", "p-2")
	for range rounds {
		roundWhileGoneWaits(t, ob)
	}
	if got := broker.uuids("payments"); !slices.Equal(got, []string{"p-1", "p-2"}) {
		t.Errorf("sent to payments: %v, want p-1 then p-2 (floor %d set while p-1's transaction ran)", got, floor)
	}
}

// MySQL/MariaDB: a transaction that took its outbox id before a row the
// relay saw and has not committed holds that row, locked, below the floor's
// candidate; the candidate waits for it, however many rounds pass, and its
// message goes before the next one of its topic.
func TestOutboxRelayFloorOnMySQLWaitsForARowStillUncommittedBelowIt(t *testing.T) {
	db := testdb.OpenMySQL(t, "")
	broker := newBrokerStub()
	ob := newTestOutbox(t, db, inbox.MySQL, inbox.OutboxConfig{Publisher: broker})
	waitingBacklog(t, db, ob, 50)
	late := p1WrittenThenLaterRows(t, db, ob, "")
	// Rounds for longer than a candidate waits before its check, twice.
	roundsWhileGoneWaitsFor(t, ob, 2500*time.Millisecond)
	if f := ob.WaitingTopicsFloor(); f != 0 {
		t.Errorf("floor %d set while p-1's transaction, below it, has not committed", f)
	}
	commitLateThenP2AndCheckOrder(t, db, ob, broker, late)
}

// SQLite: a transaction that wrote its output (after its claim) and has not
// committed while the relay looks holds the write lock, so every row the
// relay saw took its id before it: its message is above the floor, and goes
// before the next one of its topic.
func TestOutboxRelayFloorOnSQLiteStaysBelowAWriterInProgress(t *testing.T) {
	db := sqliteDB(t)
	broker := newBrokerStub()
	ob := newTestOutbox(t, db, inbox.SQLite, inbox.OutboxConfig{Publisher: broker})
	waitingBacklog(t, db, ob, 50)
	commitOutputs(t, db, ob, "orders", "o-1")
	roundsUntilFloor(t, ob, 0, "gone")
	late, latePub := beginOutbox(t, db, ob)
	if err := latePub.Publish("payments", message.NewMessage("p-1", []byte("p"))); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		roundWhileGoneWaits(t, ob)
	}
	if err := late.Commit(); err != nil {
		t.Fatal(err)
	}
	commitP2AndCheckOrder(t, db, ob, broker)
}

// A SQLite table without AUTOINCREMENT (made by hand) takes the largest id
// left plus one for a new row, below ids already sent and deleted: no
// floor, and every message of the other topics goes.
func TestOutboxRelayReadsFromTheHeadOnASQLiteTableWithoutAutoincrement(t *testing.T) {
	db := sqliteDB(t)
	broker := newBrokerStub()
	ob := newTestOutbox(t, db, inbox.SQLite, inbox.OutboxConfig{Publisher: broker})
	table := relayTable(t, ob)
	exec(t, db, "DROP TABLE "+table)
	exec(t, db, "CREATE TABLE "+table+" (id INTEGER PRIMARY KEY, topic TEXT NOT NULL, uuid TEXT NOT NULL, payload BLOB NOT NULL,"+
		" metadata BLOB NOT NULL, created_at INTEGER NOT NULL, attempts INTEGER NOT NULL DEFAULT 0, last_error TEXT)")
	assertNoFloorAndInOrder(t, db, ob, broker)
}

// The outbox's ids start again while a topic waits and the relay has a
// floor (the table re-created, TRUNCATE … RESTART IDENTITY, as an operator
// clearing the waiting topic's backlog by hand does): the new messages
// take ids below the floor, and go in order, from the head of the table
// (found by a review; they went from the floor on, the first ones after).
func TestOutboxRelayReadsFromTheHeadAfterTheOutboxIDsStartAgain(t *testing.T) {
	floorDBs(t, testOutboxRelayReadsFromTheHeadAfterTheOutboxIDsStartAgain)
}

func testOutboxRelayReadsFromTheHeadAfterTheOutboxIDsStartAgain(t *testing.T, db *sqlx.DB, d inbox.Dialect) {
	broker := newBrokerStub()
	ob := newTestOutbox(t, db, d, inbox.OutboxConfig{Publisher: broker})
	waitingBacklog(t, db, ob, 50)
	commitOutputs(t, db, ob, "orders", "o-1")
	floor := roundsUntilFloor(t, ob, 0, "gone")
	restartOutboxIDs(t, db, d, ob) // the backlog cleared by hand
	var want []string
	for i := range int(floor) + 5 {
		id := fmt.Sprintf("p-%d", i)
		commitOutputs(t, db, ob, "payments", id)
		want = append(want, id)
	}
	for range 5 {
		roundWhileGoneWaits(t, ob)
	}
	if got := broker.uuids("payments"); !slices.Equal(got, want) {
		t.Errorf("sent to payments (floor %d): %v, want %v", floor, got, want)
	}
}

// The floor outlasts the waiting topic's tries: when its wait ends, the
// round reads from the head of the table (its rows are there), the broker
// refuses it again, and the rounds after read from the floor again, not
// past the whole backlog twice more to find it.
func TestOutboxRelayKeepsItsFloorThroughTheWaitingTopicsTries(t *testing.T) {
	floorDBs(t, func(t *testing.T, db *sqlx.DB, d inbox.Dialect) {
		broker := brokerRefusingGone()
		ob := newTestOutbox(t, db, d, inbox.OutboxConfig{Publisher: broker})
		waitingBacklog(t, db, ob, 50)
		commitOutputs(t, db, ob, "payments", "p-0")
		floor := roundsUntilFloor(t, ob, 0, "gone")
		for i := range 3 {
			ob.EndTopicWait("gone")
			if r := ob.RelayRoundOfRun(context.Background()); r.Err == nil {
				t.Fatalf("try %d of gone: no error, want the broker's refusal", i)
			}
			if f := ob.WaitingTopicsFloor(); f < floor {
				t.Fatalf("floor %d after try %d of gone, was %d", f, i, floor)
			}
		}
	})
}

// The outbox's ids start again (TRUNCATE … RESTART IDENTITY, the table
// re-created) while the relay has a floor, and the first rows of the new
// ids go before the relay's next probe: a round in which the waiting topic
// is tried reads from the head (and keeps the floor), sends them, and the
// topic is refused again. The next probe finds another row than before
// below the floor, and the rounds read from the head: every message of
// another topic goes, in order (found by a review: a check of the table's
// first row, which had gone, let the floor stand, and the messages whose
// ids reached it went first).
func TestOutboxRelayReadsFromTheHeadAfterTheIDsStartAgainAndTheirFirstRowsWent(t *testing.T) {
	floorDBs(t, func(t *testing.T, db *sqlx.DB, d inbox.Dialect) {
		broker := brokerRefusingGone()
		ob := newTestOutbox(t, db, d, inbox.OutboxConfig{Publisher: broker})
		waitingBacklog(t, db, ob, 20) // ids 1..20: the first row the probes see is id 1
		commitOutputs(t, db, ob, "orders", "o-1")
		floor := roundsUntilFloor(t, ob, 0, "gone")
		restartOutboxIDs(t, db, d, ob)
		// New ids: p-0 is 1, a new message of the still broken topic 2.
		commitOutputs(t, db, ob, "payments", "p-0")
		commitOutputs(t, db, ob, "gone", "gone-new")
		// gone's wait ends: read from the head, p-0 sent, gone refused again.
		ob.EndTopicWait("gone")
		ob.RelayRoundOfRun(context.Background())
		want := []string{"p-0"}
		for i := range int(floor) + 3 {
			id := fmt.Sprintf("p-%d", i+1)
			commitOutputs(t, db, ob, "payments", id)
			want = append(want, id)
		}
		for range 5 {
			roundWhileGoneWaits(t, ob)
		}
		if got := broker.uuids("payments"); !slices.Equal(got, want) {
			t.Errorf("sent to payments (old floor %d, floor now %d): %v, want %v", floor, ob.WaitingTopicsFloor(), got, want)
		}
	})
}

// Writers that each commit one transaction after another, as the inbox's
// handlers of consumed partitions do (a row written first, then the
// outputs), have their messages published in their order, every one of
// them, while a topic the broker refuses waits with its backlog at the head
// of the table and the relay (Run) finds and moves its floor.
func TestOutboxRelayKeepsEachWritersOrderWhileATopicWaits(t *testing.T) {
	floorDBs(t, testOutboxRelayKeepsEachWritersOrderWhileATopicWaits)
}

func testOutboxRelayKeepsEachWritersOrderWhileATopicWaits(t *testing.T, db *sqlx.DB, d inbox.Dialect) {
	broker := brokerRefusingGone()
	ob := newTestOutbox(t, db, d, inbox.OutboxConfig{Publisher: broker})
	waitingBacklog(t, db, ob, 2000)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ob.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	// The inbox's claim is the transaction's first write: on PostgreSQL
	// it has a transaction id before its outputs take their outbox ids.
	first := map[inbox.Dialect]string{inbox.PostgreSQL: "SELECT txid_current()"}[d]
	const writers, perWriter = 4, 300
	errs := make(chan error, writers)
	for w := range writers {
		go func() {
			errs <- func() error {
				for i := range perWriter {
					tx, err := db.Beginx()
					if err != nil {
						return err
					}
					if first != "" {
						if _, err := tx.Exec(first); err != nil {
							tx.Rollback() //nolint:errcheck
							return err
						}
					}
					pub, err := ob.Publisher(tx)
					if err != nil {
						tx.Rollback() //nolint:errcheck
						return err
					}
					msgs := []*message.Message{message.NewMessage(fmt.Sprintf("w%d-%d", w, i), []byte("p"))}
					topic := fmt.Sprintf("t%d", (w+i)%3)
					if i%10 == 0 {
						if err := pub.Publish("gone", message.NewMessage(fmt.Sprintf("gone-w%d-%d", w, i), []byte("p"))); err != nil {
							tx.Rollback() //nolint:errcheck
							return err
						}
					}
					if err := pub.Publish(topic, msgs...); err != nil {
						tx.Rollback() //nolint:errcheck
						return err
					}
					// Work after the output (a handler's), so that
					// transactions overlap the relay's probes.
					time.Sleep(time.Duration(i%3) * 4 * time.Millisecond)
					if err := tx.Commit(); err != nil {
						return err
					}
				}
				return nil
			}()
		}()
	}
	var floorSeen int64
	deadline := time.Now().Add(2 * time.Minute)
	for writing := writers; ; {
		select {
		case err := <-errs:
			if err != nil {
				t.Fatalf("writer: %v", err)
			}
			writing--
		case <-time.After(100 * time.Millisecond):
		}
		floorSeen = max(floorSeen, ob.WaitingTopicsFloor())
		sent := len(broker.uuids("t0")) + len(broker.uuids("t1")) + len(broker.uuids("t2"))
		if writing == 0 && sent >= writers*perWriter {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d messages sent after two minutes", sent, writers*perWriter)
		}
	}
	if floorSeen == 0 {
		t.Errorf("the rounds never read from a floor")
	}
	// Per writer, per topic: its messages in the order it committed them,
	// each once.
	for topic := range 3 {
		next := make([]int, writers)
		for _, id := range broker.uuids(fmt.Sprintf("t%d", topic)) {
			var w, i int
			if _, err := fmt.Sscanf(id, "w%d-%d", &w, &i); err != nil {
				t.Fatalf("message %q: %v", id, err)
			}
			if i < next[w] || (w+i)%3 != topic {
				t.Errorf("t%d: %s after w%d-%d", topic, id, w, next[w]-1)
			}
			next[w] = i + 1
		}
	}
	if got := broker.uuids("gone"); len(got) != 0 {
		t.Errorf("sent to gone while it waits: %d messages", len(got))
	}
}

// MySQL/MariaDB: the floor's candidate is checked (no row below it locked)
// in a round in which the waiting topic is tried, so the round has no probe
// and the candidate is promoted only at the next round's probe. The
// outbox's ids start again in between (the backlog cleared by hand with
// TRUNCATE): the check said nothing about the new ids, and a transaction
// that took a new id below the rows the promoting probe sees, and has not
// committed, is left below the floor: its message must still go before the
// next message of its topic, committed after it.
func TestOutboxRelayFloorOnMySQLDoesNotTrustACheckMadeBeforeTheIDsStartedAgain(t *testing.T) {
	db := testdb.OpenMySQL(t, "")
	broker := brokerRefusingGone()
	ob := newTestOutbox(t, db, inbox.MySQL, inbox.OutboxConfig{Publisher: broker})
	waitingBacklog(t, db, ob, 20) // ids 1..20
	commitOutputs(t, db, ob, "orders", "o-1")
	// The probe finds the candidate (o-1's id); no floor yet.
	roundWhileGoneWaits(t, ob)
	if f := ob.WaitingTopicsFloor(); f != 0 {
		t.Fatalf("floor %d after the first probe", f)
	}
	time.Sleep(1100 * time.Millisecond) // past the candidate's age
	// gone's try: the candidate is checked (and cleared), no probe; gone is
	// refused and waits again.
	ob.EndTopicWait("gone")
	ob.RelayRoundOfRun(context.Background())
	restartIDsThenCheckALateMessageGoesFirst(t, db, inbox.MySQL, ob, broker)
}

// restartIDsThenCheckALateMessageGoesFirst starts the outbox ids of ob
// again (the backlog cleared by hand), commits gone-new-1, writes p-1 to
// payments in a transaction left open, commits gone-new-2, runs a round
// while gone waits, commits p-1's transaction and then p-2, runs three
// rounds, and checks that payments got p-1 and then p-2.
func restartIDsThenCheckALateMessageGoesFirst(t *testing.T, db *sqlx.DB, d inbox.Dialect, ob *inbox.Outbox, broker *brokerStub) {
	t.Helper()
	restartOutboxIDs(t, db, d, ob)
	commitOutputs(t, db, ob, "gone", "gone-new-1")
	late, latePub := beginOutbox(t, db, ob)
	defer late.Rollback() //nolint:errcheck
	if err := latePub.Publish("payments", message.NewMessage("p-1", []byte("p"))); err != nil {
		t.Fatal(err)
	}
	commitOutputs(t, db, ob, "gone", "gone-new-2")
	roundWhileGoneWaits(t, ob)
	commitLateAndP2ThenCheckOrder(t, db, ob, broker, late, 3)
}

// PostgreSQL: the outbox's ids start again (the backlog cleared by hand
// with TRUNCATE … RESTART IDENTITY) after the floor's candidate was found
// and before it is promoted. The transactions the candidate waits for are
// those that ran at its probe; a transaction that began after it took a new
// id below the rows the promoting probe sees, and has not committed: it is
// left below the floor, and its message must still go before the next
// message of its topic, committed after it.
func TestOutboxRelayFloorOnPostgreSQLDoesNotTrustACandidateFoundBeforeTheIDsStartedAgain(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	broker := brokerRefusingGone()
	ob := newTestOutbox(t, db, inbox.PostgreSQL, inbox.OutboxConfig{Publisher: broker})
	waitingBacklog(t, db, ob, 20) // ids 1..20
	commitOutputs(t, db, ob, "orders", "o-1")
	roundWhileGoneWaits(t, ob) // the candidate: o-1's id
	if f := ob.WaitingTopicsFloor(); f != 0 {
		t.Fatalf("floor %d after the first probe", f)
	}
	restartIDsThenCheckALateMessageGoesFirst(t, db, inbox.PostgreSQL, ob, broker)
}

// The application keeps writing to the topic the broker refuses (a deleted
// topic still produced to) beside the other topics, each transaction
// overlapping the next: at every probe one of them has written its message
// to the waiting topic, below a message of another topic committed after
// it, and commits before the next round. Its row, then the last one below
// the candidate, is one the candidate's wait covers, not a sign that the
// ids started again: the floor is found, as it was before candidates kept
// the last row below them (since then each candidate started over, every
// time, and every round read past the whole backlog).
func TestOutboxRelayFindsItsFloorWhileTheWaitingTopicIsStillWritten(t *testing.T) {
	test := func(t *testing.T, db *sqlx.DB, d inbox.Dialect, first string) {
		broker := brokerRefusingGone()
		ob := newTestOutbox(t, db, d, inbox.OutboxConfig{Publisher: broker})
		waitingBacklog(t, db, ob, 50)
		var prev *sqlx.Tx
		defer func() {
			if prev != nil {
				prev.Rollback() //nolint:errcheck
			}
		}()
		// Rounds enough for the candidate's wait: a second each on
		// MySQL/MariaDB; on PostgreSQL, transactions of other sessions on
		// the server may hold it back a while.
		steps, pause := 40, 50*time.Millisecond
		if d == inbox.MySQL {
			steps, pause = 6, 1100*time.Millisecond // past a candidate's age
		}
		for i := range steps {
			// The next writer of gone: its message written, not committed.
			tx, pub := beginOutbox(t, db, ob)
			if first != "" {
				if _, err := tx.Exec(first); err != nil {
					tx.Rollback() //nolint:errcheck
					t.Fatal(err)
				}
			}
			if err := pub.Publish("gone", message.NewMessage(fmt.Sprintf("gone-late-%d", i), []byte("p"))); err != nil {
				tx.Rollback() //nolint:errcheck
				t.Fatal(err)
			}
			// The one before it commits.
			if prev != nil {
				if err := prev.Commit(); err != nil {
					tx.Rollback() //nolint:errcheck
					t.Fatal(err)
				}
			}
			prev = tx
			commitOutputs(t, db, ob, "payments", fmt.Sprintf("p-%d", i))
			time.Sleep(pause)
			roundWhileGoneWaits(t, ob)
			if f := ob.WaitingTopicsFloor(); f > 0 {
				t.Logf("floor %d after %d rounds", f, i+1)
				return
			}
		}
		t.Errorf("no floor after %d rounds while gone is written beside payments, one writer of it over each probe", steps)
	}
	t.Run("postgres", func(t *testing.T) { test(t, testdb.OpenPostgres(t, ""), inbox.PostgreSQL, "SELECT txid_current()") })
	t.Run("mysql", func(t *testing.T) { test(t, testdb.OpenMySQL(t, ""), inbox.MySQL, "") })
}
