package inbox_test

import (
	"context"
	"database/sql"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
)

// A writer that commits one transaction after another has its messages of
// a topic sent in that order, also when the round's walk reads past its
// batch for a message that tells a refused one is the problem (evidence).
//
// Writer W's first transaction wrote L (the smaller id) and was still open
// when the round read its batch, which held only another writer's message,
// on its last attempt. While the broker refused that message, W committed
// L's transaction and then a second one writing R. The walk then read the
// topic's first message past the batch's last row, R (L is below it), sent
// it alone as evidence and set the refused message aside; L went in the
// next round: R before L, nothing having crashed or failed. (PostgreSQL and
// MySQL/MariaDB: their ids are taken before their transactions commit.)
func TestOutboxRelayKeepsAWritersOrderWhenItLooksBehindARefusedMessage(t *testing.T) {
	for _, tdb := range crashDBs(t, "postgres", "mysql") {
		t.Run(tdb.Name, func(t *testing.T) {
			t.Parallel()
			db := tdb.Open(t)
			broker := newBrokerStub()
			ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, MaxAttempts: 1})

			first, pub := beginOutbox(t, db, ob) // W's first transaction, open during the round's read
			if err := pub.Publish("invoices", message.NewMessage("W-1", []byte("L"))); err != nil {
				t.Fatal(err)
			}
			commitOutputs(t, db, ob, "invoices", "refused") // another writer's, on its last attempt

			var once sync.Once
			broker.setRefuse(func(_ string, m *message.Message) error {
				if m.UUID != "refused" {
					return nil
				}
				once.Do(func() { // while the broker answers: W commits, then commits again
					if err := first.Commit(); err != nil {
						t.Error(err)
					}
					commitOutputs(t, db, ob, "invoices", "W-2")
				})
				return errors.New("refused by the broker")
			})
			relayUntilEmpty(t, ob)
			relayUntilEmpty(t, ob)

			// Each message's first arrival: one sent again beside a refused
			// one in a failed call arrives twice (at least once).
			var arrived []string
			for _, id := range broker.uuids("invoices") {
				if id != "refused" && !slices.Contains(arrived, id) {
					arrived = append(arrived, id)
				}
			}
			if !slices.Equal(arrived, []string{"W-1", "W-2"}) {
				t.Errorf("writer W's messages first arrived as %v (all: %v); want them in the order W committed them, [W-1 W-2]",
					arrived, broker.uuids("invoices"))
			}
		})
	}
}

// Another relay instance's round holds the first row of a topic (its broker
// slow, its host cut off). This relay's round reads the topic's next row,
// on its last attempt, which the broker refuses; the row behind it is
// accepted, which is the evidence that sets the refused one aside, as it
// did before the walk looked below the row it found: the held row, which
// committed long before the batch's read, is not a late commit, yet the
// walk now ends on it, and the topic is held back behind the refused
// message for as long as the other instance holds its row.
func TestOutboxRelaySetsAsideARefusedMessageWhileAnotherRelayHoldsAnEarlierRowOfItsTopic(t *testing.T) {
	for _, tdb := range crashDBs(t, "postgres", "mysql") {
		t.Run(tdb.Name, func(t *testing.T) {
			t.Parallel()
			db := tdb.Open(t)
			broker := newBrokerStub()
			ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, BatchSize: 1, MaxAttempts: 1,
				PollInterval: time.Hour})
			commitOutputs(t, db, ob, "invoices", "held")
			commitOutputs(t, db, ob, "invoices", "refused")
			commitOutputs(t, db, ob, "invoices", "next")

			other, err := db.BeginTxx(context.Background(), &sql.TxOptions{Isolation: sql.LevelReadCommitted})
			if err != nil {
				t.Fatal(err)
			}
			defer other.Rollback() //nolint:errcheck
			var held []int64
			if err := other.Select(&held, "SELECT id FROM "+ob.Table()+" ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED"); err != nil || len(held) != 1 {
				t.Fatalf("hold the first row: %v, %v", held, err)
			}
			broker.setRefuse(refuseUUIDs(errors.New("refused by the broker"), "refused"))

			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			r := ob.RelayOnce(ctx)
			if r.DeadLettered != 1 || r.Relayed != 1 { // r.Err names the message set aside
				t.Errorf("round while another relay holds the topic's first row: relayed %d, set aside %d, error %v;"+
					" want the refused message set aside on the evidence of the next one, sent", r.Relayed, r.DeadLettered, r.Err)
			}
		})
	}
}
