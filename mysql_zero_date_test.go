package inbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A MySQL/MariaDB inbox table made by hand whose processed_at was added NOT
// NULL without a default (ALTER TABLE ... ADD COLUMN processed_at datetime(6)
// NOT NULL) holds the zero date in every row it had: it is refused before
// use, with a fix that gives those rows the current time, and a purge after
// it keeps them a whole window. Accepted, the next purge deleted them at
// once, rows processed a minute ago included.
func TestPurgeKeepsMySQLRowsWhoseProcessedAtIsTheZeroDate(t *testing.T) {
	t.Parallel()
	db := testdb.OpenMySQL(t, "")
	ctx := context.Background()
	table := "zerodate_" + randomSuffix()
	dropLater(t, db, table)
	exec(t, db, "CREATE TABLE "+table+" (consumer varbinary(255) NOT NULL, message_id varbinary(255) NOT NULL,"+
		" PRIMARY KEY (consumer, message_id)) ENGINE=InnoDB")
	exec(t, db, "INSERT INTO "+table+" VALUES ('billing', 'processed-a-minute-ago'), ('billing', 'processed-an-hour-ago')")
	// The operator's own migration, the way docs/schema.md says not to.
	exec(t, db, "ALTER TABLE "+table+" ADD COLUMN processed_at datetime(6) NOT NULL, ADD INDEX "+table+"_processed_at_idx (processed_at)")
	var zero int
	if err := db.GetContext(ctx, &zero, "SELECT COUNT(*) FROM "+table+" WHERE processed_at < '1000-01-01'"); err != nil || zero != 2 {
		t.Fatalf("%d zero-date rows (%v), want 2", zero, err)
	}

	ib, err := inbox.New(inbox.Config{DB: db, Table: table, Consumer: "billing"})
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.Verify(ctx); errors.Is(err, inbox.ErrIncompatibleTable) {
		// Refused before use, with a fix that keeps the rows a window.
		applyFixes(t, db, err)
		if err := ib.Verify(ctx); err != nil {
			t.Fatalf("Verify after the fix: %v", err)
		}
	} else if err != nil {
		t.Fatal(err)
	}
	deleted, err := inbox.Purge(ctx, inbox.PurgeConfig{DB: db, Table: table, OlderThan: 30 * 24 * time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if n := count(t, db, table, ""); n != 2 {
		t.Errorf("Verify accepted the table, then a purge with a window of 30 days deleted %d of its 2 rows (processed a"+
			" minute and an hour ago, their processed_at the zero date the ALTER gave them): %d left", deleted, n)
	}
}
