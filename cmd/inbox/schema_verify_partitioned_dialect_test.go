package main

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// An operator checks the table a migration made with the command the README
// gives, "inbox schema -db $DATABASE_URL -verify". On a partitioned table it
// answered "verified" (exit 0) and no more, yet the service configured as the
// README shows, inbox.New(inbox.Config{DB: db, Table: T}) (the dialect
// inferred from the driver: PostgreSQL, never PostgreSQLPartitioned), refuses
// the very same table with ErrIncompatibleTable at startup: a deploy gated on
// the check passed, and the service did not start. The output says that
// Config.Dialect must be inbox.PostgreSQLPartitioned.
func TestSchemaVerifyOfAPartitionedTableSaysTheServiceNeedsThePartitionedDialect(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	table := "cli_partitioned_" + testdb.RandomSuffix()
	testdb.DropLater(t, db, table)
	t.Cleanup(func() {
		db.Exec(`DO $$DECLARE f regprocedure; BEGIN FOR f IN SELECT oid::regprocedure FROM pg_proc WHERE proname = '` + table + `_claim'
			LOOP EXECUTE 'DROP FUNCTION ' || f::text; END LOOP; END$$`) //nolint:errcheck // best effort
	})
	if code, out, errOut := cli(t, "schema", "-db", testdb.PostgresDSN(), "-dialect", "postgres-partitioned", "-table", table, "-apply"); code != 0 {
		t.Fatalf("schema -apply -dialect postgres-partitioned: %d %q %q", code, out, errOut)
	}

	// What the service does, as the README shows it.
	ib, err := inbox.New(inbox.Config{DB: db, Table: table})
	if err != nil {
		t.Fatal(err)
	}
	serviceErr := ib.InitializeSchema(context.Background())
	if !errors.Is(serviceErr, inbox.ErrIncompatibleTable) {
		t.Skipf("the default configuration accepts the partitioned table (%v): nothing to warn about", serviceErr)
	}

	code, out, errOut := cli(t, "schema", "-db", testdb.PostgresDSN(), "-table", table, "-verify")
	msg := out + errOut
	if code == 0 && !strings.Contains(msg, "PostgreSQLPartitioned") {
		t.Errorf("inbox schema -verify of a partitioned table: exit 0 with\n%s\nwhile inbox.New(inbox.Config{DB: db, Table: %q}) refuses it at startup:\n%v\nwant the verify output to say the service needs Config.Dialect = inbox.PostgreSQLPartitioned",
			msg, table, firstLineOf(serviceErr.Error(), 300))
	}
}
