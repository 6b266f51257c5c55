package inbox_test

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

func newPartitionedInbox(t *testing.T, db *sqlx.DB, table string, opts *sql.TxOptions) *inbox.Inbox {
	t.Helper()
	ib, err := inbox.New(inbox.Config{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table, Consumer: "billing", TxOptions: opts})
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	return ib
}

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
