package inbox_test

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// An Outbox on a SQLite database its sessions cannot write (the DSN's
// mode=ro, PRAGMA query_only through _query_only=1, a file or mount made
// read-only): InitializeSchema finds the tables and returns nil, and every
// relay round reads its batch outside any transaction, publishes it to the
// broker, and only then fails to write ("attempt to write a readonly
// database": BEGIN IMMEDIATE or the DELETE of what it sent). Nothing is
// deleted, so the next round publishes the same messages again: each
// message reaches the broker once per round, for ever. On PostgreSQL and
// MySQL/MariaDB the relay's locking read is refused first and nothing is
// sent; the Inbox refuses such sessions as ErrDatabaseReadOnly.
//
// A round on a database that refuses writes must send nothing, and fail.
func TestOutboxRelayOnAReadOnlySQLiteDatabaseSendsNothing(t *testing.T) {
	for _, params := range []string{
		"_journal_mode=WAL&_busy_timeout=10000&_txlock=immediate&_query_only=1",
		"mode=ro&_busy_timeout=10000&_txlock=immediate",
	} {
		t.Run(params, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			db, table := sqliteOutboxWithTwoPending(t, params)
			broker := newBrokerStub()
			ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Table: table, Publisher: broker})
			if err != nil {
				t.Fatal(err)
			}
			initErr := ob.InitializeSchema(ctx)
			var last error
			for range 3 {
				last = ob.RelayOnce(ctx).Err
			}
			if got := broker.uuids("invoices"); len(got) != 0 {
				t.Errorf("on a database that refuses writes, 3 relay rounds sent %d messages (2 in the table; InitializeSchema: %v);"+
					" want none", len(got), initErr)
			}
			if last == nil {
				t.Errorf("relay rounds on a database that refuses writes returned no error")
			}
		})
	}
}

// sqliteOutboxWithTwoPending makes a SQLite file whose outbox table (a new
// name) holds 2 pending messages to "invoices", written through a pool that
// can write, and returns a pool on that file opened with the DSN parameters
// params, closed when the test ends, and the table.
func sqliteOutboxWithTwoPending(t *testing.T, params string) (*sqlx.DB, string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "sess_inbox.db")
	plain := openSQLite(t, path)
	table := "sess_outbox_" + randomSuffix()
	made, err := inbox.NewOutbox(inbox.OutboxConfig{DB: plain, Table: table, Publisher: newBrokerStub()})
	if err != nil {
		t.Fatal(err)
	}
	if err := made.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	writeOutbox(t, plain, made, "invoices", 2)
	db, err := sqlx.Open("sqlite", "file:"+path+"?"+params)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return db, table
}
