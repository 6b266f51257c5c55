package main

import (
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A hand-made SQLite inbox table whose processed_at (DATETIME) holds Unix time in
// another unit than the canonical microseconds (milliseconds, as Go's
// UnixMilli and JavaScript's Date.now() give; nanoseconds, as UnixNano) is
// refused by "inbox schema -verify" with the script that recreates it. The
// script keeps what the rows say: a row processed a minute ago is kept by a
// purge with a window of a day, and a row processed 30 days ago is deleted
// by it.
func TestSchemaVerifyRecreateScriptKeepsTheTimeOfUnixMillisecondsAndNanoseconds(t *testing.T) {
	t.Parallel()
	now := time.Now()
	for _, tc := range []struct {
		unit  string
		value func(time.Time) int64
	}{
		{"milliseconds", time.Time.UnixMilli},
		{"nanoseconds", time.Time.UnixNano},
	} {
		t.Run(tc.unit, func(t *testing.T) {
			t.Parallel()
			path := filepath.Join(t.TempDir(), "cli.db")
			db := testdb.OpenSQLite(t, path)
			dsn := "sqlite://" + path + "?" + testdb.SQLiteParams
			table := "inbox_" + testdb.RandomSuffix()
			if _, err := db.Exec("CREATE TABLE " + table + " (consumer TEXT NOT NULL, message_id TEXT NOT NULL," +
				" processed_at DATETIME NOT NULL, PRIMARY KEY (consumer, message_id))"); err != nil {
				t.Fatal(err)
			}
			rows := map[string]time.Time{"recent": now.Add(-time.Minute), "old": now.AddDate(0, 0, -30)}
			for id, at := range rows {
				if _, err := db.Exec("INSERT INTO "+table+" (consumer, message_id, processed_at) VALUES ('billing', ?, ?)", id, tc.value(at)); err != nil {
					t.Fatal(err)
				}
			}
			code, out, errOut := cli(t, "schema", "-db", dsn, "-table", table, "-verify")
			all := out + errOut
			begin, end := strings.Index(all, "BEGIN IMMEDIATE;"), strings.Index(all, "COMMIT;")
			if code == 0 || begin < 0 || end < begin {
				t.Fatalf("verify a table with a DATETIME processed_at: exit %d, stdout %q, stderr %q; want the recreate script", code, out, errOut)
			}
			if _, err := db.Exec(all[begin : end+len("COMMIT;")]); err != nil {
				t.Fatalf("the script verify printed: %v\n%s", err, all[begin:end+len("COMMIT;")])
			}
			code, out, errOut = cli(t, "purge", "-db", dsn, "-table", table, "-older-than", "24h")
			if code != 0 {
				t.Fatalf("purge: exit %d, stdout %q, stderr %q", code, out, errOut)
			}
			var left []string
			if err := db.Select(&left, "SELECT message_id FROM "+table+" ORDER BY message_id"); err != nil {
				t.Fatal(err)
			}
			var stored []int64
			_ = db.Select(&stored, "SELECT processed_at FROM "+table+"_old ORDER BY message_id") // best effort, for the message
			var converted []int64
			_ = db.Select(&converted, "SELECT processed_at FROM "+table+" ORDER BY message_id") // best effort, for the message
			if fmt.Sprint(left) != "[recent]" {
				t.Errorf("after the recreate script and a purge with a 24h window of rows processed a minute and 30 days ago, stored as Unix %s %v:"+
					" rows left %v, want [recent] (converted to %v Unix microseconds; purge said %q)", tc.unit, stored, left, converted, out)
			}
		})
	}
}
