package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
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
