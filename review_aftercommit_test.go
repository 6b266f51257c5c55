package inbox_test

import (
	"context"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
)

// AfterCommit "reports whether ctx carries an inbox transaction (false: f
// was not registered)". A context captured by the handler (a goroutine, a
// callback that fires late) still carries the finished transaction's state:
// AfterCommit returns true, and f never runs, silently.
func TestReviewAfterCommitOnFinishedTxReportsRegistered(t *testing.T) {
	db := sqliteDB(t)
	f := newFixture(t, db)
	ib := f.newInbox(inbox.Config{Consumer: "billing"})
	var captured context.Context
	if _, err := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		captured = msg.Context()
		return nil, nil
	})(message.NewMessage(watermill.NewUUID(), nil)); err != nil {
		t.Fatal(err)
	}
	var ran atomic.Bool
	if ok := inbox.AfterCommit(captured, func() { ran.Store(true) }); ok && !ran.Load() {
		t.Errorf("AfterCommit after the transaction ended returned true, f never runs")
	}
	if tx, ok := inbox.TxFromContext(captured); ok {
		t.Logf("TxFromContext on the captured context still returns the finished tx: %v", tx.Commit())
	}
}
