package main

import (
	"path/filepath"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"
)

// A flag given an empty value (a script's unset variable: -consumer
// "$CONSUMER", -brokers "$KAFKA" -topics "$TOPICS") is a usage error, exit 2,
// nothing done, as an empty -table is: the command took it for the flag left
// out, and a purge meant for one consumer's rows by its window deleted every
// consumer's (the others' inside their own, longer windows: processed again
// on redelivery), and a purge meant to be checked against the broker's
// retention ran by -older-than unchecked, however short.
func TestEmptyFlagValuesAreUsageErrors(t *testing.T) {
	path := filepath.Join(t.TempDir(), "empty_flags.db")
	dsn := "sqlite://" + path
	table := "cli_shared"
	if code, out, errOut := cli(t, "schema", "-db", dsn, "-table", table, "-apply"); code != 0 {
		t.Fatalf("schema -apply: %d %q %q", code, out, errOut)
	}
	db, err := sqlx.Open("sqlite", "file:"+path)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	// Rows 2h old: outside a mistyped -older-than 1h, inside any broker's
	// window and, for shipping, its own purge's.
	insertAgedOf(t, db, "sqlite", table, "billing", 2, 2*time.Hour)
	insertAgedOf(t, db, "sqlite", table, "shipping", 3, 2*time.Hour)

	purge := []string{"purge", "-db", dsn, "-table", table, "-older-than", "1h"}
	for _, args := range [][]string{
		append(purge, "-consumer", "", "-dry-run"),
		append(purge, "-consumer", ""),
		append(purge, "-brokers", "", "-topics", ""),
		append(purge, "-nats-url", "", "-nats-stream", ""),
		append(purge, "-nats-url", "nats://127.0.0.1:4222", "-nats-stream", ""),
		{"stats", "-db", dsn, "-table", table, "-older-than", "1h", "-consumer", ""},
		{"requeue", "-db", dsn, "-outbox-table", "cli_outbox", "-all", "-topic", ""},
		{"schema", "-db", dsn, "-table", table, "-verify", "-dialect", ""},
	} {
		code, out, errOut := cli(t, args...)
		if code != 2 {
			t.Errorf("inbox %q: exit %d, stdout %q, stderr %q; want 2 (usage error: an empty value)", args, code, out, errOut)
		}
	}
	var left int
	if err := db.Get(&left, "SELECT COUNT(*) FROM "+table); err != nil {
		t.Fatal(err)
	}
	if left != 5 {
		t.Errorf("%d of 5 rows deleted by purges given empty flags; want none", 5-left)
	}
}
