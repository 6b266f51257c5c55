package inbox_test

import (
	"database/sql"
	"testing"

	"github.com/watermill-inbox/inbox/internal/testdb"
)

// Two instances of one service name the same table "inbox_x" and
// "public.inbox_x" (one from a config file, one from an env var). The key
// lock is a hash of the table name as written, so they do not exclude each
// other, and the NOT EXISTS cannot see the other's uncommitted row: the
// message is processed twice (the primary key includes processed_at).
func TestReviewPartitionedKeyLockDependsOnSpelling(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	table := "inbox_" + randomSuffix()
	t.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + table + " CASCADE") })
	a := newPartitionedInbox(t, db, table, nil)
	b := newPartitionedInbox(t, db, "public."+table, nil)
	if n := concurrentTwice(t, a, b); n != 1 {
		t.Errorf("handler ran %d times for one message (tables %q and %q), want 1; inbox rows: %d",
			n, table, "public."+table, count(t, db, table, ""))
	}
}

// PostgreSQLPartitioned "needs READ COMMITTED": New refuses other levels,
// and pins READ COMMITTED when TxOptions is nil, but not when TxOptions is
// set with Isolation LevelDefault: then the server's
// default_transaction_isolation decides. At REPEATABLE READ the snapshot is
// taken by the key-lock statement, before the lock is granted, so the
// NOT EXISTS misses the first claim: processed twice, no error.
func TestReviewPartitionedLevelDefaultFollowsServerDefault(t *testing.T) {
	db := testdb.OpenPostgres(t, "default_transaction_isolation=repeatable%20read")
	table := "inbox_" + randomSuffix()
	t.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + table + " CASCADE") })
	var level string
	if err := db.Get(&level, "SHOW default_transaction_isolation"); err != nil || level != "repeatable read" {
		t.Fatalf("session default %q, %v", level, err)
	}
	ib := newPartitionedInbox(t, db, table, &sql.TxOptions{}) // New accepts it
	if n := concurrentTwice(t, ib, ib); n != 1 {
		t.Errorf("handler ran %d times for one message, want 1; inbox rows: %d", n, count(t, db, table, ""))
	}
}
