package main

import (
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A hand-made SQLite inbox table without a processed_at column is refused
// by "inbox schema -verify", which prints a script that recreates it in the
// canonical shape, keeping its rows. Run as an operator runs a script, with
// the sqlite3 shell, it keeps every row the table held: the messages
// processed before are still duplicates afterwards.
func TestSchemaVerifyRecreateScriptOfATableWithoutProcessedAtKeepsItsRows(t *testing.T) {
	shell, err := exec.LookPath("sqlite3")
	if err != nil {
		t.Skip("the sqlite3 shell is not installed (apt-get install sqlite3)")
	}
	path := filepath.Join(t.TempDir(), "cli.db")
	db := testdb.OpenSQLite(t, path)
	dsn := "sqlite://" + path + "?" + testdb.SQLiteParams
	table := "inbox_" + testdb.RandomSuffix()
	if _, err := db.Exec("CREATE TABLE " + table + " (consumer TEXT NOT NULL, message_id TEXT NOT NULL, PRIMARY KEY (consumer, message_id))"); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec("INSERT INTO " + table + " VALUES ('billing', 'order-1'), ('billing', 'order-2')"); err != nil {
		t.Fatal(err)
	}
	code, out, errOut := cli(t, "schema", "-db", dsn, "-table", table, "-verify")
	all := out + errOut
	begin, end := strings.Index(all, "BEGIN IMMEDIATE;"), strings.Index(all, "COMMIT;")
	if code == 0 || begin < 0 || end < begin {
		t.Fatalf("verify a table without processed_at: exit %d, stdout %q, stderr %q; want it refused with the script that recreates it", code, out, errOut)
	}
	script := all[begin : end+len("COMMIT;")]
	cmd := exec.Command(shell, path)
	cmd.Stdin = strings.NewReader(script)
	shellOut, shellErr := cmd.CombinedOutput()
	var rows int
	if err := db.Get(&rows, "SELECT count(*) FROM "+table); err != nil {
		t.Fatal(err)
	}
	if rows != 2 {
		t.Errorf("after the script verify printed, run with sqlite3 (%v: %s), %s holds %d rows; want the 2 it held\nscript:\n%s",
			shellErr, strings.TrimSpace(string(shellOut)), table, rows, script)
	}
}
