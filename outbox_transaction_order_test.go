package inbox_test

import (
	"context"
	"database/sql"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// One transaction's messages to a topic leave in the order it wrote them
// while other transactions commit around them, with one relay and nothing
// crashing. On MariaDB the relay's locking read checked each row's lock as
// its scan reached it: a transaction that committed during the scan had its
// first message skipped (still locked then) and its second read, and the
// second was sent a round before the first (7 in 3,000 transactions).
func TestOutboxRelaySendsOneTransactionsMessagesInTheOrderItWroteThem(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if tdb.Dialect == inbox.SQLite {
			t.Skip("one writer at a time: no transaction commits during a read")
		}
		broker := newBrokerStub()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, PollInterval: time.Millisecond})
		ctx, cancel := context.WithCancel(context.Background())
		relayed := make(chan struct{})
		go func() { defer close(relayed); _ = ob.Run(ctx) }()
		defer func() { cancel(); <-relayed }()
		var stop atomic.Bool
		var wg sync.WaitGroup
		for w := range 3 { // other transactions, whose rows come between a transaction's two
			wg.Go(func() {
				for i := 0; !stop.Load(); i++ {
					tx, pub := beginOutbox(t, db, ob)
					var msgs []*message.Message
					for j := range 20 {
						msgs = append(msgs, message.NewMessage(fmt.Sprintf("filler-%d-%d-%d", w, i, j), nil))
					}
					if pub.Publish("filler", msgs...) != nil || tx.Commit() != nil {
						return
					}
				}
			})
		}
		var txs atomic.Int64
		for w := range 3 {
			wg.Go(func() {
				for i := 0; !stop.Load(); i++ {
					tx, pub := beginOutbox(t, db, ob)
					id := fmt.Sprintf("order-%d-%d", w, i)
					if pub.Publish("orders", message.NewMessage(id+"-created", nil)) != nil {
						return
					}
					time.Sleep(time.Millisecond)
					if pub.Publish("orders", message.NewMessage(id+"-updated", nil)) != nil || tx.Commit() != nil {
						return
					}
					txs.Add(1)
				}
			})
		}
		time.Sleep(3 * time.Second)
		stop.Store(true)
		wg.Wait()
		waitFor(t, func() bool { st, err := ob.Stats(ctx); return err == nil && st.Pending == 0 })
		sent := map[string]int{}
		for i, u := range broker.uuids("orders") {
			sent[u] = i
		}
		reordered := 0
		for u, at := range sent {
			if order, ok := strings.CutSuffix(u, "-created"); ok {
				if later, ok := sent[order+"-updated"]; ok && later < at {
					if reordered++; reordered <= 3 {
						t.Errorf("%s sent after %s-updated, which its transaction wrote after it", u, order)
					}
				}
			}
		}
		t.Logf("%d transactions, %d sent out of the order they wrote", txs.Load(), reordered)
	})
}

// The same with rows another transaction holds between a transaction's two
// messages (another relay's batch, a handler's large uncommitted write) and
// rows committed behind them: the transaction commits while the relay's
// round reads. A second locking read up to the batch's last id had the
// first one's race: the first message still locked when its scan passed
// it, the second free when it reached it, and the second sent a round
// before the first (8 to 18 of 40 transactions).
func TestOutboxRelayKeepsOneTransactionsOrderWhileRowsBetweenItsMessagesAreHeld(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if tdb.Dialect != inbox.MySQL {
			t.Skip("MySQL/MariaDB's locking reads; PostgreSQL's read from the statement's snapshot")
		}
		broker := newBrokerStub()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, PollInterval: time.Millisecond})
		table := relayTable(t, ob)
		stopRelay := runRelay(ob)
		defer stopRelay()
		var stop atomic.Bool
		var wg sync.WaitGroup
		defer func() { stop.Store(true); wg.Wait() }()
		wg.Go(func() { // rows keep coming behind: each round's batch ends past the transaction's rows
			for i := 0; !stop.Load(); i++ {
				tx, pub := beginOutbox(t, db, ob)
				if pub.Publish("filler", message.NewMessage(fmt.Sprintf("filler-%d", i), nil)) != nil || tx.Commit() != nil {
					_ = tx.Rollback()
					return
				}
				time.Sleep(time.Millisecond)
			}
		})
		ctx := context.Background()
		reordered := 0
		for i := range 20 {
			tx, pub := beginOutbox(t, db, ob)
			created, updated := fmt.Sprintf("order-%d-created", i), fmt.Sprintf("order-%d-updated", i)
			if err := pub.Publish("orders", message.NewMessage(created, nil)); err != nil {
				t.Fatal(err)
			}
			holder, err := db.BeginTxx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := holder.Exec("INSERT INTO " + table + " (topic, uuid, payload, metadata, created_at)" +
				" SELECT 'held', CONCAT('held-', seq), x'', '{}', UTC_TIMESTAMP(6) FROM seq_1_to_20000"); err != nil {
				t.Fatal(err)
			}
			if err := pub.Publish("orders", message.NewMessage(updated, nil)); err != nil {
				t.Fatal(err)
			}
			time.Sleep(time.Duration(rand.IntN(40)) * time.Millisecond)
			if err := tx.Commit(); err != nil {
				t.Fatal(err)
			}
			for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(time.Millisecond) {
				sent := broker.uuids("orders")
				c, u := slices.Index(sent, created), slices.Index(sent, updated)
				if c >= 0 && u >= 0 {
					if u < c {
						if reordered++; reordered <= 3 {
							t.Errorf("%s sent before %s, which its transaction wrote first", updated, created)
						}
					}
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("%s and %s not both sent in 30 s", created, updated)
				}
			}
			_ = holder.Rollback()
		}
		t.Logf("%d of 20 transactions sent out of the order they wrote", reordered)
	})
}
