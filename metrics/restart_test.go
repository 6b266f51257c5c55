package metrics_test

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"github.com/jmoiron/sqlx"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/metrics"
)

// A service restarted within its process (its router run again, with a new
// DB and Outbox, the first ones closed) unwatches its tables and watches
// them again on the same registry: the outbox and table gauges are in
// every scrape after it, read through the new DB. (A second watch could
// only fail with AlreadyRegisteredError, and the first watch's reads
// through the closed DB left the gauges out of every scrape for good: the
// outbox alerts could no longer fire.)
func TestWatchesOfARestartedServiceReadThroughItsNewDB(t *testing.T) {
	for _, tdb := range outboxDBs() {
		t.Run(tdb.Name, func(t *testing.T) {
			t.Parallel()
			open := tdb.Open
			if tdb.Dialect == inbox.SQLite { // one file, opened by each run
				path := filepath.Join(t.TempDir(), "service.db")
				open = func(tb testing.TB) *sqlx.DB { return testdb.OpenSQLite(tb, path) }
			}
			keep := open(t) // the tables' owner, for the whole test
			reg := prometheus.NewRegistry()
			m, err := metrics.New(reg)
			if err != nil {
				t.Fatal(err)
			}
			outboxTable, inboxTable := "outbox_"+testdb.RandomSuffix(), "inbox_"+testdb.RandomSuffix()
			testdb.DropLater(t, keep, inboxTable)
			ib, err := inbox.New(inbox.Config{DB: keep, Dialect: tdb.Dialect, Table: inboxTable})
			if err != nil {
				t.Fatal(err)
			}
			if err := ib.InitializeSchema(context.Background()); err != nil {
				t.Fatal(err)
			}
			newOutbox(t, keep, tdb.Dialect, inbox.OutboxConfig{Table: outboxTable, Publisher: &refusingBroker{}})
			for run := range 2 {
				db := open(t) // this run's own DB, closed when it ends
				ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Dialect: tdb.Dialect, Table: outboxTable, Publisher: &refusingBroker{}})
				if err != nil {
					t.Fatal(err)
				}
				if err := m.WatchOutbox(ob); err != nil {
					t.Fatalf("run %d: WatchOutbox: %v", run, err)
				}
				if err := m.WatchTable(db, tdb.Dialect, inboxTable); err != nil {
					t.Fatalf("run %d: WatchTable: %v", run, err)
				}
				if err := m.WatchTable(db, tdb.Dialect, inboxTable); !strings.Contains(fmt.Sprint(err), "UnwatchTable") {
					t.Errorf("run %d: WatchTable twice: %v, want an error that names UnwatchTable", run, err)
				}
				for _, name := range []string{"inbox_outbox_pending_messages", "inbox_outbox_oldest_pending_age_seconds", "inbox_outbox_dead_letters"} {
					if _, ok := scraped(t, reg, name, outboxTable); !ok {
						t.Errorf("run %d: %s is not in the scrape", run, name)
					}
				}
				if _, ok := scraped(t, reg, "inbox_rows", inboxTable); !ok {
					t.Errorf("run %d: inbox_rows is not in the scrape", run)
				}
				for _, name := range []string{"inbox_outbox_stats_errors_total"} {
					if v, _ := scraped(t, reg, name, outboxTable); v != 0 {
						t.Errorf("run %d: %s = %v, want 0", run, name, v)
					}
				}
				if v, _ := scraped(t, reg, "inbox_rows_estimate_errors_total", inboxTable); v != 0 {
					t.Errorf("run %d: inbox_rows_estimate_errors_total = %v, want 0", run, v)
				}
				if !m.UnwatchOutbox(outboxTable) || !m.UnwatchTable(inboxTable) {
					t.Fatalf("run %d: Unwatch found no watch", run)
				}
				if err := db.Close(); err != nil {
					t.Fatal(err)
				}
			}
		})
	}
}
