package inbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/watermill-inbox/inbox"
)

// A hand-made SQLite inbox table whose processed_at is declared INTEGER but
// holds Unix time in another unit than microseconds (seconds, as SQLite's
// unixepoch() gives; milliseconds, as Date.now() gives) is refused before
// use, with a fix that converts the values, and a purge after it keeps the
// rows processed a minute ago: taken for microseconds, they were rows of
// 1970, and a purge deleted them inside their window.
func TestPurgeKeepsRecentRowsOfAnSQLiteIntegerColumnInAnotherUnit(t *testing.T) {
	t.Parallel()
	db := sqliteDB(t)
	ctx := context.Background()
	table := "units_" + randomSuffix()
	exec(t, db, "CREATE TABLE "+table+" (consumer TEXT NOT NULL, message_id TEXT NOT NULL,"+
		" processed_at INTEGER NOT NULL, PRIMARY KEY (consumer, message_id))")
	exec(t, db, "CREATE INDEX "+table+"_processed_at_idx ON "+table+" (processed_at)")
	minuteAgo := time.Now().Add(-time.Minute)
	exec(t, db, "INSERT INTO "+table+" VALUES ('billing', 'seconds', ?), ('billing', 'millis', ?)",
		minuteAgo.Unix(), minuteAgo.UnixMilli())

	ib, err := inbox.New(inbox.Config{DB: db, Table: table, Consumer: "billing"})
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.Verify(ctx); errors.Is(err, inbox.ErrIncompatibleTable) {
		// Refused before use, with a fix that converts the values.
		applyFixes(t, db, err)
		if err := ib.Verify(ctx); err != nil {
			t.Fatalf("Verify after the fix: %v", err)
		}
		var lo int64
		if err := db.Get(&lo, "SELECT min(processed_at) FROM "+table); err != nil || time.Since(time.UnixMicro(lo)) > time.Hour {
			t.Fatalf("after the fix the oldest processed_at is %v (%v); want a minute ago", time.UnixMicro(lo), err)
		}
	} else if err != nil {
		t.Fatal(err)
	}
	deleted, err := inbox.Purge(ctx, inbox.PurgeConfig{DB: db, Table: table, OlderThan: 24 * time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if n := count(t, db, table, ""); n != 2 {
		t.Errorf("Verify accepted the table, then a purge with a window of a day deleted %d row(s) processed a minute ago"+
			" (%d left of 2): rows inside the window, whose redeliveries are then processed again", deleted, n)
	}
}
