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
