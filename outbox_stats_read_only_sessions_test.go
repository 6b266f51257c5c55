package inbox_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// Outbox.Stats, which only reads, counts the backlog from a monitoring pool
// that cannot or should not write (SQLite mode=ro or query_only, MySQL
// sql_safe_updates or no default database): the session settings only the
// relay's writes need are not checked for it.
func TestOutboxStatsOnReadOnlySessionsCountsTheBacklog(t *testing.T) {
	t.Run("sqlite", statsOnReadOnlySQLite)
	t.Run("mysql", statsOnMySQLMonitoringSessions)
}

// Outbox.Stats only reads (the metrics module scrapes it, often from a
// monitoring process with a pool of its own). On a SQLite pool that cannot
// write (mode=ro, or _query_only=1), which served Stats before, the
// Outbox's session check, run first by Stats, now refuses it with
// ErrInvalidConfig ("the relay could read and publish its messages but not
// record them"): no relay runs on that pool, and the backlog is no longer
// observable from it. The check that guards the relay must not refuse a
// read-only use; Stats counts the pending messages.
func statsOnReadOnlySQLite(t *testing.T) {
	for _, params := range []string{
		"mode=ro&_busy_timeout=10000",
		"_journal_mode=WAL&_busy_timeout=10000&_query_only=1",
	} {
		t.Run(params, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			db, table := sqliteOutboxWithTwoPending(t, params)
			monitor, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Table: table, Publisher: newBrokerStub()})
			if err != nil {
				t.Fatal(err)
			}
			st, err := monitor.Stats(ctx)
			if err != nil {
				t.Fatalf("Outbox.Stats on a read-only pool: %v; want the backlog counted", err)
			}
			if st.Pending != 2 {
				t.Errorf("Outbox.Stats on a read-only pool counted %d pending; want 2", st.Pending)
			}
		})
	}
}

// Outbox.Stats only reads. A monitoring pool whose MySQL/MariaDB sessions
// have sql_safe_updates on, or whose DSN names no default database (the
// table given with its schema), read the backlog fine, and did before the
// session check; the check meant for the relay's DELETE now refuses Stats
// on them with ErrInvalidConfig, so the metrics go dark.
func statsOnMySQLMonitoringSessions(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	plain := testdb.OpenMySQL(t, "")
	table := "chk_outbox_" + randomSuffix()
	dropLater(t, plain, table)
	dropLater(t, plain, table+"_dead")
	made, err := inbox.NewOutbox(inbox.OutboxConfig{DB: plain, Table: table, Publisher: newBrokerStub()})
	if err != nil {
		t.Fatal(err)
	}
	if err := made.InitializeSchema(ctx); err != nil {
		t.Fatal(err)
	}
	writeOutbox(t, plain, made, "invoices", 2)
	var schema string
	if err := plain.Get(&schema, "SELECT DATABASE()"); err != nil {
		t.Fatal(err)
	}

	dsn := testdb.MySQLDSN()
	base, rest, _ := strings.Cut(dsn, ")/")
	_, params, _ := strings.Cut(rest, "?")
	noDB := base + ")/"
	if params != "" {
		noDB += "?" + params
	}
	noDatabase, err := sqlx.Open("mysql", noDB)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { noDatabase.Close() })
	for name, c := range map[string]struct {
		db    *sqlx.DB
		table string
	}{
		"sql_safe_updates=1":        {testdb.OpenMySQL(t, "sql_safe_updates=1"), table},
		"no default database (DSN)": {noDatabase, schema + "." + table},
	} {
		t.Run(name, func(t *testing.T) {
			monitor, err := inbox.NewOutbox(inbox.OutboxConfig{DB: c.db, Table: c.table, Publisher: newBrokerStub()})
			if err != nil {
				t.Fatal(err)
			}
			st, err := monitor.Stats(ctx)
			if err != nil {
				t.Fatalf("Outbox.Stats on a monitoring pool: %v; want the backlog counted", err)
			}
			if st.Pending != 2 {
				t.Errorf("Outbox.Stats counted %d pending; want 2", st.Pending)
			}
		})
	}
}
