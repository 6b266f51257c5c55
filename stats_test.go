package inbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

func TestEstimateRows(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		f := newFixture(t, db)
		f.newInbox(inbox.Config{})
		insertRows(t, db, tdb.Dialect, f.inbox, "billing", "m", 2000, time.Minute)
		analyze := map[inbox.Dialect]string{
			inbox.PostgreSQL: "ANALYZE " + f.inbox, inbox.PostgreSQLPartitioned: "ANALYZE " + f.inbox,
			inbox.MySQL: "ANALYZE TABLE " + f.inbox,
		}
		if q, ok := analyze[tdb.Dialect]; ok {
			exec(t, db, q)
		}
		n, err := inbox.EstimateRows(context.Background(), db, tdb.Dialect, f.inbox)
		if err != nil {
			t.Fatal(err)
		}
		if n < 1000 || n > 3000 {
			t.Errorf("estimate = %d, want about 2000", n)
		}
		if _, err := inbox.EstimateRows(context.Background(), db, tdb.Dialect, "no_such_"+randomSuffix()); err == nil {
			t.Error("missing table: want an error")
		}
	})
}
