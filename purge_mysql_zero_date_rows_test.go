package inbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A MySQL/MariaDB table whose processed_at was added NOT NULL without a
// default holds the zero date in its old rows. The purge's batches read
// each row's processed_at in microseconds since the epoch (TIMESTAMPDIFF),
// to start the next batch where the last one ended, which is NULL for the
// zero date: a first version failed to scan it, and every run of the purge
// failed with an error naming neither the table nor the fix, the expired
// rows behind it never deleted. They are deleted.
func TestMySQLPurgeOfTableWithZeroDateRowsDeletesItsExpiredRowsOrRefusesTheTable(t *testing.T) {
	t.Parallel()
	db := testdb.OpenMySQL(t, "")
	ctx := context.Background()
	table := "zero_date_" + randomSuffix()
	dropLater(t, db, table)
	exec(t, db, "CREATE TABLE "+table+" (consumer varbinary(255) NOT NULL, message_id varbinary(255) NOT NULL,"+
		" PRIMARY KEY (consumer, message_id)) ENGINE=InnoDB")
	exec(t, db, "INSERT INTO "+table+" VALUES ('billing', 'before-the-migration')")
	// The operator's own migration, the way docs/schema.md says not to.
	exec(t, db, "ALTER TABLE "+table+" ADD COLUMN processed_at datetime(6) NOT NULL, ADD INDEX "+table+"_processed_at_idx (processed_at)")
	insertRows(t, db, inbox.MySQL, table, "billing", "expired", 10, 40*24*time.Hour)

	deleted, err := inbox.Purge(ctx, inbox.PurgeConfig{DB: db, Table: table, OlderThan: 30 * 24 * time.Hour})
	if err != nil && !errors.Is(err, inbox.ErrIncompatibleTable) {
		t.Errorf("purge of a table holding a zero-date row: %v (%d deleted); the %d expired rows stay, on every run",
			err, deleted, count(t, db, table, "message_id LIKE 'expired-%'"))
	}
	if left := count(t, db, table, "message_id LIKE 'expired-%'"); err == nil && left != 0 {
		t.Errorf("purge of a table holding a zero-date row deleted %d rows and left %d of the 10 expired ones", deleted, left)
	}
}

// MariaDB's default sql_mode (STRICT_TRANS_TABLES, without NO_ZERO_IN_DATE)
// stores a date with a zero day or month ('2020-05-00', a legacy import,
// a hand-made fixture). Verify accepts the table (its zero-date check looks
// below '1000-01-01' only); a first version of the purge that starts each
// batch where the last ended failed on the batch that read that row
// (TIMESTAMPDIFF gives NULL): no expired row of the table was purged again,
// and the Purger failed every round. The row is deleted like any expired
// row.
func TestMySQLPurgeOfVerifiedTableWithZeroDayRowDeletesItsExpiredRows(t *testing.T) {
	t.Parallel()
	db := testdb.OpenMySQL(t, "")
	ctx := context.Background()
	table := "zero_day_" + randomSuffix()
	dropLater(t, db, table)
	ib, err := inbox.New(inbox.Config{DB: db, Table: table, Consumer: "billing"})
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.InitializeSchema(ctx); err != nil {
		t.Fatal(err)
	}
	exec(t, db, "INSERT INTO "+table+" (consumer, message_id, processed_at) VALUES ('billing', 'imported', '2020-05-00 12:00:00')")
	insertRows(t, db, inbox.MySQL, table, "billing", "expired", 10, 40*24*time.Hour)
	insertRows(t, db, inbox.MySQL, table, "billing", "young", 3, time.Minute)
	if err := ib.Verify(ctx); err != nil {
		t.Fatalf("Verify: %v", err)
	}
	deleted, err := inbox.Purge(ctx, inbox.PurgeConfig{DB: db, Table: table, OlderThan: 30 * 24 * time.Hour})
	if err != nil {
		t.Errorf("purge of a table Verify accepted: %v (%d deleted); %d expired rows stay, on every run",
			err, deleted, count(t, db, table, "message_id LIKE 'expired-%'"))
	}
	if left := count(t, db, table, "message_id LIKE 'expired-%' OR message_id = 'imported'"); left != 0 {
		t.Errorf("purge deleted %d rows and left %d of the 11 expired ones", deleted, left)
	}
	if n := count(t, db, table, "message_id LIKE 'young-%'"); n != 3 {
		t.Errorf("%d young rows left, want 3", n)
	}
}
