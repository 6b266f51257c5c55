package inbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// An unqualified table: the parent is found through search_path, but the
// partitions are created in the first schema of search_path, and
// listPartitions looks only in the parent's schema. With a search_path
// whose first schema is not the parent's (e.g. the default "$user", public
// once a schema named after the role exists), DropPartitions never sees a
// partition: expired rows are never removed and OldestAge reports 0.
func TestReviewPartitionsOutsideParentSchema(t *testing.T) {
	admin := testdb.OpenPostgres(t, "")
	sfx := randomSuffix()
	schema, table := "brk_"+sfx, "inbox_"+sfx
	exec(t, admin, "CREATE SCHEMA "+schema)
	t.Cleanup(func() {
		admin.Exec("DROP SCHEMA " + schema + " CASCADE")
		admin.Exec("DROP TABLE IF EXISTS public." + table + " CASCADE")
	})
	ddl, _ := inbox.SchemaSQL(inbox.PostgreSQLPartitioned, "public."+table) // applied by migrations
	for _, s := range statements(ddl) {
		exec(t, admin, s)
	}
	db := testdb.OpenPostgres(t, "search_path="+schema+",public")
	ib, err := inbox.New(inbox.Config{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := ib.InitializeSchema(ctx); err != nil {
		t.Fatal(err)
	}
	if err := inbox.CreatePartitions(ctx, db, table, dbNow(t, db).AddDate(0, 0, -5), 3); err != nil {
		t.Fatal(err)
	}
	exec(t, db, "INSERT INTO "+table+" VALUES ('billing', 'old', now() - interval '4 days')")
	dropped, err := inbox.DropPartitions(ctx, db, table, 48*time.Hour, nil)
	p, _ := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table, OlderThan: 48 * time.Hour}})
	round := p.RunOnce(ctx)
	var where string
	admin.Get(&where, "SELECT relnamespace::regnamespace::text FROM pg_class WHERE relname = $1", table+dbNow(t, db).UTC().Format("_p20060102"))
	if left := count(t, db, table, "processed_at < now() - interval '3 days'"); left != 0 {
		t.Errorf("DropPartitions dropped %v (err %v), purger round dropped %v (oldest age %v); %d expired row(s) left; partitions live in schema %q, parent in public",
			dropped, err, round.DroppedPartitions, round.OldestAge, left, where)
	}
}
