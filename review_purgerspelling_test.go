package inbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// The purge lock (and CreatePartitions' lock) is keyed by the name as
// written: an instance configured with "public.x" does not exclude one
// configured with "x", so both run their rounds on the same table.
func TestReviewPurgerLockDependsOnSpelling(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	f := newFixture(t, db)
	f.newInbox(inbox.Config{})
	mk := func(table string) *inbox.Purger {
		p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Table: table, OlderThan: time.Hour}})
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	a, b := mk("public."+f.inbox), mk(f.inbox)
	ctx := context.Background()
	release, got, err := inbox.PurgeLock(ctx, db, a)
	if !got || err != nil {
		t.Fatal(got, err)
	}
	defer release()
	if r := b.RunOnce(ctx); !r.Skipped {
		t.Errorf("instance A holds the purge lock of public.%s; instance B (table %q) ran its round anyway: %+v", f.inbox, f.inbox, r)
	}
}
