package main

import (
	"testing"

	"github.com/watermill-inbox/inbox/internal/testdb"
)

// "inbox schema -apply" says a table is ready only when it outlives the
// command: a table in the session's temporary schema (PostgreSQL's pg_temp,
// SQLite's temp) is dropped when the command's connection closes, so the
// command either refuses the name or the table is there for the next
// command (schema -verify with the same -db and -table), whose error then
// sends the operator back to schema -apply.
func TestSchemaApplyDoesNotReportATemporaryTableReady(t *testing.T) {
	for name, c := range dsns(t) {
		schema := map[string]string{"postgres": "pg_temp", "sqlite": "temp"}[name]
		if schema == "" {
			continue // MySQL has no schema of temporary tables
		}
		t.Run(name, func(t *testing.T) {
			table := schema + ".cli_tmp_" + testdb.RandomSuffix()
			code, out, errOut := cli(t, "schema", "-db", c.dsn, "-table", table, "-apply")
			if code != 0 {
				return // refused: fine
			}
			if vcode, vout, verrOut := cli(t, "schema", "-db", c.dsn, "-table", table, "-verify"); vcode != 0 {
				t.Errorf("schema -apply -table %s: exit 0, stdout %q, stderr %q; then schema -verify: exit %d, stdout %q, stderr %.300q;"+
					" want -apply to refuse a temporary table, or the table to be there", table, out, errOut, vcode, vout, verrOut)
			}
		})
	}
}
