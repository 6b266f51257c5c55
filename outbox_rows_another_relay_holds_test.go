package inbox_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// Another relay instance's round holds the first BatchSize rows (its broker
// slow, its host cut off): this relay's round sends the rows behind them.
// A relay that read its batch from a snapshot and locked it after read
// those same rows, found them all locked, and sent nothing, every round.
func TestOutboxRelaySendsTheRowsBehindTheBatchAnotherRelayHolds(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if tdb.Dialect == inbox.SQLite {
			t.Skip("no row locks")
		}
		broker := newBrokerStub()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, BatchSize: 10, PollInterval: time.Hour})
		writeOutbox(t, db, ob, "orders", 30)
		other, err := db.BeginTxx(context.Background(), &sql.TxOptions{Isolation: sql.LevelReadCommitted})
		if err != nil {
			t.Fatal(err)
		}
		defer other.Rollback() //nolint:errcheck
		var held []int64
		if err := other.Select(&held, "SELECT id FROM "+relayTable(t, ob)+" ORDER BY id LIMIT 10 FOR UPDATE SKIP LOCKED"); err != nil || len(held) != 10 {
			t.Fatalf("hold the first 10 rows: %v, %v", held, err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if r := ob.RelayOnce(ctx); r.Err != nil || r.Relayed != 10 {
			t.Errorf("round while another relay holds the first 10 rows: relayed %d, error %v; want the next 10", r.Relayed, r.Err)
		}
	})
}

// Two relay instances on one outbox table, the first one's broker hung in
// Publish, its round holding the first BatchSize rows: the second, whose
// broker is fine, relays the rows behind them meanwhile.
func TestSecondRelayInstanceWorksWhileTheFirstIsStuck(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if tdb.Dialect == inbox.SQLite {
			t.Skip("one relay per SQLite database")
		}
		stuck := &blockingBroker{brokerStub: newBrokerStub(), entered: make(chan struct{}, 1), release: make(chan struct{})}
		first := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: stuck, BatchSize: 10, PollInterval: 20 * time.Millisecond})
		healthy := newBrokerStub()
		second, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Dialect: tdb.Dialect, Table: first.Table(), Publisher: healthy,
			BatchSize: 10, PollInterval: 20 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		writeOutbox(t, db, first, "orders", 30)
		stopFirst := runRelay(first)
		defer stopFirst()
		defer close(stuck.release) // before stopFirst: its round waits in Publish
		<-stuck.entered            // its round holds the first 10 rows
		stopSecond := runRelay(second)
		defer stopSecond()
		deadline := time.Now().Add(10 * time.Second)
		for len(healthy.uuids("orders")) < 20 && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		if n := len(healthy.uuids("orders")); n < 20 {
			t.Errorf("in 10 s the second relay sent %d of the 20 messages behind the 10 the stuck one holds, want 20", n)
		}
	})
}
