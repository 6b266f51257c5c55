package inbox_test

import (
	"context"
	"errors"
	"testing"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// InitializePartitions, and InitializeSchema under PostgreSQLPartitioned,
// on an existing plain inbox table refuse it with ErrIncompatibleTable and
// create nothing: the claim functions were created beside the plain table
// before its partitions failed, and stayed.
func TestPartitionedSchemaOnAPlainTableCreatesNothing(t *testing.T) {
	t.Parallel()
	db := testdb.OpenPostgres(t, "")
	for name, initialize := range map[string]func(table string) error{
		"InitializePartitions": func(table string) error {
			return inbox.InitializePartitions(context.Background(), db, table, inbox.PartitionDay)
		},
		"InitializeSchema": func(table string) error {
			ib, err := inbox.New(inbox.Config{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table})
			if err != nil {
				t.Fatal(err)
			}
			return ib.InitializeSchema(context.Background())
		},
	} {
		t.Run(name, func(t *testing.T) {
			f := newFixture(t, db)
			f.newInbox(inbox.Config{}) // a plain table
			err := initialize(f.inbox)
			if !errors.Is(err, inbox.ErrIncompatibleTable) {
				t.Errorf("%s on a plain table: %v, want ErrIncompatibleTable", name, err)
			}
			if n := count(t, db, "pg_proc", "proname LIKE $1", f.inbox+"%"); n != 0 {
				t.Errorf("%d functions named after the table left behind", n)
				exec(t, db, "DROP FUNCTION IF EXISTS "+f.inbox+"_claim(text, text, bigint), "+f.inbox+"_claim(text, text, bigint, bytea)")
			}
		})
	}
}
