package inbox_test

// Partitioned inbox tables on PostgreSQL, and two deliveries of one
// message at once.

import (
	"context"
	"database/sql"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// partitionedTable creates an empty partitioned inbox table (no partitions).
func partitionedTable(t *testing.T, db *sqlx.DB) string {
	t.Helper()
	table := "inbox_" + randomSuffix()
	t.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + table + " CASCADE") })
	ddl, err := inbox.SchemaSQL(inbox.PostgreSQLPartitioned, table)
	if err != nil {
		t.Fatal(err)
	}
	for _, stmt := range statements(ddl) {
		exec(t, db, stmt)
	}
	return table
}

// dailyPartitionedTable creates a PostgreSQLPartitioned inbox table with
// daily partitions (InitializePartitions, PartitionDay), dropped when the
// test ends.
func dailyPartitionedTable(t *testing.T, db *sqlx.DB) string {
	t.Helper()
	return partitionedTableEvery(t, db, inbox.PartitionDay)
}

// partitionedTableEvery creates a PostgreSQLPartitioned inbox table with
// partitions of iv (InitializePartitions), dropped when the test ends.
func partitionedTableEvery(t *testing.T, db *sqlx.DB, iv inbox.PartitionInterval) string {
	t.Helper()
	table := "inbox_" + randomSuffix()
	t.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + table + " CASCADE") })
	if err := inbox.InitializePartitions(context.Background(), db, table, iv); err != nil {
		t.Fatal(err)
	}
	return table
}

func dbNow(t *testing.T, db *sqlx.DB) time.Time {
	t.Helper()
	var now time.Time
	if err := db.Get(&now, "SELECT now()"); err != nil {
		t.Fatal(err)
	}
	return now
}

// concurrentTwice delivers one message to two middlewares at once: the first
// claims and holds its transaction open until the second has had time to
// claim too. It returns how often the handler ran.
func concurrentTwice(t *testing.T, a, b *inbox.Inbox) int32 {
	t.Helper()
	var calls atomic.Int32
	entered, release := make(chan struct{}), make(chan struct{})
	var first atomic.Bool
	h := func(*message.Message) ([]*message.Message, error) {
		calls.Add(1)
		if first.CompareAndSwap(false, true) {
			close(entered)
			<-release
		}
		return nil, nil
	}
	msg := message.NewMessage(watermill.NewUUID(), nil)
	errA := make(chan error, 1)
	go func() { _, err := a.Middleware(h)(msg.Copy()); errA <- err }()
	<-entered
	errB := make(chan error, 1)
	go func() { _, err := b.Middleware(h)(msg.Copy()); errB <- err }()
	time.Sleep(500 * time.Millisecond)
	close(release)
	if err := <-errA; err != nil {
		t.Errorf("first delivery: %v", err)
	}
	if err := <-errB; err != nil {
		t.Logf("second delivery: %v", err)
	}
	return calls.Load()
}

// newPartitionedInbox returns an inbox on a new daily-partitioned table
// (the interval the tests that count partitions by day were written for).
func newPartitionedInbox(t *testing.T, db *sqlx.DB, table string, opts *sql.TxOptions) *inbox.Inbox {
	t.Helper()
	return newPartitionedInboxEvery(t, db, table, opts, inbox.PartitionDay)
}

// newPartitionedInboxEvery returns an inbox on a new table partitioned at
// interval iv, initialised as an application does: InitializePartitions,
// then InitializeSchema.
func newPartitionedInboxEvery(t *testing.T, db *sqlx.DB, table string, opts *sql.TxOptions, iv inbox.PartitionInterval) *inbox.Inbox {
	t.Helper()
	if err := inbox.InitializePartitions(context.Background(), db, table, iv); err != nil {
		t.Fatal(err)
	}
	ib, err := inbox.New(inbox.Config{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table, Consumer: "billing", TxOptions: opts})
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	return ib
}

// slotOf returns the range of the partition of interval iv that holds x,
// as the library lays them out: UTC days, or weeks from Monday 00:00 UTC.
func slotOf(iv inbox.PartitionInterval, x time.Time) (start, end time.Time) {
	start = x.UTC().Truncate(24 * time.Hour)
	if iv == inbox.PartitionWeek {
		start = start.AddDate(0, 0, -((int(start.Weekday()) + 6) % 7))
		return start, start.AddDate(0, 0, 7)
	}
	return start, start.AddDate(0, 0, 1)
}

// partitionOf returns the name of the partition of table of interval iv
// that starts at start.
func partitionOf(table string, iv inbox.PartitionInterval, start time.Time) string {
	letter := map[inbox.PartitionInterval]string{inbox.PartitionDay: "_p", inbox.PartitionWeek: "_w"}[iv]
	return table + letter + start.UTC().Format("20060102")
}

// partitionNames returns the names of table's partitions, oldest first.
func partitionNames(t *testing.T, db *sqlx.DB, table string) []string {
	t.Helper()
	var names []string
	if err := db.Select(&names, `SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
		WHERE i.inhparent = to_regclass($1) ORDER BY pg_get_expr(c.relpartbound, c.oid)`, table); err != nil {
		t.Fatal(err)
	}
	return names
}

// uncovered returns the days (noon UTC) from first to last days after
// today that no partition of table accepts, trying an insert for each in a
// transaction that is rolled back.
func uncovered(t *testing.T, db *sqlx.DB, table string, first, last int) []string {
	t.Helper()
	var gaps []string
	today := dbNow(t, db).UTC().Truncate(24 * time.Hour)
	for d := first; d <= last; d++ {
		at := today.AddDate(0, 0, d).Add(12 * time.Hour)
		tx, err := db.Beginx()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec("INSERT INTO "+table+" VALUES ('probe', 'probe', $1)", at); err != nil {
			gaps = append(gaps, at.Format("2006-01-02"))
		}
		tx.Rollback()
	}
	return gaps
}

// oldPartitionsForConsumers returns a daily-partitioned table with
// partitions for the three days before today, consumer "fast"'s row at noon
// three days ago (in the oldest of them, the first a round looks at: a
// DETACH of another would wait for an open claim too), that noon as SQL,
// and a Purger of consumer "fast" with a one-hour window. db keeps up to
// maxConns connections.
func oldPartitionsForConsumers(t *testing.T, maxConns int) (db *sqlx.DB, table, noon string, p *inbox.Purger) {
	t.Helper()
	db = testdb.OpenPostgres(t, "")
	db.SetMaxOpenConns(maxConns)
	table = dailyPartitionedTable(t, db)
	if err := inbox.CreatePartitions(context.Background(), db, table, dbNow(t, db).AddDate(0, 0, -3), 3); err != nil {
		t.Fatal(err)
	}
	noon = "date_trunc('day', now(), 'UTC') - interval '3 days' + interval '12 hours'"
	exec(t, db, "INSERT INTO "+table+" VALUES ('fast', 'f3', "+noon+")")
	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{
		DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table, OlderThan: time.Hour, Consumer: "fast",
	}})
	if err != nil {
		t.Fatal(err)
	}
	return db, table, noon, p
}

// waitForLockWaiter waits until a backend whose query is LIKE like waits
// on a lock; it fails the test after 30 s.
func waitForLockWaiter(t *testing.T, db *sqlx.DB, like string) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		var waiting int
		if err := db.Get(&waiting, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE $1", like); err != nil {
			t.Fatal(err)
		}
		if waiting > 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("no statement like %q waited on a lock", like)
		}
	}
}

// openSlowClaim begins consumer "slow"'s claim of id in table with
// processed_at noon (what a transaction begun in that old partition's range
// writes) and leaves it open: the test commits or rolls it back.
func openSlowClaim(t *testing.T, db *sqlx.DB, table, id, noon string) *sqlx.Tx {
	t.Helper()
	tx, err := db.BeginTxx(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tx.Rollback() }) //nolint:errcheck // no-op once ended
	if _, err := tx.Exec("INSERT INTO "+table+" VALUES ('slow', $1, "+noon+")", id); err != nil {
		t.Fatal(err)
	}
	return tx
}
