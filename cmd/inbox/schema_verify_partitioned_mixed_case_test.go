package main

import (
	"testing"

	"github.com/watermill-inbox/inbox/internal/testdb"
)

// "inbox schema -verify" without -dialect finds a PostgreSQLPartitioned
// table whatever the case of its name: the library quotes -table, so
// "Cli_Inbox" is a table of that spelling, and the command looks that one
// up (as "inbox partitions" does), not cli_inbox, which to_regclass folds
// an unquoted name to.
func TestSchemaVerifyFindsAPartitionedTableWithAMixedCaseName(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	for _, prefix := range []string{"cli_cli_", "Cli_Cli_"} {
		t.Run(prefix, func(t *testing.T) {
			table := prefix + testdb.RandomSuffix()
			testdb.DropLater(t, db, `"`+table+`"`)
			t.Cleanup(func() {
				db.Exec(`DO $$DECLARE f regprocedure; BEGIN FOR f IN SELECT oid::regprocedure FROM pg_proc WHERE proname = '` + table + `_claim'
					LOOP EXECUTE 'DROP FUNCTION ' || f::text; END LOOP; END$$`) //nolint:errcheck // best effort
			})
			if code, out, errOut := cli(t, "partitions", "-db", testdb.PostgresDSN(), "-table", table, "-interval", "day"); code != 0 {
				t.Fatalf("partitions -interval day: %d %q %q", code, out, errOut)
			}
			if code, out, errOut := cli(t, "schema", "-db", testdb.PostgresDSN(), "-dialect", "postgres-partitioned", "-table", table, "-verify"); code != 0 {
				t.Fatalf("schema -verify -dialect postgres-partitioned: %d %q %q", code, out, errOut)
			}
			if code, out, errOut := cli(t, "schema", "-db", testdb.PostgresDSN(), "-table", table, "-verify"); code != 0 {
				t.Errorf("schema -verify -table %s (partitioned) without -dialect: exit %d, stdout %q, stderr %.400q; want exit 0,"+
					" the table found partitioned as with -dialect postgres-partitioned", table, code, out, errOut)
			}
		})
	}
}
