package inbox_test

import (
	"context"
	"fmt"
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
