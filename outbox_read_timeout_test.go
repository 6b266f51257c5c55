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
// broker worked. It reads fewer rows after such a timeout, and sends them.
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
			for round := 0; round < 5*messages && len(broker.messages("large")) < messages; round++ {
				if r := relay.RelayOnce(context.Background()); r.Err != nil {
					timedOut++
					t.Logf("round %d: %v", round, r.Err)
				}
			}
			got := broker.messages("large")
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
