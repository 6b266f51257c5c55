package main

import (
	"strings"
	"testing"

	"github.com/watermill-inbox/inbox/internal/testdb"
)

// "inbox schema -apply" run again on an existing PostgreSQLPartitioned table
// without -dialect (a deploy script's step, as docs/operations.md shows it:
// `inbox schema -db "$DATABASE_URL" -apply`) either finds the partitioned
// table as -verify, stats and purge do, or says how to fix the command: the
// -dialect postgres-partitioned flag. It failed (exit 1) telling the shell
// user to "set Config.Dialect to inbox.PostgreSQLPartitioned", beside a plain
// table's DDL "for comparison", the message -verify was fixed to stop giving.
func TestSchemaApplyFindsAnExistingPartitionedTableWithoutDialect(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	table := "cli_part_" + testdb.RandomSuffix()
	testdb.DropLater(t, db, table)
	t.Cleanup(func() {
		db.Exec(`DO $$DECLARE f regprocedure; BEGIN FOR f IN SELECT oid::regprocedure FROM pg_proc WHERE proname = '` + table + `_claim'
			LOOP EXECUTE 'DROP FUNCTION ' || f::text; END LOOP; END$$`) //nolint:errcheck // best effort
	})
	if code, out, errOut := cli(t, "schema", "-db", testdb.PostgresDSN(), "-dialect", "postgres-partitioned", "-table", table, "-apply"); code != 0 {
		t.Fatalf("schema -apply -dialect postgres-partitioned: %d %q %q", code, out, errOut)
	}
	code, out, errOut := cli(t, "schema", "-db", testdb.PostgresDSN(), "-table", table, "-apply")
	msg := out + errOut
	if code == 0 {
		return // applied as what it is: nothing to fix
	}
	if !strings.Contains(msg, "-dialect postgres-partitioned") {
		t.Errorf("schema -apply of an existing partitioned table without -dialect: exit %d, output\n%s\nwant the fix for this command: -dialect postgres-partitioned", code, msg)
	}
	if strings.Contains(msg, "PRIMARY KEY (consumer, message_id)\n") {
		t.Errorf("schema -apply of a partitioned table without -dialect offers the plain table's DDL:\n%s", msg)
	}
}
