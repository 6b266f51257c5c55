package main

import (
	"strings"
	"testing"

	"github.com/watermill-inbox/inbox/internal/testdb"
)

// "inbox schema -apply -outbox-table O" on an O that exists and is not an
// inbox.Outbox table (another outbox's, watermill-sql's, with none of the
// relay's columns) fails with exit 1, as -apply does for an existing inbox
// table it cannot use, and as "schema -verify" tells the two apart: it
// printed that O and its dead-letter table were ready, exit 0, after
// creating O_dead beside it, and "inbox stats -outbox-table O" then failed
// on O's missing id column.
func TestSchemaApplyRefusesAnExistingOutboxTableOfAnotherShape(t *testing.T) {
	for name, c := range dsns(t) {
		t.Run(name, func(t *testing.T) {
			table := "cli_in_" + testdb.RandomSuffix()
			outbox := "cli_wsql_" + testdb.RandomSuffix()
			testdb.DropLater(t, c.db, table)
			testdb.DropLater(t, c.db, outbox)
			testdb.DropLater(t, c.db, outbox+"_dead")
			if _, err := c.db.Exec("CREATE TABLE " + outbox + " (uuid varchar(36) NOT NULL PRIMARY KEY, payload text)"); err != nil {
				t.Fatal(err)
			}
			code, out, errOut := cli(t, "schema", "-db", c.dsn, "-table", table, "-outbox-table", outbox, "-apply")
			if code != 1 || strings.Contains(out, "outbox table "+outbox+" and its dead-letter table") {
				t.Errorf("schema -apply with -outbox-table %s, a table of another shape: exit %d, stdout %q, stderr %.300q;"+
					" want exit 1 saying the table is not one inbox.Outbox can use", outbox, code, out, errOut)
			}
		})
	}
}
