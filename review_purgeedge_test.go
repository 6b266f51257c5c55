package inbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// Rows just inside the window stay, rows just past it go, with every batch
// size around the count, and with a consumer filter.
func TestReviewPurgeWindowEdges(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if tdb.Dialect == inbox.PostgreSQLPartitioned {
			t.Skip()
		}
		for _, bs := range []int{1, 2, 3, 7} {
			f := newFixture(t, db)
			f.newInbox(inbox.Config{})
			insertRows(t, db, tdb.Dialect, f.inbox, "billing", "in", 3, time.Hour-3*time.Second)
			insertRows(t, db, tdb.Dialect, f.inbox, "billing", "out", 7, time.Hour+3*time.Second)
			insertRows(t, db, tdb.Dialect, f.inbox, "other", "out", 5, 2*time.Hour)
			n, err := inbox.Purge(context.Background(), inbox.PurgeConfig{DB: db, Table: f.inbox, OlderThan: time.Hour, BatchSize: bs, Consumer: "billing"})
			if err != nil || n != 7 || count(t, db, f.inbox, "message_id LIKE 'in-%'") != 3 || count(t, db, f.inbox, "consumer = 'other'") != 5 {
				t.Errorf("batch %d: deleted %d (%v), left %d", bs, n, err, f.inboxRows())
			}
		}
	})
}
