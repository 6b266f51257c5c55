package inbox_test

import (
	"path/filepath"
	"testing"

	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox/internal/testdb"
)

// readOnlyDatabase is one database opened twice: plain takes writes (the
// test makes its tables there), readOnly reaches the same database through
// sessions whose every write is refused.
type readOnlyDatabase struct {
	name            string
	plain, readOnly func(t *testing.T) *sqlx.DB
}

// readOnlyDatabases returns each database with the session setting that
// makes it refuse writes, as a replica or a failover would:
// default_transaction_read_only on PostgreSQL, tx_read_only on MariaDB,
// query_only on SQLite (a file of t's own).
func readOnlyDatabases(t *testing.T) []readOnlyDatabase {
	path := filepath.Join(t.TempDir(), "inbox.db")
	return []readOnlyDatabase{
		{"postgres",
			func(t *testing.T) *sqlx.DB { return testdb.OpenPostgres(t, "") },
			func(t *testing.T) *sqlx.DB { return testdb.OpenPostgres(t, "default_transaction_read_only=on") }},
		{"mysql",
			func(t *testing.T) *sqlx.DB { return testdb.OpenMySQL(t, "") },
			func(t *testing.T) *sqlx.DB { return testdb.OpenMySQL(t, "tx_read_only=1") }},
		{"sqlite",
			func(t *testing.T) *sqlx.DB { return testdb.OpenSQLite(t, path) },
			func(t *testing.T) *sqlx.DB { return openReadOnlySQLite(t, path) }},
	}
}

// openReadOnlySQLite opens the SQLite file at path with query_only on.
func openReadOnlySQLite(t *testing.T, path string) *sqlx.DB {
	db, err := sqlx.Open("sqlite", "file:"+path+"?"+testdb.SQLiteParams+"&_pragma=query_only(1)")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return db
}
