package main

import (
	"testing"
)

// An empty -outbox-table (a script's unset variable: -outbox-table
// "$OUTBOX_TABLE") is a usage error, exit 2, for "inbox schema" as for the
// other commands (docs/operations.md: "an empty -table or -outbox-table"):
// the command does not go on with the default outbox table and print DDL
// that names none.
func TestSchemaEmptyOutboxTableIsAUsageError(t *testing.T) {
	code, out, errOut := cli(t, "schema", "-dialect", "postgres", "-outbox-table", "")
	if code != 2 {
		t.Errorf("schema -dialect postgres -outbox-table \"\": exit %d, stderr %q, stdout %.300q; want exit 2, a usage error", code, errOut, out)
	}
}
