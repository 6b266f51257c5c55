package main

import (
	"context"
	"errors"
	"io"
	"strings"
	"testing"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// schema -verify -outbox-table also refuses a missing outbox table (exit 1,
// ErrTableNotFound naming it) and lists each one it found.
func TestSchemaVerifyChecksOutboxTables(t *testing.T) {
	for name, c := range dsns(t) {
		t.Run(name, func(t *testing.T) {
			table, outbox := "cli_"+testdb.RandomSuffix(), "watermill_cli_outbox_"+testdb.RandomSuffix()
			testdb.DropLater(t, c.db, table)
			testdb.DropLater(t, c.db, outbox)
			if code, out, errOut := cli(t, "schema", "-db", c.dsn, "-table", table, "-apply"); code != 0 {
				t.Fatalf("schema -apply: %d %q %q", code, out, errOut)
			}
			args := []string{"-db", c.dsn, "-table", table, "-verify", "-outbox-table", outbox}
			err := schemaCmd(context.Background(), args, io.Discard, io.Discard)
			if !errors.Is(err, inbox.ErrTableNotFound) || !strings.Contains(err.Error(), outbox) {
				t.Errorf("schema -verify with a missing outbox table: %v, want ErrTableNotFound naming %s", err, outbox)
			}
			if code, _, errOut := cli(t, append([]string{"schema"}, args...)...); code != 1 || !strings.Contains(errOut, outbox) {
				t.Errorf("exit %d, stderr %q; want 1 and the outbox table named", code, errOut)
			}
			if _, err := c.db.Exec("CREATE TABLE " + outbox + " (id INTEGER NOT NULL PRIMARY KEY)"); err != nil {
				t.Fatal(err)
			}
			code, out, errOut := cli(t, append([]string{"schema"}, args...)...)
			if want := "inbox table " + table + " is verified\noutbox table " + outbox + " exists\n"; code != 0 || out != want {
				t.Errorf("with the outbox table: exit %d, stdout %q, stderr %q; want 0 and %q", code, out, errOut, want)
			}
		})
	}
}
