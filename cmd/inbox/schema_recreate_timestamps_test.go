package main

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A hand-made SQLite inbox table whose processed_at holds SQLite's text
// timestamps (DATETIME DEFAULT CURRENT_TIMESTAMP, the usual hand-written
// shape) is refused by "inbox schema -verify", which prints the script
// that recreates it in the canonical shape keeping its rows. After that
// script, the rows it kept are the inbox's rows like any other: a purge
// deletes those past the window, and "inbox stats" reads the table.
func TestSchemaVerifyRecreateScriptKeepsRowsThePurgeCanDelete(t *testing.T) {
	path := filepath.Join(t.TempDir(), "cli.db")
	db := testdb.OpenSQLite(t, path)
	dsn := "sqlite://" + path + "?" + testdb.SQLiteParams
	table := "inbox_" + testdb.RandomSuffix()
	if _, err := db.Exec("CREATE TABLE " + table + " (consumer TEXT NOT NULL, message_id TEXT NOT NULL," +
		" processed_at DATETIME NOT NULL DEFAULT CURRENT_TIMESTAMP, PRIMARY KEY (consumer, message_id))"); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"m1", "m2", "m3"} {
		if _, err := db.Exec("INSERT INTO "+table+" (consumer, message_id, processed_at) VALUES ('billing', ?, datetime('now', '-30 days'))", id); err != nil {
			t.Fatal(err)
		}
	}
	code, out, errOut := cli(t, "schema", "-db", dsn, "-table", table, "-verify")
	all := out + errOut
	begin, end := strings.Index(all, "BEGIN IMMEDIATE;"), strings.Index(all, "COMMIT;")
	if code == 0 || begin < 0 || end < begin {
		t.Fatalf("verify a table with a DATETIME processed_at: exit %d, stdout %q, stderr %q; want it refused with the script that recreates it", code, out, errOut)
	}
	if _, err := db.Exec(all[begin : end+len("COMMIT;")]); err != nil {
		t.Fatalf("the script verify printed: %v\n%s", err, all[begin:end+len("COMMIT;")])
	}
	if code, out, errOut := cli(t, "schema", "-db", dsn, "-table", table, "-verify"); code != 0 {
		t.Fatalf("verify after the script: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	code, out, errOut = cli(t, "stats", "-db", dsn, "-table", table, "-older-than", "240h")
	if code != 0 || !strings.Contains(out, "rows:     3\n") || !strings.Contains(out, "warning:  the oldest row is ") {
		t.Errorf("stats of the 30-day-old rows the script kept, window 10 days: exit %d, stdout %q, stderr %q; want them read, past the window", code, out, errOut)
	}
	code, out, errOut = cli(t, "purge", "-db", dsn, "-table", table, "-older-than", "240h")
	if code != 0 || !strings.HasPrefix(out, "deleted 3 rows ") {
		var typ string
		db.Get(&typ, "SELECT typeof(processed_at) FROM "+table+" LIMIT 1") //nolint:errcheck // for the message
		t.Errorf("purge of the 30-day-old rows the script kept, window 10 days: exit %d, stdout %q, stderr %q; want the 3 rows deleted"+
			" (their processed_at is of type %s)", code, out, errOut, typ)
	}
}
