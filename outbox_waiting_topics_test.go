package inbox_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
	"modernc.org/sqlite"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// Thousands of topics waiting for their next try at once (one per tenant,
// none of which the broker has) are left out of a round's read with one
// bind parameter: each took one, and past the database's limit (SQLite
// 32766, PostgreSQL and MySQL 65535) every read failed, the healthy topics'
// too. Here the connection's limit is lowered to 1,100 and 1,200 topics
// wait.
func TestOutboxRelayReadsWhileMoreTopicsWaitThanTheDatabaseTakesParameters(t *testing.T) {
	db := sqliteDB(t)
	db.SetMaxOpenConns(1)
	conn, err := db.Conn(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	const sqliteLimitVariableNumber = 9
	if _, err := sqlite.Limit(conn, sqliteLimitVariableNumber, 1100); err != nil {
		t.Fatal(err)
	}
	conn.Close() // back to the pool of one, its limit kept
	broker := newBrokerStub()
	ob := newTestOutbox(t, db, inbox.SQLite, inbox.OutboxConfig{Publisher: broker})
	tx, pub := beginOutbox(t, db, ob)
	if err := pub.Publish("payments", message.NewMessage("healthy", []byte("p"))); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	waiting := make([]string, 1200)
	for i := range waiting {
		waiting[i] = fmt.Sprintf("tenant-%d", i)
	}
	if r := ob.RelayRoundWhileTopicsWait(context.Background(), waiting); r.Err != nil || r.Relayed != 1 {
		t.Fatalf("round with %d topics waiting: %+v, want the healthy message relayed", len(waiting), r)
	}
}

// However many topics wait, each with rows written before a healthy topic's
// message, the read leaves them all out and reaches the healthy one, on
// every database: when only some were left out, the others' rows filled
// the batch, all skipped, and the healthy topic waited as long as they did.
func TestOutboxRelayReachesAHealthyTopicBehindThousandsOfWaitingOnes(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		broker := newBrokerStub()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker})
		waiting := make([]string, 1600)
		tx, pub := beginOutbox(t, db, ob)
		for i := range waiting {
			waiting[i] = fmt.Sprintf("tenant-%d/ü😀", i) // not only ASCII, nor only the BMP
			if err := pub.Publish(waiting[i], message.NewMessage(fmt.Sprintf("w-%d", i), []byte("p"))); err != nil {
				t.Fatal(err)
			}
		}
		if err := pub.Publish("payments", message.NewMessage("healthy", []byte("p"))); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		if r := ob.RelayRoundWhileTopicsWait(context.Background(), waiting); r.Err != nil || r.Relayed != 1 {
			t.Fatalf("round with %d topics waiting: %+v, want the healthy message relayed", len(waiting), r)
		}
		if got := broker.uuids("payments"); len(got) != 1 {
			t.Errorf("sent to payments: %v", got)
		}
		if n := count(t, db, relayTable(t, ob), "1=1"); n != len(waiting) {
			t.Errorf("%d rows left, want the %d of the waiting topics", n, len(waiting))
		}
	})
}

// MariaDB/MySQL with the common DSN setting charset=utf8 (utf8mb3): a topic
// with a 4-byte character (an emoji) is written to the varbinary column,
// and once it waits the read still leaves it out: the JSON list of waiting
// topics broke on the way in, JSON_TABLE refused it (4035), and every read
// failed, the healthy topics' too.
func TestOutboxRelayLeavesOutAWaitingTopicBeyondTheBMPOnAUTF8mb3Connection(t *testing.T) {
	db := testdb.OpenMySQL(t, "charset=utf8")
	broker := newBrokerStub()
	ob := newTestOutbox(t, db, inbox.MySQL, inbox.OutboxConfig{Publisher: broker})
	tx, pub := beginOutbox(t, db, ob)
	if err := pub.Publish("tenant-😀", message.NewMessage("waiting", []byte("p"))); err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish("payments", message.NewMessage("healthy", []byte("p"))); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	if r := ob.RelayRoundWhileTopicsWait(context.Background(), []string{"tenant-😀"}); r.Err != nil || r.Relayed != 1 {
		t.Fatalf("round while tenant-😀 waits: %+v, want the healthy message relayed", r)
	}
}
