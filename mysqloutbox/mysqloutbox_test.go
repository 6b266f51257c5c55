package mysqloutbox_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/mysqloutbox"
)

// newLock returns a Lock on a lock table of the test's own, initialised.
func newLock(t testing.TB, db *sql.DB) *mysqloutbox.Lock {
	t.Helper()
	table := "outbox_lock_" + testdb.RandomSuffix()
	dropLater(t, db, table)
	lock, err := mysqloutbox.NewLock(mysqloutbox.Config{LockTable: table})
	if err != nil {
		t.Fatal(err)
	}
	if err := lock.InitializeSchema(context.Background(), db); err != nil {
		t.Fatal(err)
	}
	return lock
}

func dropLater(t testing.TB, db *sql.DB, table string) {
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := db.ExecContext(ctx, "DROP TABLE IF EXISTS `"+table+"`"); err != nil {
			t.Logf("drop %s: %v", table, err)
		}
	})
}

// countingPublisher counts the messages published through it.
type countingPublisher struct {
	mu sync.Mutex
	n  int
}

func (p *countingPublisher) Publish(_ string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.n += len(msgs)
	return nil
}

func (p *countingPublisher) Close() error { return nil }

// An invalid Config fails in NewLock with inbox.ErrInvalidConfig, and a bad
// table name also with inbox.ErrInvalidTableName.
func TestNewLockRejectsInvalidConfig(t *testing.T) {
	t.Parallel()
	for _, cfg := range []mysqloutbox.Config{
		{LockTable: "lock`; DROP TABLE x"},
		{LockTable: "a.b.c"},
		{Slots: -1},
		{Slots: 2},
	} {
		_, err := mysqloutbox.NewLock(cfg)
		if !errors.Is(err, inbox.ErrInvalidConfig) {
			t.Errorf("%+v: err = %v, want ErrInvalidConfig", cfg, err)
		}
		if cfg.LockTable != "" && !errors.Is(err, inbox.ErrInvalidTableName) {
			t.Errorf("%+v: err = %v, want ErrInvalidTableName", cfg, err)
		}
	}
	lock, err := mysqloutbox.NewLock(mysqloutbox.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if got := lock.SchemaSQL()[0]; got != "CREATE TABLE IF NOT EXISTS `watermill_outbox_lock` (slot INT NOT NULL PRIMARY KEY) ENGINE=InnoDB" {
		t.Errorf("default DDL = %q", got)
	}
}

// InitializeSchema is idempotent and safe to run concurrently; a Publish on
// a lock table without its rows fails with ErrNotInitialized and does not
// reach the wrapped publisher.
func TestInitializeSchemaAndMissingRows(t *testing.T) {
	t.Parallel()
	db := testdb.OpenMySQL(t, "").DB
	table := "outbox_lock_" + testdb.RandomSuffix()
	dropLater(t, db, table)
	lock, err := mysqloutbox.NewLock(mysqloutbox.Config{LockTable: table})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			if err := lock.InitializeSchema(context.Background(), db); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	var rows int
	if err := db.QueryRow("SELECT COUNT(*) FROM `" + table + "`").Scan(&rows); err != nil {
		t.Fatal(err)
	}
	if rows != 1 {
		t.Fatalf("lock rows = %d, want 1", rows)
	}

	if _, err := db.Exec("DELETE FROM `" + table + "`"); err != nil {
		t.Fatal(err)
	}
	tx, err := db.Begin()
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback() //nolint:errcheck // the test only reads
	next := &countingPublisher{}
	err = lock.Publisher(tx, next).Publish("orders", message.NewMessage(watermill.NewUUID(), nil))
	if !errors.Is(err, mysqloutbox.ErrNotInitialized) || next.n != 0 {
		t.Errorf("Publish without lock rows: err = %v, published %d; want ErrNotInitialized, 0", err, next.n)
	}
}

// A second transaction publishing waits for the first one's end, commit or
// rollback.
func TestPublishWaitsForEarlierPublisherToEnd(t *testing.T) {
	t.Parallel()
	db := testdb.OpenMySQL(t, "").DB
	table := "outbox_lock_" + testdb.RandomSuffix()
	dropLater(t, db, table)
	lock, err := mysqloutbox.NewLock(mysqloutbox.Config{LockTable: table})
	if err != nil {
		t.Fatal(err)
	}
	if err := lock.InitializeSchema(context.Background(), db); err != nil {
		t.Fatal(err)
	}
	for _, end := range []string{"commit", "rollback"} {
		first, err := db.Begin()
		if err != nil {
			t.Fatal(err)
		}
		if err := lock.Publisher(first, &countingPublisher{}).Publish("a"); err != nil {
			t.Fatal(err)
		}

		second, err := db.Begin()
		if err != nil {
			t.Fatal(err)
		}
		next := &countingPublisher{}
		published := make(chan error, 1)
		go func() {
			published <- lock.Publisher(second, next).Publish("a", message.NewMessage(watermill.NewUUID(), nil))
		}()
		// The second publish is blocked on the lock: InnoDB lists its
		// transaction in LOCK WAIT on a statement on the lock table. Read
		// from SHOW ENGINE INNODB STATUS, not information_schema.INNODB_TRX,
		// a cache that InnoDB refreshes only when nobody (no other test
		// either) read it in the last 100 ms.
		waitUntil(t, func() bool {
			var typ, name, status string
			if err := db.QueryRow("SHOW ENGINE INNODB STATUS").Scan(&typ, &name, &status); err != nil {
				t.Fatal(err)
			}
			for _, trx := range strings.Split(status, "\n---TRANSACTION ")[1:] {
				if strings.Contains(trx, "\nLOCK WAIT ") && strings.Contains(trx, table) {
					return true
				}
			}
			return false
		})
		select {
		case err := <-published:
			t.Fatalf("%s: second publish returned (%v) while the first transaction was open", end, err)
		default:
		}
		if end == "commit" {
			err = first.Commit()
		} else {
			err = first.Rollback()
		}
		if err != nil {
			t.Fatal(err)
		}
		if err := <-published; err != nil || next.n != 1 {
			t.Fatalf("%s: second publish after the first ended: err %v, published %d", end, err, next.n)
		}
		if err := second.Rollback(); err != nil {
			t.Fatal(err)
		}
	}
}

// waitUntil polls cond until it holds, failing the test after 30 s (a
// bound on a hang, never a measurement).
func waitUntil(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met within 30s")
		}
		time.Sleep(5 * time.Millisecond)
	}
}
