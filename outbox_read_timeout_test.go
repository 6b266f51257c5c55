package inbox_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A statement timeout on the relay's sessions (a role's or database's
// statement_timeout, MariaDB's max_statement_time) shorter than reading one
// batch of large messages stopped every round's read: the relay read
// BatchSize rows again after each failure, and sent nothing while the
// broker worked. It reads fewer rows after such a timeout, and sends them;
// and after a DELETE of rows it sent that timed out too (it sent them again,
// every round).
func TestOutboxRelayReadsFewerRowsWhenItsReadTimesOut(t *testing.T) {
	const messages, size = 200, 1 << 20
	payload := make([]byte, size)
	for i := range payload {
		payload[i] = byte(i * 7) // not all alike: TOAST would compress them to nothing
	}
	for _, tc := range []struct {
		name    string
		dialect inbox.Dialect
		open    func(t *testing.T) (writer, relay *sqlx.DB)
		perTx   int // messages per writing transaction (MariaDB's max_allowed_packet)
	}{
		{"postgres", inbox.PostgreSQL, func(t *testing.T) (*sqlx.DB, *sqlx.DB) {
			return testdb.OpenPostgres(t, ""), testdb.OpenPostgres(t, "options=-c%20statement_timeout%3D300")
		}, 50},
		{"mysql", inbox.MySQL, func(t *testing.T) (*sqlx.DB, *sqlx.DB) {
			return testdb.OpenMySQL(t, ""), testdb.OpenMySQL(t, "max_statement_time=0.3")
		}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			writer, relayDB := tc.open(t)
			ob := newTestOutbox(t, writer, tc.dialect, inbox.OutboxConfig{Publisher: newBrokerStub()})
			for i := 0; i < messages; i += tc.perTx {
				tx, pub := beginOutbox(t, writer, ob)
				var msgs []*message.Message
				for j := i; j < i+tc.perTx; j++ {
					msgs = append(msgs, message.NewMessage(fmt.Sprintf("m%03d", j), payload))
				}
				if err := pub.Publish("large", msgs...); err != nil {
					t.Fatal(err)
				}
				if err := tx.Commit(); err != nil {
					t.Fatal(err)
				}
			}
			broker := newBrokerStub()
			relay, err := inbox.NewOutbox(inbox.OutboxConfig{DB: relayDB, Dialect: tc.dialect, Table: relayTable(t, ob), Publisher: broker})
			if err != nil {
				t.Fatal(err)
			}
			var timedOut int
			// Under load even a few rows can outlast the timeout, and the
			// relay then reads one row a round: rounds enough for that.
			for round := 0; round < 5*messages && count(t, writer, relayTable(t, ob), "1=1") > 0; round++ {
				if r := relay.RelayOnce(context.Background()); r.Err != nil {
					timedOut++
					t.Logf("round %d: %v", round, r.Err)
				}
			}
			// A round whose DELETE timed out sent its messages again (at
			// least once): each message's first sending counts.
			var got []*message.Message
			seen := map[string]bool{}
			for _, m := range broker.messages("large") {
				if !seen[m.UUID] {
					seen[m.UUID] = true
					got = append(got, m)
				}
			}
			if len(got) != messages {
				t.Fatalf("sent %d of %d messages in %d rounds", len(got), messages, 5*messages)
			}
			for i, m := range got {
				if want := fmt.Sprintf("m%03d", i); m.UUID != want || len(m.Payload) != size {
					t.Fatalf("message %d sent is %s (%d bytes), want %s (%d bytes), in order", i, m.UUID, len(m.Payload), want, size)
				}
			}
			if timedOut == 0 {
				t.Logf("no read timed out (a fast machine): the test proved nothing this time")
			}
			if n := count(t, writer, relayTable(t, ob), "1=1"); n != 0 {
				t.Errorf("%d rows left in the outbox, want none", n)
			}
		})
	}
}

// The relay's DELETE of the rows it sent outlasts a statement timeout (here
// a trigger takes 10 ms a row, 300 ms allowed) while its reads do not: it
// reads, and so deletes, fewer rows after such a round, and the outbox
// empties. Each round failed after its publishes and sent them all again,
// for ever.
func TestOutboxRelayDeletesFewerRowsWhenItsDeleteTimesOut(t *testing.T) {
	writer := testdb.OpenPostgres(t, "")
	relayDB := testdb.OpenPostgres(t, "options=-c%20statement_timeout%3D300")
	ob := newTestOutbox(t, writer, inbox.PostgreSQL, inbox.OutboxConfig{Publisher: newBrokerStub()})
	table := relayTable(t, ob)
	slow := table + "_slow_delete"
	exec(t, writer, "CREATE FUNCTION "+slow+"() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(0.01); RETURN OLD; END $$")
	t.Cleanup(func() { _, _ = writer.Exec("DROP FUNCTION IF EXISTS " + slow + "() CASCADE") })
	exec(t, writer, "CREATE TRIGGER "+slow+" BEFORE DELETE ON "+table+" FOR EACH ROW EXECUTE FUNCTION "+slow+"()")
	writeOutbox(t, writer, ob, "t", 100)
	broker := newBrokerStub()
	relay, err := inbox.NewOutbox(inbox.OutboxConfig{DB: relayDB, Dialect: inbox.PostgreSQL, Table: table, Publisher: broker})
	if err != nil {
		t.Fatal(err)
	}
	for round := 0; round < 30 && count(t, writer, table, "1=1") > 0; round++ {
		if r := relay.RelayOnce(context.Background()); r.Err != nil {
			t.Logf("round %d: %v", round, r.Err)
		}
	}
	if n := count(t, writer, table, "1=1"); n != 0 {
		t.Errorf("%d of 100 rows left after 30 rounds (%d messages sent): every round's DELETE timed out", n, len(broker.uuids("t")))
	}
}
