package main

import (
	"testing"

	"github.com/watermill-inbox/inbox/internal/testdb"
)

// "inbox schema -apply" says an outbox table is ready only when it outlives
// the command, as it does for the inbox table: an -outbox-table in the
// session's temporary schema (PostgreSQL's pg_temp, SQLite's temp) is
// dropped when the command's connection closes, so the command either
// refuses the name or the tables are there for the next command (schema
// -verify with the same -db, -table and -outbox-table).
func TestSchemaApplyDoesNotReportATemporaryOutboxTableReady(t *testing.T) {
	for name, c := range dsns(t) {
		schema := map[string]string{"postgres": "pg_temp", "sqlite": "temp"}[name]
		if schema == "" {
			continue // MySQL has no schema of temporary tables
		}
		t.Run(name, func(t *testing.T) {
			table := "cli_cli_" + testdb.RandomSuffix()
			testdb.DropLater(t, c.db, table)
			outbox := schema + ".cli_cli_outbox_" + testdb.RandomSuffix()
			code, out, errOut := cli(t, "schema", "-db", c.dsn, "-table", table, "-outbox-table", outbox, "-apply")
			if code != 0 {
				return // refused: fine
			}
			if vcode, vout, verrOut := cli(t, "schema", "-db", c.dsn, "-table", table, "-outbox-table", outbox, "-verify"); vcode != 0 {
				t.Errorf("schema -apply -outbox-table %s: exit 0, stdout %q, stderr %q; then schema -verify: exit %d, stdout %q, stderr %.300q;"+
					" want -apply to refuse a temporary outbox table, or the table to be there", outbox, out, errOut, vcode, vout, verrOut)
			}
		})
	}
}
