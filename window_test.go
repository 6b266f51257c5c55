package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
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

// outOfRangeWindows are safe windows no purge may trust: zero or negative
// (a source that wrapped), under 1µs, and beyond MaxSafeWindow (a source
// that saturated, or reports "forever" as a duration).
var outOfRangeWindows = []inbox.WindowSource{
	fixedWindow(-time.Hour),
	fixedWindow(math.MinInt64),
	fixedWindow(0),
	fixedWindow(time.Nanosecond),
	fixedWindow(inbox.MaxSafeWindow + time.Nanosecond),
	fixedWindow(math.MaxInt64),
	inbox.FixedWindow(inbox.MaxSafeWindow + time.Hour),
}

// A window source that reports a safe window out of range stops Purge,
// with or without an OlderThan of its own, and a Purger round, with an
// error wrapping ErrWindowOutOfRange, before anything is deleted. On every
// database.
func TestWindowOutOfRange_StopsPurgeAndPurgerRound(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		f := newFixture(t, db)
		f.newInbox(inbox.Config{})
		insertRows(t, db, tdb.Dialect, f.inbox, "billing", "old", 20, 2*time.Hour)
		for _, w := range outOfRangeWindows {
			for _, olderThan := range []time.Duration{0, time.Hour} {
				cfg := inbox.PurgeConfig{DB: db, Dialect: tdb.Dialect, Table: f.inbox, OlderThan: olderThan, Window: w}
				n, err := inbox.Purge(context.Background(), cfg)
				if !errors.Is(err, inbox.ErrWindowOutOfRange) || n != 0 || f.inboxRows() != 20 {
					t.Errorf("Purge, OlderThan %v, window %T(%v): deleted %d, %v, %d rows left; want ErrWindowOutOfRange and all 20 rows",
						olderThan, w, w, n, err, f.inboxRows())
				}
				p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: cfg})
				if err != nil {
					t.Fatal(err)
				}
				round := p.RunOnce(context.Background())
				if !errors.Is(round.Err, inbox.ErrWindowOutOfRange) || round.Deleted != 0 || f.inboxRows() != 20 {
					t.Errorf("Purger round, OlderThan %v, window %T(%v): %+v, %d rows left; want ErrWindowOutOfRange and all 20 rows",
						olderThan, w, w, round, f.inboxRows())
				}
			}
		}
		// The same rows go under a window in range: the refusals above were
		// the window's doing.
		n, err := inbox.Purge(context.Background(), inbox.PurgeConfig{DB: db, Dialect: tdb.Dialect, Table: f.inbox, Window: fixedWindow(time.Hour)})
		if err != nil || n != 20 {
			t.Errorf("Purge under a 1h window: deleted %d, %v; want the 20 rows", n, err)
		}
	})
}

// DropPartitions under a window source that reports a safe window out of
// range drops no partition and returns an error wrapping
// ErrWindowOutOfRange.
func TestWindowOutOfRange_StopsDropPartitions(t *testing.T) {
	t.Parallel()
	db := testdb.OpenPostgres(t, "")
	table := dailyPartitionedTable(t, db)
	ctx := context.Background()
	if err := inbox.CreatePartitions(ctx, db, table, dbNow(t, db).AddDate(0, 0, -9), 9); err != nil {
		t.Fatal(err)
	}
	for day := 1; day <= 9; day++ {
		exec(t, db, fmt.Sprintf("INSERT INTO %s VALUES ('billing', 'day%d', now() - interval '%d days')", table, day, day))
	}
	for _, w := range outOfRangeWindows {
		dropped, err := inbox.DropPartitions(ctx, db, table, 24*time.Hour, w)
		if !errors.Is(err, inbox.ErrWindowOutOfRange) || len(dropped) != 0 || count(t, db, table, "") != 9 {
			t.Errorf("window %T(%v): dropped %v, %v, %d rows left; want ErrWindowOutOfRange and all 9 rows",
				w, w, dropped, err, count(t, db, table, ""))
		}
	}
	// Under a window in range the old partitions go: the refusals above
	// were the window's doing.
	if dropped, err := inbox.DropPartitions(ctx, db, table, 24*time.Hour, fixedWindow(time.Hour)); err != nil || len(dropped) == 0 {
		t.Errorf("DropPartitions under a 1h window: dropped %v, %v; want the old partitions", dropped, err)
	}
}
