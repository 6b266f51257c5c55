package metrics_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/watermill-inbox/inbox"
)

// transactionsObserved is the number of observations of
// inbox_transaction_seconds in reg, and their sum in seconds.
func transactionsObserved(t *testing.T, reg *prometheus.Registry) (n uint64, sum float64) {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "inbox_transaction_seconds" {
			for _, m := range mf.Metric {
				n += m.GetHistogram().GetSampleCount()
				sum += m.GetHistogram().GetSampleSum()
			}
		}
	}
	return n, sum
}

// inbox_transaction_seconds (Event.Duration) observes transactions, from
// BEGIN to the end of COMMIT or ROLLBACK: deliveries that never began one
// (the table not yet created) are counted as failed but not observed. They
// were, with the inbox's wait before their redelivery (up to 5 s each) as
// their duration, so the mean transaction time by outcome showed seconds.
func TestTransactionSecondsObservesOnlyTransactions(t *testing.T) {
	reg, _, ib, _ := sqliteInbox(t, inbox.Config{}, false)
	deliver := routeThroughInbox(t, ib)
	for range 3 {
		deliver(message.NewMessage(watermill.NewUUID(), []byte("order")))
	}
	// The outcome is counted right after the nack.
	for deadline := time.Now().Add(5 * time.Second); counterSum(t, reg, "inbox_messages_total") < 3 && time.Now().Before(deadline); {
		time.Sleep(5 * time.Millisecond)
	}
	if n, sum := transactionsObserved(t, reg); n != 0 {
		t.Errorf("inbox_transaction_seconds observed %d deliveries (%.2f s) that never ran BEGIN", n, sum)
	}
	if got := counterSum(t, reg, "inbox_messages_total"); got != 3 {
		t.Errorf("inbox_messages_total = %v, want the 3 failed deliveries", got)
	}
	if err := ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	deliver(message.NewMessage(watermill.NewUUID(), []byte("order")))
	for deadline := time.Now().Add(5 * time.Second); counterSum(t, reg, "inbox_messages_total") < 4 && time.Now().Before(deadline); {
		time.Sleep(5 * time.Millisecond)
	}
	if n, sum := transactionsObserved(t, reg); n != 1 || sum <= 0 || sum > 5 {
		t.Errorf("inbox_transaction_seconds: %d observations, %.3f s; want the processed message's transaction", n, sum)
	}
}

// inbox_transaction_seconds starts at BEGIN, after Config.Fingerprint ran:
// a fingerprint function that takes its time (a payload decoded to leave out
// a volatile field) is not the transaction's, and holds no connection.
func TestTransactionSecondsLeavesOutTheFingerprintFunction(t *testing.T) {
	const slow = 1500 * time.Millisecond
	reg, _, ib, _ := sqliteInbox(t, inbox.Config{Fingerprint: func(msg *message.Message) []byte {
		time.Sleep(slow)
		return msg.Payload
	}}, true)
	routeThroughInbox(t, ib)(message.NewMessage(watermill.NewUUID(), []byte("order")))
	for deadline := time.Now().Add(5 * time.Second); counterSum(t, reg, "inbox_messages_total") < 1 && time.Now().Before(deadline); {
		time.Sleep(5 * time.Millisecond)
	}
	if n, sum := transactionsObserved(t, reg); n != 1 || sum >= slow.Seconds() {
		t.Errorf("inbox_transaction_seconds: %d observations, %.3f s; want one, without the fingerprint function's %v", n, sum, slow)
	}
}
