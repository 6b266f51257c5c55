package inbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// A purge must not stall live handlers. Found in review: on MySQL/MariaDB at
// REPEATABLE READ the last batch locked the first row past the cutoff, and
// when that was a slow handler's uncommitted claim, the DELETE waited for it
// while holding gap locks that new claims queued behind. Now each MySQL
// batch reads its keys without locking and deletes them by primary key at
// READ COMMITTED: new claims go through at once. InnoDB may still make the
// purge itself wait for the slow handler (a record lock on a live key next
// to expired ones), which delays only the purge. On PostgreSQL (SKIP
// LOCKED) the purge does not wait at all.
func TestReviewPurgeDoesNotStallLiveClaims(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if tdb.Dialect == inbox.PostgreSQLPartitioned || tdb.Dialect == inbox.SQLite { // SQLite: one writer, by design
			t.Skip()
		}
		f := newFixture(t, db)
		ib := f.newInbox(inbox.Config{Consumer: "billing"})
		insertRows(t, db, tdb.Dialect, f.inbox, "billing", "old", 20000, 2*time.Hour)
		entered, release := make(chan struct{}), make(chan struct{})
		done := make(chan error, 1)
		go func() {
			_, err := ib.Middleware(func(*message.Message) ([]*message.Message, error) {
				close(entered)
				<-release
				return nil, nil
			})(message.NewMessage(watermill.NewUUID(), nil))
			done <- err
		}()
		<-entered
		const handlerTime = 3 * time.Second
		time.AfterFunc(handlerTime, func() { close(release) })
		claimTook := make(chan time.Duration, 1)
		go func() { // a live claim of a new message while the purge waits
			time.Sleep(time.Second)
			s := time.Now()
			_, err := ib.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })(message.NewMessage(watermill.NewUUID(), nil))
			if err != nil {
				t.Error(err)
			}
			claimTook <- time.Since(s)
		}()
		start := time.Now()
		n, err := inbox.Purge(context.Background(), inbox.PurgeConfig{DB: db, Table: f.inbox, OlderThan: time.Hour})
		took := time.Since(start)
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		if claim := <-claimTook; claim > 500*time.Millisecond {
			t.Errorf("a new message's claim, started while the purge ran, took %v: the purge stalled live traffic", claim.Round(time.Millisecond))
		}
		if err != nil || n != 20000 {
			t.Errorf("purge: %d, %v; want 20000 deleted", n, err)
		}
		if tdb.Dialect != inbox.MySQL && took > handlerTime/2 {
			t.Errorf("purge of %d rows took %v: it waited for a live handler's transaction", n, took.Round(time.Millisecond))
		}
	})
}
