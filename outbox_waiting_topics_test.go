package inbox_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"modernc.org/sqlite"

	"github.com/watermill-inbox/inbox"
)

// Thousands of topics waiting for their next try at once (one per tenant,
// none of which the broker has) are left out of a round's read only up to
// a bound: each took a bind parameter, and past the database's limit
// (SQLite 32766, PostgreSQL and MySQL 65535) every read failed, the
// healthy topics' too. Here the connection's limit is lowered to 1,100 and
// 1,200 topics wait.
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
