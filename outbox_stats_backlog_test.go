package inbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// Outbox.Stats reads the age of the oldest message apart from the count of
// every pending one: a backlog too large to count before ctx ends (a
// scrape's timeout) still gives its age, with Pending -1 and the count's
// error, and the oldest message is found through the primary key, however
// large the table. (One statement read both, the age as MIN(created_at) by
// a scan of every row as well: a large enough backlog hid its age, and the
// critical alert on it resolved while the broker was still down.) The
// count is made slow by the table's size: the test runs Stats under
// shorter and shorter deadlines until one ends during the count.
func TestOutboxStatsKeepTheAgeOfABacklogTooLargeToCount(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	ob := newTestOutbox(t, db, inbox.PostgreSQL, inbox.OutboxConfig{Publisher: newBrokerStub()})
	const rows = 400_000
	exec(t, db, "INSERT INTO "+ob.Table()+" (topic, uuid, payload, metadata, created_at)"+
		" SELECT 'orders', g::text, '\\x', '\\x', clock_timestamp() - interval '1 hour' + g * interval '1 microsecond' FROM generate_series(1, $1) g", rows)
	exec(t, db, "VACUUM ANALYZE "+ob.Table())

	st, err := ob.Stats(context.Background())
	if err != nil || st.Pending != rows || st.OldestAge < 59*time.Minute || st.OldestAge > 61*time.Minute {
		t.Fatalf("stats = %+v, %v; want %d pending, the oldest about an hour old", st, err, rows)
	}
	for d := 2 * time.Second; d >= 250*time.Microsecond; d /= 2 {
		ctx, cancel := context.WithTimeout(context.Background(), d)
		st, err := ob.Stats(ctx)
		cancel()
		switch {
		case err == nil:
			continue // counted in time
		case st.Pending != -1:
			continue // ended before the count: nothing read
		case !errors.Is(err, context.DeadlineExceeded):
			t.Fatalf("deadline %v: the count failed with %v, want its deadline", d, err)
		case st.OldestAge < 59*time.Minute || st.OldestAge > 61*time.Minute:
			t.Fatalf("deadline %v: stats without the count = %+v, want the oldest about an hour old", d, st)
		default:
			return // the age of a backlog that could not be counted in time
		}
	}
	t.Fatal("no deadline ended during the count, with the age read: Stats read them together")
}
