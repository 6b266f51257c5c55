package inbox_test

import (
	"context"
	"errors"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

func TestPurgeDeletesExactlyExpiredRows(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		f := newFixture(t, db)
		f.newInbox(inbox.Config{})
		insertRows(t, db, tdb.Dialect, f.inbox, "billing", "old", 2500, 2*time.Hour)
		insertRows(t, db, tdb.Dialect, f.inbox, "shipping", "old", 300, 2*time.Hour)
		insertRows(t, db, tdb.Dialect, f.inbox, "billing", "recent", 40, 30*time.Minute)

		// Only billing's expired rows first.
		deleted, err := inbox.Purge(context.Background(), inbox.PurgeConfig{
			DB: db, Table: f.inbox, OlderThan: time.Hour, BatchSize: 1000, Consumer: "billing",
		})
		if err != nil || deleted != 2500 {
			t.Fatalf("purge billing: deleted %d, err %v; want 2500, nil", deleted, err)
		}
		if got := count(t, db, f.inbox, "consumer = ?", "shipping"); got != 300 {
			t.Errorf("shipping rows = %d, want 300 (other consumer untouched)", got)
		}
		// Then everything expired; a batch size that divides the count
		// exactly needs one more, empty, batch to stop.
		deleted, err = inbox.Purge(context.Background(), inbox.PurgeConfig{
			DB: db, Table: f.inbox, OlderThan: time.Hour, BatchSize: 100,
		})
		if err != nil || deleted != 300 {
			t.Fatalf("purge all: deleted %d, err %v; want 300, nil", deleted, err)
		}
		if got := f.inboxRows(); got != 40 {
			t.Errorf("rows left = %d, want the 40 recent ones", got)
		}
		if got := count(t, db, f.inbox, "message_id LIKE ?", "recent-%"); got != 40 {
			t.Errorf("recent rows = %d, want 40", got)
		}
	})
}

// processed_at and the purge cutoff both come from the database clock in
// UTC: messages claimed on a session at UTC+14 (+13 on MySQL/MariaDB, whose
// limit that is) are not purged by a 1-hour window from a session at
// UTC-12, and are by a 1µs window.
func TestPurgeIgnoresSessionTimeZone(t *testing.T) {
	sessions := map[string][2]string{ // dialect name: DSN parameter for +14, for -12
		"postgres": {"timezone=Etc/GMT-14", "timezone=Etc/GMT%2B12"},
		"mysql":    {"time_zone=" + url.QueryEscape("'+13:00'"), "time_zone=" + url.QueryEscape("'-12:00'")},
	}
	for _, tdb := range testDBs {
		if tdb.Name == "mysql-clientFoundRows" {
			continue
		}
		t.Run(tdb.Name, func(t *testing.T) {
			t.Parallel()
			plus14, minus12 := tdb.Open(t), tdb.Open(t)
			if params, ok := sessions[tdb.Name]; ok {
				open := testdb.OpenPostgres
				if tdb.Dialect == inbox.MySQL {
					open = testdb.OpenMySQL
				}
				plus14, minus12 = open(t, params[0]), open(t, params[1])
				checkSessionOffsets(t, tdb.Dialect, plus14, minus12)
			} else {
				minus12 = plus14 // SQLite has no session time zone; its clock is UTC by definition
			}
			f := newFixture(t, plus14)
			ib := f.newInbox(inbox.Config{Consumer: "billing"})
			h := ib.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
			for range 20 {
				if _, err := h(message.NewMessage(watermill.NewUUID(), nil)); err != nil {
					t.Fatal(err)
				}
			}
			purge := func(window time.Duration) int64 {
				n, err := inbox.Purge(context.Background(), inbox.PurgeConfig{DB: minus12, Table: f.inbox, OlderThan: window})
				if err != nil {
					t.Fatal(err)
				}
				return n
			}
			if n := purge(time.Hour); n != 0 {
				t.Errorf("1h window deleted %d rows processed a moment ago, want 0", n)
			}
			time.Sleep(20 * time.Millisecond)
			if n := purge(time.Microsecond); n != 20 {
				t.Errorf("1µs window deleted %d rows, want 20", n)
			}
		})
	}
}

// checkSessionOffsets proves the DSN parameters really moved the sessions.
func checkSessionOffsets(t *testing.T, d inbox.Dialect, plus14, minus12 *sqlx.DB) {
	t.Helper()
	q, east := "SELECT CAST(EXTRACT(TIMEZONE FROM now()) AS INTEGER)", 14
	if d == inbox.MySQL {
		q, east = "SELECT TIMESTAMPDIFF(SECOND, UTC_TIMESTAMP(), NOW())", 13
	}
	for db, want := range map[*sqlx.DB]int{plus14: east * 3600, minus12: -12 * 3600} {
		var got int
		if err := db.Get(&got, q); err != nil {
			t.Fatal(err)
		}
		if got < want-5 || got > want+5 {
			t.Fatalf("session offset = %ds, want %ds", got, want)
		}
	}
}

func TestPurgeConfigErrors(t *testing.T) {
	db := sqliteDB(t)
	cases := []struct {
		cfg  inbox.PurgeConfig
		want string
	}{
		{inbox.PurgeConfig{OlderThan: time.Hour}, "DB is required"},
		{inbox.PurgeConfig{DB: db}, "OlderThan"},
		{inbox.PurgeConfig{DB: db, OlderThan: -time.Hour}, "OlderThan"},
		{inbox.PurgeConfig{DB: db, OlderThan: time.Hour, BatchSize: -1}, "BatchSize"},
		{inbox.PurgeConfig{DB: db, OlderThan: time.Hour, BatchSize: inbox.MaxPurgeBatchSize + 1}, "BatchSize"},
		{inbox.PurgeConfig{DB: db, OlderThan: time.Hour, Table: "x; DROP TABLE y"}, "invalid table name"},
		{inbox.PurgeConfig{DB: db, OlderThan: time.Hour, Pause: -time.Second}, "Pause"},
	}
	for _, tc := range cases {
		n, err := inbox.Purge(context.Background(), tc.cfg)
		if n != 0 || !errors.Is(err, inbox.ErrInvalidConfig) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: got %d, %v; want ErrInvalidConfig mentioning %q", tc.cfg, n, err, tc.want)
		}
	}
}

func TestPurgeStopsWhenContextEnds(t *testing.T) {
	db := sqliteDB(t)
	f := newFixture(t, db)
	f.newInbox(inbox.Config{})
	insertRows(t, db, inbox.SQLite, f.inbox, "billing", "old", 50, 2*time.Hour)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	n, err := inbox.Purge(ctx, inbox.PurgeConfig{DB: db, Table: f.inbox, OlderThan: time.Hour, BatchSize: 10})
	if n != 0 || !errors.Is(err, context.Canceled) {
		t.Errorf("got %d, %v; want 0 and context.Canceled", n, err)
	}
	if f.inboxRows() != 50 {
		t.Errorf("rows = %d, want 50", f.inboxRows())
	}
}
