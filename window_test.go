package inbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/watermill-inbox/inbox"
)

// A FixedWindow refuses a purge shorter than itself, deleting nothing, and
// is the window of a purge with a zero OlderThan: rows older than it go,
// younger rows stay.
func TestFixedWindow_BoundsThePurge(t *testing.T) {
	t.Parallel()
	db := sqliteDB(t)
	f := newFixture(t, db)
	f.newInbox(inbox.Config{})
	insertRows(t, db, inbox.SQLite, f.inbox, "billing", "old", 15, 4*time.Hour)
	insertRows(t, db, inbox.SQLite, f.inbox, "billing", "recent", 10, 2*time.Hour)
	cfg := inbox.PurgeConfig{DB: db, Table: f.inbox, OlderThan: time.Hour, Window: inbox.FixedWindow(3 * time.Hour)}
	n, err := inbox.Purge(context.Background(), cfg)
	if !errors.Is(err, inbox.ErrWindowTooShort) || n != 0 || f.inboxRows() != 25 {
		t.Fatalf("1h under a 3h FixedWindow: deleted %d, %v, %d rows left; want ErrWindowTooShort and all 25 rows", n, err, f.inboxRows())
	}
	cfg.OlderThan = 0
	if n, err := inbox.Purge(context.Background(), cfg); err != nil || n != 15 || f.inboxRows() != 10 {
		t.Errorf("OlderThan 0 under a 3h FixedWindow: deleted %d, %v, %d rows left; want the 15 rows older than 3h deleted", n, err, f.inboxRows())
	}
}

// A FixedWindow of zero or less (an unset setting) stops the purge with
// ErrInvalidConfig and deletes nothing, even with an OlderThan of its own.
func TestFixedWindow_NonPositiveStopsThePurge(t *testing.T) {
	t.Parallel()
	for _, w := range []time.Duration{0, -time.Hour} {
		db := sqliteDB(t)
		f := newFixture(t, db)
		f.newInbox(inbox.Config{})
		insertRows(t, db, inbox.SQLite, f.inbox, "billing", "old", 5, 4*time.Hour)
		n, err := inbox.Purge(context.Background(), inbox.PurgeConfig{DB: db, Table: f.inbox, OlderThan: time.Hour, Window: inbox.FixedWindow(w)})
		if !errors.Is(err, inbox.ErrInvalidConfig) || n != 0 || f.inboxRows() != 5 {
			t.Errorf("FixedWindow(%v): deleted %d, %v, %d rows left; want ErrInvalidConfig and nothing deleted", w, n, err, f.inboxRows())
		}
	}
}
