package main

import (
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/watermill-inbox/inbox/internal/testdb"
)

// The last line of "inbox purge" states the settings the purge ran with
// (docs/operations.md): -batch 0, which PurgeConfig reads as its default,
// either is refused as a usage error (as -duty-cycle 0 is) or is reported
// as the batch size the purge used, never as "batches of 0".
func TestPurgeReportsTheBatchSizeItRanWith(t *testing.T) {
	path := filepath.Join(t.TempDir(), "batch.db")
	db := testdb.OpenSQLite(t, path)
	dsn := "sqlite://" + path
	table := "cli_batch_" + testdb.RandomSuffix()
	if code, out, errOut := cli(t, "schema", "-db", dsn, "-table", table, "-apply"); code != 0 {
		t.Fatalf("schema -apply: %d %q %q", code, out, errOut)
	}
	insertAged(t, db, "sqlite", table, 3, 2*time.Hour)
	code, out, errOut := cli(t, "purge", "-db", dsn, "-table", table, "-older-than", "1h", "-batch", "0", "-duty-cycle", "1")
	switch {
	case code == 2:
	case code == 0 && strings.Contains(out, "deleted 3 rows") && !strings.Contains(out, "batches of 0"):
	default:
		t.Errorf("purge -batch 0: exit %d, stdout %q, stderr %q; want exit 2, or the batch size it ran with", code, out, errOut)
	}
}

// The purge and the dry run name the table they read: an empty -table (a
// script's unset variable) is the default table to the library, and the
// output said "from " with no name, so the operator could not tell which
// table lost its rows.
func TestPurgeNamesTheTableItPurgedWhenTableIsEmpty(t *testing.T) {
	path := filepath.Join(t.TempDir(), "empty.db")
	db := testdb.OpenSQLite(t, path)
	dsn := "sqlite://" + path
	if code, out, errOut := cli(t, "schema", "-db", dsn, "-apply"); code != 0 {
		t.Fatalf("schema -apply: %d %q %q", code, out, errOut)
	}
	insertAged(t, db, "sqlite", "watermill_inbox", 2, 2*time.Hour)
	for _, args := range [][]string{
		{"purge", "-db", dsn, "-table", "", "-older-than", "1h", "-dry-run"},
		{"purge", "-db", dsn, "-table", "", "-older-than", "1h", "-duty-cycle", "1"},
	} {
		code, out, errOut := cli(t, args...)
		if code != 2 && !strings.Contains(out, "from watermill_inbox") {
			t.Errorf("%q: exit %d, stdout %q, stderr %q; want exit 2, or the name of the table it read (watermill_inbox)", args, code, out, errOut)
		}
	}
}
