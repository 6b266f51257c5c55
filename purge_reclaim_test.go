package inbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// TestPurgeKeepsAKeyClaimedAgainMidBatch: on MySQL a purge batch reads its
// keys, then deletes them by primary key. If, in between, another purge
// deleted one of those keys and a late redelivery claimed it afresh, the
// fresh row is young and must stay: deleting it would let a further
// redelivery process the message again.
func TestPurgeKeepsAKeyClaimedAgainMidBatch(t *testing.T) {
	t.Parallel()
	db := testdb.OpenMySQL(t, "")
	f := newFixture(t, db)
	f.newInbox(inbox.Config{Consumer: "billing"})
	insertRows(t, db, inbox.MySQL, f.inbox, "billing", "old", 3, 2*time.Hour)
	cfg := inbox.WithAfterPurgeSelect(inbox.PurgeConfig{DB: db, Table: f.inbox, OlderThan: time.Hour}, func() {
		// Another purge took old-1, then a redelivery claimed it again.
		exec(t, db, "DELETE FROM "+f.inbox+" WHERE consumer = 'billing' AND message_id = 'old-1'")
		exec(t, db, "INSERT INTO "+f.inbox+" (consumer, message_id, processed_at) VALUES ('billing', 'old-1', UTC_TIMESTAMP(6))")
	})
	n, err := inbox.Purge(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if n != 2 {
		t.Errorf("deleted %d rows, want 2 (old-2, old-3)", n)
	}
	if got := count(t, db, f.inbox, "message_id = 'old-1'"); got != 1 {
		t.Errorf("the key claimed again during the batch: %d rows, want 1 (kept)", got)
	}
}
