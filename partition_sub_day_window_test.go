package inbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A Purger round under a window shorter than a day drops a partition once:
// yesterday's partition, dropped as entirely past the window, is not made
// again by the next round only to be detached and dropped again. Each such
// DETACH ... CONCURRENTLY waits for every transaction that began before it,
// so one left open (a long handler, a report, pg_dump) failed every round
// although nothing was left to purge.
func TestPartitionedPurgerUnderADayWindowDropsAPartitionOnce(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	ctx := context.Background()
	if now := dbNow(t, db).UTC(); now.Sub(now.Truncate(24*time.Hour)) < 5*time.Minute {
		t.Skip("within 5 minutes of midnight UTC, yesterday is still inside the 1m window")
	}
	table := dailyPartitionedTable(t, db)
	t.Cleanup(func() {
		// A partition left pending detach by a failed round outlives its table.
		db.Exec(`DO $$DECLARE r regclass; BEGIN FOR r IN SELECT oid::regclass FROM pg_class WHERE relkind = 'r' AND relname LIKE '` +
			table + `\_%' LOOP EXECUTE 'DROP TABLE IF EXISTS ' || r::text; END LOOP; END$$`) //nolint:errcheck // best effort
	})
	defer inbox.SetDetachWait(inbox.SetDetachWait(2 * time.Second))
	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{
		DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table, Window: inbox.FixedWindow(time.Minute),
	}})
	if err != nil {
		t.Fatal(err)
	}
	first := p.RunOnce(ctx)
	if first.Err != nil || len(first.DroppedPartitions) != 1 {
		t.Fatalf("first round: dropped %v, err %v; want yesterday's partition dropped", first.DroppedPartitions, first.Err)
	}

	// A transaction that read the table and stays open, as a long handler's.
	tx, err := db.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback() //nolint:errcheck // read only
	var n int
	if err := tx.Get(&n, "SELECT count(*) FROM "+table); err != nil {
		t.Fatal(err)
	}
	for i := 2; i <= 3; i++ {
		r := p.RunOnce(ctx)
		if r.Err != nil || len(r.DroppedPartitions) != 0 {
			t.Errorf("round %d after a round that dropped %v: dropped %v, err %v; want nothing dropped and no error"+
				" (no partition was left past the 1m window)", i, first.DroppedPartitions, r.DroppedPartitions, r.Err)
		}
	}
	for _, name := range partitionNames(t, db, table) {
		if name == first.DroppedPartitions[0] {
			t.Errorf("partition %s, entirely past the window, was made again", name)
		}
	}
}
