package inbox_test

import (
	"context"
	"errors"
	"testing"

	"github.com/watermill-inbox/inbox"
)

// A hand-made SQLite inbox table whose processed_at is declared INTEGER but
// holds text dates (DEFAULT CURRENT_TIMESTAMP, datetime('now')) or fractional
// seconds (unixepoch('subsec')) is refused before use as an incompatible
// table, with the fix that converts the values (sqliteProcessedAtMicros reads
// both), not with a conversion error from reading min/max into an int64,
// which names no problem and offers no fix.
func TestVerifyReportsSQLiteProcessedAtHoldingTextOrRealValuesWithAFix(t *testing.T) {
	t.Parallel()
	for name, value := range map[string]string{
		"text CURRENT_TIMESTAMP": "CURRENT_TIMESTAMP",
		"real unixepoch subsec":  "unixepoch('subsec')",
	} {
		t.Run(name, func(t *testing.T) {
			db := sqliteDB(t)
			ctx := context.Background()
			table := "chk_units_" + randomSuffix()
			exec(t, db, "CREATE TABLE "+table+" (consumer TEXT NOT NULL, message_id TEXT NOT NULL,"+
				" processed_at INTEGER NOT NULL, PRIMARY KEY (consumer, message_id))")
			exec(t, db, "CREATE INDEX "+table+"_processed_at_idx ON "+table+" (processed_at)")
			exec(t, db, "INSERT INTO "+table+" VALUES ('billing', 'a', "+value+")")

			ib, err := inbox.New(inbox.Config{DB: db, Table: table, Consumer: "billing"})
			if err != nil {
				t.Fatal(err)
			}
			err = ib.Verify(ctx)
			if !errors.Is(err, inbox.ErrIncompatibleTable) {
				t.Fatalf("Verify on a processed_at holding %s: %v; want ErrIncompatibleTable with the fix that converts"+
					" the values", value, err)
			}
			applyFixes(t, db, err)
			if err := ib.Verify(ctx); err != nil {
				t.Fatalf("Verify after the fix: %v", err)
			}
		})
	}
}
