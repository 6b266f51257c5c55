package main

import (
	"context"
	"database/sql"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"
	_ "modernc.org/sqlite"
)

// "inbox stats -timeout" bounds its reads on SQLite too: a database in
// rollback-journal mode (what "inbox schema -apply" makes of a plain
// sqlite:// DSN) whose file another connection holds an exclusive lock on
// makes the reads wait; they give up after -timeout, saying so, rather than
// after the command's busy timeout (10 s) or when the lock goes.
func TestStatsOnSQLiteGivesUpOnALockedDatabaseAfterItsTimeout(t *testing.T) {
	dsn, conn := lockedSQLite(t)
	// The lock goes after 8 s, well past -timeout.
	release := time.AfterFunc(8*time.Second, func() { _, _ = conn.ExecContext(context.Background(), "ROLLBACK") })
	defer release.Stop()

	start := time.Now()
	code, out, errOut := cli(t, "stats", "-db", dsn, "-timeout", "1s")
	took := time.Since(start)
	if took > 5*time.Second || code != 1 || !strings.Contains(errOut, "-timeout 1s") {
		t.Errorf("stats -timeout 1s on a locked SQLite database: exit %d after %s, stdout %q, stderr %q;"+
			" want exit 1 well before the lock goes (8s), saying -timeout", code, took.Round(time.Millisecond), out, errOut)
	}
}

// A command on a SQLite database that another connection keeps locked past
// the command's busy timeout fails saying that the database is locked (the
// driver's SQLITE_BUSY, which a service operator knows), not with a bare
// "connect: context deadline exceeded", which reads as a network problem on
// what is a local file.
func TestPurgeOnALockedSQLiteDatabaseSaysItIsLocked(t *testing.T) {
	dsn, _ := lockedSQLite(t)

	code, out, errOut := cli(t, "purge", "-db", dsn, "-older-than", "1h", "-dry-run")
	if code != 1 || !strings.Contains(errOut, "locked") {
		t.Errorf("purge -dry-run on a locked SQLite database: exit %d, stdout %q, stderr %q; want 1 and that the database is locked",
			code, out, errOut)
	}
}

// lockedSQLite returns the DSN of a SQLite database with the inbox table,
// and the connection of another client that holds it locked (BEGIN
// EXCLUSIVE) until the test ends or it rolls back.
func lockedSQLite(t *testing.T) (string, *sql.Conn) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "locked.db")
	dsn := "sqlite://" + path
	if code, out, errOut := cli(t, "schema", "-db", dsn, "-apply"); code != 0 {
		t.Fatalf("schema -apply: %d %q %q", code, out, errOut)
	}
	other, err := sqlx.Open("sqlite", "file:"+path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { other.Close() })
	conn, err := other.Conn(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	if _, err := conn.ExecContext(context.Background(), "BEGIN EXCLUSIVE"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.ExecContext(context.Background(), "ROLLBACK") }) //nolint:errcheck // may be rolled back already
	return dsn, conn
}
