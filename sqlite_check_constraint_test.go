package inbox_test

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"testing"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// On SQLite, which keeps no catalog of CHECK constraints, the table's SQL
// says whether it has one: a CHECK constraint (which can reject a valid
// message id) is refused with ErrIncompatibleTable, while the letters
// "check" in a name, a quoted identifier, a string or a comment are not one,
// nor a name whose letters Unicode folds to it. A table named checkout_inbox, made by InitializeSchema itself, was refused
// as having a CHECK constraint, and the service could not start on it.
func TestSQLiteCheckConstraintIsFoundByItsKeywordNotItsLetters(t *testing.T) {
	t.Parallel()
	const columns = `consumer TEXT NOT NULL, message_id TEXT NOT NULL, processed_at INTEGER NOT NULL, fingerprint BLOB`
	const key = `PRIMARY KEY (consumer, message_id)) WITHOUT ROWID`
	for _, tc := range []struct {
		name    string
		table   string
		create  string // {t}: the table; "" lets InitializeSchema make it
		refused bool
	}{
		{"made by InitializeSchema, named checkout", "checkout_inbox", "", false},
		{"made by InitializeSchema, named checked", "inbox_checked", "", false},
		{"a column checked_by", "inbox_check_col", `CREATE TABLE {t} (` + columns + `, checked_by TEXT, ` + key, false},
		{"a quoted column named check", "inbox_quoted", `CREATE TABLE {t} (` + columns + `, "check" TEXT, [check2] TEXT, ` + key, false},
		// SQLite matches keywords by ASCII letters; U+212A (the Kelvin
		// sign), which Unicode folds to k, is a letter of a name.
		{"a column chec\u212a", "inbox_kelvin", `CREATE TABLE {t} (` + columns + ", chec\u212a TEXT, " + key, false},
		{"check in a default string and a comment", "inbox_default", `CREATE TABLE {t} (` + columns +
			`, note TEXT DEFAULT 'CHECK (x)', -- CHECK nothing
			/* CHECK (length(message_id) < 40) */ ` + key, false},
		{"a column CHECK", "inbox_column_check", `CREATE TABLE {t} (consumer TEXT NOT NULL, message_id TEXT NOT NULL` +
			` CHECK (length(message_id) < 40), processed_at INTEGER NOT NULL, fingerprint BLOB, ` + key, true},
		{"a table check( in lower case", "inbox_table_check", `CREATE TABLE {t} (` + columns +
			`, check(length(message_id)<40), ` + key, true},
		{"a named constraint", "inbox_named_check", `CREATE TABLE {t} (` + columns +
			`, CONSTRAINT checked_len CHECK (length(message_id) < 40), ` + key, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			db := testdb.OpenSQLite(t, filepath.Join(t.TempDir(), "inbox.db"))
			if tc.create != "" {
				exec(t, db, strings.ReplaceAll(tc.create, "{t}", `"`+tc.table+`"`))
				exec(t, db, `CREATE INDEX "`+tc.table+`_processed_at_idx" ON "`+tc.table+`" (processed_at)`)
			}
			ib, err := inbox.New(inbox.Config{DB: db, Table: tc.table})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { ib.Close() })
			if tc.create == "" {
				if err := ib.InitializeSchema(ctx); err != nil {
					t.Fatalf("InitializeSchema of a new table %s: %v", tc.table, err)
				}
			}
			err = ib.Verify(ctx)
			switch {
			case tc.refused && !errors.Is(err, inbox.ErrIncompatibleTable):
				t.Fatalf("Verify of a table with a CHECK constraint: %v; want ErrIncompatibleTable", err)
			case tc.refused && !strings.Contains(err.Error(), "CHECK constraint"):
				t.Errorf("Verify of a table with a CHECK constraint: %v; want it to name the CHECK constraint", err)
			case !tc.refused && err != nil:
				t.Errorf("Verify of a table without a CHECK constraint: %v", err)
			}
		})
	}
}
