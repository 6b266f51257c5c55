package inbox_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// An outbox table whose last_error column a migration tool made
// varchar(255), and its dead-letter table's too: a refusal's text longer
// than that is cut to fit, or left out, the round records what it sent, and
// the refused message is set aside. The failed UPDATE failed the
// round after its publishes: the messages the broker took were sent again
// in every round, and the refused one never used an attempt, never set
// aside.
func TestOutboxRelayRecordsARoundWhenLastErrorIsNarrowerThanTheRefusal(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if tdb.Dialect == inbox.SQLite {
			t.Skip("SQLite does not enforce a declared length")
		}
		for _, c := range []struct {
			width   int
			deadToo bool // the dead-letter table's too (the same DDL)
		}{{255, false}, {20, false}, {255, true}, {20, true}} {
			width := c.width
			broker := newBrokerStub()
			ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, PollInterval: time.Hour, MaxAttempts: 3})
			tables := []string{ob.Table()}
			if c.deadToo {
				tables = append(tables, ob.DeadLetterTable())
			}
			for _, table := range tables {
				alter := "ALTER TABLE " + table + " ALTER COLUMN last_error TYPE varchar(" + strconv.Itoa(width) + ")"
				if tdb.Dialect == inbox.MySQL {
					alter = "ALTER TABLE " + table + " MODIFY last_error varchar(" + strconv.Itoa(width) + ")"
				}
				exec(t, db, alter)
			}
			ids := writeOutbox(t, db, ob, "t", 3)
			broker.setRefuse(refuseUUIDs(errors.New("broker says: "+strings.Repeat("the record is refused; ", 20)), ids[1]))
			for range 5 {
				ob.RelayOnce(context.Background())
			}
			sends := 0
			for _, u := range broker.uuids("t") {
				if u == ids[0] {
					sends++
				}
			}
			st, err := ob.Stats(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			// Sent in the refused call, then alone, and its row deleted.
			if sends > 2 || st.DeadLettered != 1 {
				t.Errorf("last_error varchar(%d) (the dead-letter table's too: %v): message %s, which the broker took, was sent %d times"+
					" in 5 rounds; outbox %+v; want it sent at most twice and the refused message set aside after its 3 attempts",
					width, c.deadToo, ids[0], sends, st)
			}
		}
	})
}
