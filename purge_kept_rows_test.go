package inbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// plainTableKeepingHeldRows creates a plain PostgreSQL inbox table whose
// DELETE keeps the rows whose message id starts with "held" (a BEFORE
// DELETE trigger that returns NULL for them: a legal hold), dropped when
// the test ends.
func plainTableKeepingHeldRows(t *testing.T, db *sqlx.DB) string {
	t.Helper()
	table := "inbox_" + randomSuffix()
	hold := table + "_hold"
	t.Cleanup(func() {
		db.Exec("DROP TABLE IF EXISTS " + table)
		db.Exec("DROP FUNCTION IF EXISTS " + hold + "()")
	})
	ddl, err := inbox.SchemaSQL(inbox.PostgreSQL, table)
	if err != nil {
		t.Fatal(err)
	}
	for _, stmt := range statements(ddl) {
		exec(t, db, stmt)
	}
	exec(t, db, "CREATE FUNCTION "+hold+"() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN IF OLD.message_id LIKE 'held%' THEN RETURN NULL; END IF; RETURN OLD; END$$")
	exec(t, db, "CREATE TRIGGER "+hold+" BEFORE DELETE ON "+table+" FOR EACH ROW EXECUTE FUNCTION "+hold+"()")
	return table
}

// Expired rows that a plain table's DELETE keeps (a trigger, a row
// security policy), a batch or more of them among the oldest, end the
// purge instead of keeping it going for ever: each batch chose them again
// from the oldest row, deleted none, and the count of the rows left found
// a full batch again, so a Purger's round never ended and held the purge
// lock for good. Fewer kept rows than a batch do not stop it: the rows it
// can delete go.
func TestPurgeEndsBesideRowsItsDeleteKeeps(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	for _, c := range []struct {
		name      string
		batchSize int
		deleted   int64
	}{
		{"a batch or more kept", 10, 0},
		{"fewer kept than a batch", 100, 50},
	} {
		t.Run(c.name, func(t *testing.T) {
			table := plainTableKeepingHeldRows(t, db)
			insertRows(t, db, inbox.PostgreSQL, table, "billing", "held", 20, 3*24*time.Hour)
			insertRows(t, db, inbox.PostgreSQL, table, "billing", "m", 50, 2*24*time.Hour)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			n, err := inbox.Purge(ctx, inbox.PurgeConfig{DB: db, Table: table, OlderThan: 24 * time.Hour, BatchSize: c.batchSize, DutyCycle: 1})
			if err != nil || n != c.deleted {
				t.Errorf("purge beside 20 kept rows, BatchSize %d: deleted %d, err %v; want %d, nil (ended)", c.batchSize, n, err, c.deleted)
			}
			if held := count(t, db, table, "message_id LIKE 'held%'"); held != 20 {
				t.Errorf("%d kept rows left, want 20", held)
			}
		})
	}
}
