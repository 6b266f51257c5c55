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
		// The slow handler's transaction stays open until release is
		// closed, which happens only after the checks below: what must not
		// wait for it, must finish while it is still open. A bound (not a
		// measurement) tells "waits for it" from "does not".
		const bound = 20 * time.Second
		defer func() {
			select {
			case <-release:
			default:
				close(release)
			}
		}()
		purged := make(chan error, 1)
		var n int64
		go func() {
			var err error
			n, err = inbox.Purge(context.Background(), inbox.PurgeConfig{DB: db, Table: f.inbox, OlderThan: time.Hour})
			purged <- err
		}()
		claimed := make(chan error, 1)
		go func() { // a live claim of a new message while the purge runs
			_, err := ib.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })(message.NewMessage(watermill.NewUUID(), nil))
			claimed <- err
		}()
		select {
		case err := <-claimed:
			if err != nil {
				t.Error(err)
			}
		case <-time.After(bound):
			t.Fatalf("a new message's claim, started while the purge ran, did not finish within %v while a slow handler's transaction was open: the purge stalled live traffic", bound)
		}
		var purgeErr error
		if tdb.Dialect != inbox.MySQL {
			// PostgreSQL skips the locked row: the purge does not wait.
			select {
			case purgeErr = <-purged:
			case <-time.After(bound):
				t.Fatalf("the purge did not finish within %v while a live handler's transaction was open: it waited for it", bound)
			}
			close(release)
		} else {
			close(release)
			purgeErr = <-purged
		}
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		if purgeErr != nil || n != 20000 {
			t.Errorf("purge: %d, %v; want 20000 deleted", n, purgeErr)
		}
	})
}
