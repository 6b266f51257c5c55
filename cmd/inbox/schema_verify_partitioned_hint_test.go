package main

import (
	"strings"
	"testing"

	"github.com/watermill-inbox/inbox/internal/testdb"
)

// "inbox schema -verify" of a PostgreSQLPartitioned table run without
// -dialect (the DSN says postgres, as for every other command, and "inbox stats"
// and "inbox purge" find the partitioned table by themselves) says how to fix
// the command: the -dialect postgres-partitioned flag. It names no Go Config
// field the shell user does not have, and offers no plain table's DDL "for
// comparison", which would be a table without partitions.
func TestSchemaVerifyOfAPartitionedTableWithoutDialectNamesTheFlag(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	table := "cli_" + testdb.RandomSuffix()
	testdb.DropLater(t, db, table)
	t.Cleanup(func() {
		// Every overload of the table's claim functions (dropping the table leaves them).
		db.Exec(`DO $$DECLARE f regprocedure; BEGIN FOR f IN SELECT oid::regprocedure FROM pg_proc WHERE proname = '` + table + `_claim'
			LOOP EXECUTE 'DROP FUNCTION ' || f::text; END LOOP; END$$`) //nolint:errcheck // best effort
	})
	if code, out, errOut := cli(t, "partitions", "-db", testdb.PostgresDSN(), "-table", table, "-interval", "day"); code != 0 {
		t.Fatalf("partitions -interval day: %d %q %q", code, out, errOut)
	}
	// The table is fine for the partitioned dialect.
	if code, out, errOut := cli(t, "schema", "-db", testdb.PostgresDSN(), "-dialect", "postgres-partitioned", "-table", table, "-verify"); code != 0 {
		t.Fatalf("schema -verify -dialect postgres-partitioned: %d %q %q", code, out, errOut)
	}
	code, out, errOut := cli(t, "schema", "-db", testdb.PostgresDSN(), "-table", table, "-verify")
	msg := out + errOut
	if code == 0 {
		return // verifying it as what it is: nothing to fix
	}
	if !strings.Contains(msg, "-dialect postgres-partitioned") {
		t.Errorf("schema -verify of a partitioned table without -dialect: exit %d, output\n%s\nwant the fix for this command: -dialect postgres-partitioned", code, msg)
	}
	if strings.Contains(msg, "PRIMARY KEY (consumer, message_id)\n") {
		t.Errorf("schema -verify of a partitioned table without -dialect offers the plain table's DDL:\n%s", msg)
	}
}
