package main

import (
	"path/filepath"
	"strings"
	"testing"
)

// An invalid -consumer (over 255 bytes, not UTF-8) is a usage error, exit 2
// with the usage hint, in "inbox stats" as in "inbox purge": the command
// line needs fixing, not the database.
func TestStatsRefusesAnInvalidConsumerAsAUsageError(t *testing.T) {
	path := filepath.Join(t.TempDir(), "consumer.db")
	dsn := "sqlite://" + path
	if code, out, errOut := cli(t, "schema", "-db", dsn, "-apply"); code != 0 {
		t.Fatalf("schema -apply: %d %q %q", code, out, errOut)
	}
	for _, consumer := range []string{strings.Repeat("c", 300), "\xff"} {
		if code, _, errOut := cli(t, "purge", "-db", dsn, "-older-than", "1h", "-consumer", consumer, "-dry-run"); code != 2 {
			t.Fatalf("purge -consumer %.20q: exit %d (%s); want 2", consumer, code, errOut)
		}
		code, out, errOut := cli(t, "stats", "-db", dsn, "-older-than", "1h", "-consumer", consumer)
		if code != 2 || !strings.Contains(errOut, "for usage") {
			t.Errorf("stats -consumer %.20q: exit %d, stdout %q, stderr %q; want 2 and the usage hint, as purge", consumer, code, out, errOut)
		}
	}
}
