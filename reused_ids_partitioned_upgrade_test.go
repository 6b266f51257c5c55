package inbox_test

import (
	"context"
	"strings"
	"testing"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A partitioned table made before the fingerprint column, upgraded with
// what AddFingerprintColumnSQL gives (which Verify logs), claims in one
// statement again: the column and the claim function's overload that
// stores it. With the column alone (the upgrade as it was documented),
// every claim took two statements, one round trip more, and nothing said
// so; Verify now logs the CREATE FUNCTION that is missing.
func TestPartitionedTableUpgradedForFingerprintsClaimsInOneStatement(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	ctx := context.Background()
	table := partitionedTable(t, db)
	t.Cleanup(func() {
		db.Exec("DROP FUNCTION IF EXISTS " + table + "_claim(text, text, bigint), " + table + "_claim(text, text, bigint, bytea)")
	})
	// The previous version's table: no fingerprint column, no overload.
	exec(t, db, "DROP FUNCTION "+table+"_claim(text, text, bigint, bytea)")
	exec(t, db, "ALTER TABLE "+table+" DROP COLUMN fingerprint")
	upgrade := inbox.AddFingerprintColumnSQL(inbox.PostgreSQLPartitioned, table)
	if !strings.Contains(upgrade, "CREATE OR REPLACE FUNCTION") {
		t.Fatalf("AddFingerprintColumnSQL on a partitioned table: %q, want the claim function's overload too", upgrade)
	}
	verify := func() captureLogger {
		t.Helper()
		logs := newCaptureLogger()
		ib, err := inbox.New(inbox.Config{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table, Logger: logs})
		if err != nil {
			t.Fatal(err)
		}
		defer ib.Close()
		if err := ib.Verify(ctx); err != nil {
			t.Fatal(err)
		}
		return logs
	}
	if logs := verify(); !logs.has(upgrade) {
		t.Errorf("Verify on the table without the column: logged %v, want the statements that add it: %s", *logs.lines, upgrade)
	}
	// The column alone: the claim function's overload is missing.
	exec(t, db, strings.Split(upgrade, ";\n")[0])
	if logs := verify(); !logs.has("claim function is missing") || !logs.has(`_claim"(text, text, bigint, bytea)`) {
		t.Errorf("Verify with the column and no overload: logged %v, want the CREATE FUNCTION that is missing", *logs.lines)
	}
	for _, stmt := range strings.Split(upgrade, ";\n")[1:] {
		exec(t, db, stmt)
	}
	if logs := verify(); logs.has("claim function") {
		t.Errorf("Verify after the upgrade: logged %v, want the claim function found", *logs.lines)
	}
}
