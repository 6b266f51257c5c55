package inbox_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// A relay round stopped at any moment (a router's shutdown while another
// round of the same Outbox waits for its turn: two routers sharing one
// Outbox, a RelayOnce that drains at shutdown) ends its transaction before
// the next round starts, so that round does not send a transaction's
// second message before its first. Cut mid-statement, the round's
// transaction was rolled back by database/sql on a goroutine of its own and
// its connection dropped: the round handed its turn over while the server
// still held its row locks, and the next round's SKIP LOCKED read skipped
// the first message and sent the second (6–11 of 400 transactions on
// PostgreSQL, 1–5 on MariaDB).
func TestOutboxRoundStoppedAtAnyMomentKeepsATransactionsOrderForTheNextRound(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if tdb.Dialect == inbox.SQLite {
			t.Skip("no row locks: the relay reads without locking")
		}
		broker := newBrokerStub()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, BatchSize: 1})
		const transactions = 400
		reordered := 0
		for i := range transactions {
			tx, pub := beginOutbox(t, db, ob)
			first := message.NewMessage(fmt.Sprintf("tx-%d-first", i), nil)
			second := message.NewMessage(fmt.Sprintf("tx-%d-second", i), nil)
			if err := pub.Publish("orders", first, second); err != nil {
				t.Fatal(err)
			}
			if err := tx.Commit(); err != nil {
				t.Fatal(err)
			}
			ctx, stop := context.WithCancel(context.Background())
			stopped, waiting := make(chan struct{}), make(chan struct{})
			go func() { defer close(stopped); ob.RelayOnce(ctx) }()
			time.Sleep(time.Duration(rand.IntN(1500)) * time.Microsecond)
			go func() { defer close(waiting); ob.RelayOnce(context.Background()) }()
			time.Sleep(50 * time.Microsecond)
			stop()
			<-stopped
			<-waiting
			relayUntilNothingPending(t, ob)
			sentAt := map[string]int{}
			for j, m := range broker.messages("orders") {
				if _, ok := sentAt[m.UUID]; !ok {
					sentAt[m.UUID] = j
				}
			}
			if sentAt[second.UUID] < sentAt[first.UUID] {
				if reordered++; reordered <= 3 {
					t.Errorf("%s first sent before %s, which the same transaction wrote first", second.UUID, first.UUID)
				}
			}
		}
		if reordered > 0 {
			t.Errorf("%d of %d transactions had their messages sent out of order", reordered, transactions)
		}
	})
}
