package main

import (
	"strings"
	"testing"

	"github.com/watermill-inbox/inbox/internal/testdb"
)

// On MySQL/MariaDB and PostgreSQL "temp" is an ordinary name for a database
// or schema (MySQL has no schema of temporary tables; PostgreSQL's is
// pg_temp): "inbox schema -apply -table temp.<name>" works on that database
// or schema like on any other, and is not refused as a usage error that
// calls it a temporary table. (No database or schema "temp" is made here:
// the command may fail on it, exit 1, but not exit 2.)
func TestSchemaApplyTakesADatabaseOrSchemaNamedTemp(t *testing.T) {
	for name, c := range dsns(t) {
		if name == "sqlite" {
			continue // SQLite's temp is the temporary database
		}
		t.Run(name, func(t *testing.T) {
			table := "temp.cli_cli_" + testdb.RandomSuffix()
			code, out, errOut := cli(t, "schema", "-db", c.dsn, "-table", table, "-apply")
			if code == 2 || strings.Contains(errOut, "temporary table") {
				t.Errorf("schema -apply -table %s on %s: exit %d, stdout %q, stderr %q; want it applied to the database or"+
					" schema named temp (or that one's own error), not a usage error about a temporary table", table, name, code, out, errOut)
			}
		})
	}
}
