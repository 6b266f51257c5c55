package inbox_test

// Helpers of the outbox relay's tests that run on every platform.

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// newNamedTestOutbox returns an Outbox on a table of its own, created, with
// cfg's other fields, and the table's name (unquoted, for another Outbox or
// process on the same table).
func newNamedTestOutbox(t *testing.T, db *sqlx.DB, d inbox.Dialect, cfg inbox.OutboxConfig) (*inbox.Outbox, string) {
	t.Helper()
	table := "outbox_" + randomSuffix()
	dropLater(t, db, table)
	dropLater(t, db, table+"_dead")
	cfg.DB, cfg.Dialect, cfg.Table = db, d, table
	ob, err := inbox.NewOutbox(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	return ob, table
}

// assertOutboxEmpty fails the test unless ob's table and its dead-letter
// table are empty.
func assertOutboxEmpty(t *testing.T, ob *inbox.Outbox) {
	t.Helper()
	stats, err := ob.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if stats.Pending != 0 || stats.DeadLettered != 0 {
		t.Errorf("outbox after the relay: %d messages pending, %d set aside; want none", stats.Pending, stats.DeadLettered)
	}
}

// messages returns the messages b accepted on topic, in order.
func (b *brokerStub) messages(topic string) []*message.Message {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]*message.Message(nil), b.accepted[topic]...)
}

// relayUntilNothingPending runs relay rounds of ob until its table is empty,
// for up to 30 s: unlike relayUntilEmpty it does not stop at a round that
// found nothing, which rows still locked by a relay being stopped (its
// rollback in flight) give.
func relayUntilNothingPending(t *testing.T, ob *inbox.Outbox) {
	t.Helper()
	waitFor(t, func() bool {
		ob.RelayOnce(context.Background())
		stats, err := ob.Stats(context.Background())
		return err == nil && stats.Pending == 0
	})
}
