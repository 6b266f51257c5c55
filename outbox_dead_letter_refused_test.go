package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A dead-letter table altered by hand after startup (an operator added a
// NOT NULL column to it) refuses the move of a message to set aside: the
// message stays first in line, with the reason as its last error, and the
// round records the rest. The round failed as a whole: the messages it
// published behind the refused one were sent again in every round, and the
// rest of the topic never went, while the broker took everything.
func TestOutboxRelayKeepsAMessageTheDeadLetterTableRefusesAndRecordsTheRest(t *testing.T) {
	refusals := map[string]error{
		"plain":              errors.New("the broker refuses the message"),
		"ErrMessageRejected": fmt.Errorf("%w: too large", inbox.ErrMessageRejected),
	}
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if tdb.Name == "sqlite" || strings.HasPrefix(tdb.Name, "postgres-") || tdb.Name == "mysql-clientFoundRows" {
			t.Skip("postgres and mysql suffice")
		}
		for name, refusal := range refusals {
			t.Run(name, func(t *testing.T) {
				broker := newBrokerStub()
				table := "outbox_" + randomSuffix()
				dropLater(t, db, table)
				dropLater(t, db, table+"_dead")
				ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Dialect: tdb.Dialect, Table: table, Publisher: broker, MaxAttempts: 1})
				if err != nil {
					t.Fatal(err)
				}
				if err := ob.InitializeSchema(context.Background()); err != nil {
					t.Fatal(err)
				}
				if err := ob.Verify(context.Background()); err != nil {
					t.Fatal(err)
				}
				// After startup, the operator adds a column to the dead-letter table.
				exec(t, db, "ALTER TABLE "+table+"_dead ADD COLUMN reviewed_by varchar(64) NOT NULL")
				t.Logf("Verify after the change (what RouterPlugin runs at the next start): %v", ob.Verify(context.Background()))
				ids := writeOutbox(t, db, ob, "payments", 5)
				broker.setRefuse(refuseUUIDs(refusal, ids[0]))
				for range 20 {
					ob.RelayOnce(context.Background())
				}
				got := broker.uuids("payments")
				seen := map[string]int{}
				for _, id := range got {
					seen[id]++
				}
				for _, id := range ids[1:] {
					if seen[id] != 1 {
						t.Errorf("message %s reached the broker %d times in 20 rounds, want once", id, seen[id])
					}
				}
				stats, err := ob.Stats(context.Background())
				if err != nil {
					t.Fatal(err)
				}
				if stats.Pending != 1 {
					t.Errorf("outbox holds %d rows after 20 rounds, want 1 (the refused message, first in line); %d publishes reached the broker", stats.Pending, len(got))
				}
				round := ob.RelayOnce(context.Background())
				t.Logf("last round: %+v", round)
			})
		}
	})
}

// countingRefuser refuses every message with ErrMessageRejected and counts
// the calls.
type countingRefuser struct{ calls atomic.Int64 }

func (c *countingRefuser) Publish(string, ...*message.Message) error {
	c.calls.Add(1)
	return fmt.Errorf("%w: too large", inbox.ErrMessageRejected)
}
func (c *countingRefuser) Close() error { return nil }

// A message that the dead-letter table refuses is kept first in line, and
// its topic waits as a refused one does: the topic had counted as taken,
// and Run's "full round" branch started the next round at once, the relay
// publishing the refused message and writing its attempt as fast as it
// could (323 times a second at BatchSize 1).
func TestOutboxRelayBacksOffAMessageTheDeadLetterTableRefuses(t *testing.T) {
	for name, cfg := range map[string]inbox.OutboxConfig{
		"BatchSize=1":       {MaxAttempts: 1, BatchSize: 1, PollInterval: time.Hour, MaxBackoff: 10 * time.Second},
		"PollInterval=10ms": {MaxAttempts: 1, PollInterval: 10 * time.Millisecond, MaxBackoff: 10 * time.Second},
	} {
		t.Run(name, func(t *testing.T) { deadLetterRefusedSpin(t, cfg) })
	}
}

func deadLetterRefusedSpin(t *testing.T, cfg inbox.OutboxConfig) {
	db := testdb.OpenPostgres(t, "")
	pub := &countingRefuser{}
	cfg.Publisher = pub
	ob := newTestOutbox(t, db, inbox.PostgreSQL, cfg)
	tbl := ob.Table()
	exec(t, db, "ALTER TABLE "+tbl+"_dead ADD COLUMN reviewed_by varchar(64) NOT NULL")
	tx, w := beginOutbox(t, db, ob)
	if err := w.Publish("payments", message.NewMessage("a", []byte("a"))); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	stop := runRelay(ob)
	time.Sleep(time.Second)
	stop()
	var attempts int
	if err := db.Get(&attempts, "SELECT attempts FROM "+tbl); err != nil {
		t.Fatal(err)
	}
	if n := pub.calls.Load(); n > 10 {
		t.Errorf("in 1 s the relay published the refused message %d times (attempts now %d); a refused message's topic backs off (50 ms doubling)", n, attempts)
	}
}
