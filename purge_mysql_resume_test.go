package inbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A MySQL/MariaDB purge's batches after the first read from where the one
// before ended (BenchmarkPurgeBehindOpenSnapshot: from the oldest entry,
// each batch stepped over every row the round had deleted while a snapshot
// was open). Expired rows that appear below that point during the purge (a
// claim committed late) are still deleted by it, as are the rows of every
// processed_at instant a batch ended in, and a consumer's purge still
// deletes only that consumer's rows.
func TestMySQLPurgeDeletesExpiredRowsBelowWhereItsBatchesGot(t *testing.T) {
	t.Parallel()
	db := testdb.OpenMySQL(t, "")
	f := newFixture(t, db)
	f.newInbox(inbox.Config{Consumer: "billing"})
	for i := range 30 { // ten rows at each of 30 instants, 4 days to 3 days ago
		insertRows(t, db, inbox.MySQL, f.inbox, "billing", fmt.Sprintf("m%d", i), 10, 4*24*time.Hour-time.Duration(i)*time.Hour)
	}
	insertRows(t, db, inbox.MySQL, f.inbox, "shipping", "s", 120, 4*24*time.Hour)
	insertRows(t, db, inbox.MySQL, f.inbox, "billing", "young", 5, time.Minute)
	batches := 0
	cfg := inbox.WithAfterPurgeSelect(inbox.PurgeConfig{DB: db, Table: f.inbox, Consumer: "billing", OlderThan: 24 * time.Hour,
		BatchSize: 25, DutyCycle: 1}, func() {
		batches++
		if batches == 3 {
			// A claim of 5 days ago commits now, below the batches' bound.
			insertRows(t, db, inbox.MySQL, f.inbox, "billing", "late", 4, 5*24*time.Hour)
		}
	})
	n, err := inbox.Purge(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if n != 304 {
		t.Errorf("purge deleted %d rows, want 304 (300 expired, 4 of them committed during the purge)", n)
	}
	if left := count(t, db, f.inbox, "consumer = 'billing' AND message_id NOT LIKE 'young-%'"); left != 0 {
		t.Errorf("%d expired rows of billing left", left)
	}
	if kept := count(t, db, f.inbox, "consumer = 'shipping' OR message_id LIKE 'young-%'"); kept != 125 {
		t.Errorf("%d rows of shipping and young rows of billing kept, want 125", kept)
	}
}
