package inbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/watermill-inbox/inbox"
)

// OlderThan must be >= 1µs, but a Window's answer is used unchecked: a
// source that reports 0 (or a negative value, e.g. an unset/-1 setting
// converted to a duration) makes the purge delete every row, including
// messages processed a moment ago, which the broker can certainly still
// redeliver.
func TestReviewWindowSourceZeroPurgesEverything(t *testing.T) {
	for _, w := range []time.Duration{0, -time.Millisecond} {
		db := sqliteDB(t)
		f := newFixture(t, db)
		f.newInbox(inbox.Config{})
		insertRows(t, db, inbox.SQLite, f.inbox, "billing", "fresh", 10, 0)
		n, err := inbox.Purge(context.Background(), inbox.PurgeConfig{DB: db, Table: f.inbox, Window: fixedWindow(w)})
		if err == nil || n != 0 {
			t.Errorf("safe window %v: deleted %d rows processed just now (err %v); want an error and nothing deleted", w, n, err)
		}
	}
}
