package inbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// The fix Verify prints for a hand-made PostgreSQL table whose processed_at
// is a timestamp without time zone keeps what its rows say, whoever runs
// it: the inbox wrote each row's time in its sessions' TimeZone, and the
// fix must read it back in that zone, not in the TimeZone of the operator's
// session (as the MySQL/MariaDB fix of a TIMESTAMP column does), or rows
// are purged hours early (or late).
func TestVerifyFixOfAPostgresTimestampKeepsTheRowsTimesWhoeverRunsIt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.OpenPostgres(t, "TimeZone=UTC") // the inbox's sessions
	table := "inbox_" + randomSuffix()
	dropLater(t, db, table)
	exec(t, db, "CREATE TABLE "+table+" (consumer text COLLATE \"C\" NOT NULL, message_id text COLLATE \"C\" NOT NULL,"+
		" processed_at timestamp NOT NULL DEFAULT now(), fingerprint bytea, PRIMARY KEY (consumer, message_id))")
	exec(t, db, "CREATE INDEX "+table+"_processed_at_idx ON "+table+" (processed_at)")
	exec(t, db, "INSERT INTO "+table+" (consumer, message_id, processed_at) VALUES"+
		" ('billing', 'recent', now() - interval '238 hours'), ('billing', 'old', now() - interval '242 hours')")

	ib := verifyInbox(t, db, inbox.PostgreSQL, table)
	verr := ib.Verify(ctx)
	if !errors.Is(verr, inbox.ErrIncompatibleTable) {
		t.Fatalf("Verify of a timestamp processed_at: %v, want ErrIncompatibleTable", verr)
	}
	// The operator's session, five hours east of UTC.
	applyFixes(t, testdb.OpenPostgres(t, "TimeZone=Asia/Karachi"), verr)
	if err := ib.Verify(ctx); err != nil {
		t.Fatalf("Verify after the printed fixes: %v", err)
	}
	deleted, err := inbox.Purge(ctx, inbox.PurgeConfig{DB: db, Dialect: inbox.PostgreSQL, Table: table, OlderThan: 240 * time.Hour})
	if err != nil || deleted != 1 {
		var ages []string
		_ = db.Select(&ages, "SELECT message_id || ' ' || (now() - processed_at)::text FROM "+table)
		t.Errorf("purge of rows older than 240h after the fix, of rows processed 238h and 242h before: deleted %d, %v; want 1 (left: %v)\nerror was:\n%v",
			deleted, err, ages, verr)
	}
}
