package main

import (
	"path/filepath"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/watermill-inbox/inbox/internal/testdb"
)

// The "refused:" line of "inbox stats" cuts a long last_error to 300 bytes
// on a character boundary: its output stays valid UTF-8, so that grep and
// scripts reading it see text (grep called the output a "binary file" when
// the cut split an "é").
func TestStatsCutsALongRefusalOnACharacterBoundary(t *testing.T) {
	path := filepath.Join(t.TempDir(), "refused.db")
	dsn := "sqlite://" + path
	outbox := "cli_ob_" + testdb.RandomSuffix()
	if code, out, errOut := cli(t, "schema", "-db", dsn, "-outbox-table", outbox, "-apply"); code != 0 {
		t.Fatalf("schema -apply: %d %q %q", code, out, errOut)
	}
	db := testdb.OpenSQLite(t, path)
	lastError := strings.Repeat("a", 299) + strings.Repeat("é", 10) // the 300th byte is the first of an "é"
	if _, err := db.Exec("INSERT INTO "+outbox+" (topic, uuid, payload, metadata, created_at, attempts, last_error)"+
		" VALUES ('payments', 'u1', x'00', x'7b7d', 0, 1, ?)", lastError); err != nil {
		t.Fatal(err)
	}
	code, out, errOut := cli(t, "stats", "-db", dsn, "-outbox-table", outbox)
	if code != 0 || !strings.Contains(out, "refused:") {
		t.Fatalf("stats: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	if !utf8.ValidString(out) {
		t.Errorf("stats output is not valid UTF-8: %q", out[strings.Index(out, "refused:"):])
	}
}
