package main

import (
	"strings"
	"testing"

	"github.com/watermill-inbox/inbox/internal/testdb"
)

// "inbox schema -verify" run as a user that may only read the table (no
// INSERT on it at all) says that the user may not write the table, the
// database's own refusal, whether or not the table has the fingerprint
// column: the GRANT of the fingerprint column alone does not let the
// service claim, so an error that names only that column sends the operator
// to a fix that does not fix it.
func TestSchemaVerifyAsAUserWhoMayOnlyReadSaysTheTableIsNotWritable(t *testing.T) {
	c := dsns(t)["postgres"]
	table := "cli_ro_" + testdb.RandomSuffix()
	testdb.DropLater(t, c.db, table)
	if code, out, errOut := cli(t, "schema", "-db", c.dsn, "-table", table, "-apply"); code != 0 { // with the fingerprint column
		t.Fatalf("schema -apply: %d %q %q", code, out, errOut)
	}
	role := "cli_reader_" + testdb.RandomSuffix()
	for _, s := range []string{
		"CREATE ROLE " + role + " LOGIN",
		"GRANT SELECT ON " + table + " TO " + role,
	} {
		if _, err := c.db.Exec(s); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		_, _ = c.db.Exec("DROP OWNED BY " + role)
		_, _ = c.db.Exec("DROP ROLE " + role)
	})
	dsn := strings.Replace(c.dsn, "postgres@", role+"@", 1)
	code, out, errOut := cli(t, "schema", "-db", dsn, "-table", table, "-verify")
	if code != 1 || !strings.Contains(errOut, "permission denied for table") {
		t.Errorf("verify as a read-only user: exit %d, stdout %q, stderr %q; want 1 and the table's refusal"+
			" (permission denied for table), as for a table without the fingerprint column", code, out, errOut)
	}
}
