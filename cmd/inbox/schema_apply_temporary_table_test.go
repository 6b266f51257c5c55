package main

import (
	"testing"

	"github.com/watermill-inbox/inbox/internal/testdb"
)

// "inbox schema -apply" says a table is ready only when it outlives the
// command: a -table or -outbox-table in the session's temporary schema
// (PostgreSQL's pg_temp, SQLite's temp) is dropped when the command's
// connection closes, so the command either refuses the name or the tables
// are there for the next command (schema -verify with the same flags),
// whose error then sends the operator back to schema -apply.
func TestSchemaApplyDoesNotReportATemporaryTableReady(t *testing.T) {
	for name, c := range dsns(t) {
		schema := map[string]string{"postgres": "pg_temp", "sqlite": "temp"}[name]
		if schema == "" {
			continue // MySQL has no schema of temporary tables
		}
		for _, temporary := range []string{"-table", "-outbox-table"} {
			t.Run(name+temporary, func(t *testing.T) {
				table := "cli_tmp_" + testdb.RandomSuffix()
				var flags []string
				if temporary == "-table" {
					flags = []string{"-table", schema + "." + table}
				} else {
					testdb.DropLater(t, c.db, table)
					flags = []string{"-table", table, "-outbox-table", schema + ".cli_tmp_outbox_" + testdb.RandomSuffix()}
				}
				code, out, errOut := cli(t, append([]string{"schema", "-db", c.dsn, "-apply"}, flags...)...)
				if code != 0 {
					return // refused: fine
				}
				if vcode, vout, verrOut := cli(t, append([]string{"schema", "-db", c.dsn, "-verify"}, flags...)...); vcode != 0 {
					t.Errorf("schema -apply %v: exit 0, stdout %q, stderr %q; then schema -verify: exit %d, stdout %q, stderr %.300q;"+
						" want -apply to refuse a temporary table, or the tables to be there", flags, out, errOut, vcode, vout, verrOut)
				}
			})
		}
	}
}
