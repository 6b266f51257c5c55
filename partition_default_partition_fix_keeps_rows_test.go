package inbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// The fix that every Purger round (and Verify, DropPartitions and
// CreatePartitions) gives for a DEFAULT partition is a script the operator
// runs. On a table whose partitions are not all whole UTC days (a partition
// made by hand from noon to noon, as the docs allow), the DEFAULT partition
// holds rows of a day that such a partition covers in part: the script's
// CREATE of that day's partition fails (42P17) and is skipped by its own
// exception handler, its INSERT of the DEFAULT partition's rows then fails
// (no partition for them), and its DROP TABLE of the DEFAULT partition still
// runs when the script is fed to psql as a file (which goes on after an
// error): every processed row of the DEFAULT partition is gone, and each
// redelivery of those messages is processed again. The recreate script of
// Verify was fixed for exactly this (it leaves the old table for the
// operator to drop once the rows are checked); this one was not.
// After the script, every processed row must still be seen through the
// table (by the claims): a row left behind in a detached table is as good
// as dropped for deduplication.
func TestDefaultPartitionFixNeverDropsTheRowsItCouldNotMove(t *testing.T) {
	t.Parallel()
	db := testdb.OpenPostgres(t, "")
	ctx := context.Background()
	table := "defpart_" + randomSuffix()
	t.Cleanup(func() {
		db.Exec("DROP TABLE IF EXISTS " + table + " CASCADE")
		db.Exec("DROP TABLE IF EXISTS " + table + "_rest CASCADE")
		db.Exec("DROP TABLE IF EXISTS " + table + "_noon CASCADE")
	})
	if err := inbox.InitializePartitions(ctx, db, table, inbox.PartitionDay); err != nil {
		t.Fatal(err)
	}
	day := dbNow(t, db).UTC().Truncate(24*time.Hour).AddDate(0, 0, -3)
	noon := day.Add(12 * time.Hour)
	lit := func(x time.Time) string { return "'" + x.Format("2006-01-02 15:04:05") + "+00'" }
	// A partition made by hand, noon to noon, and a DEFAULT partition.
	exec(t, db, "CREATE TABLE "+table+"_noon PARTITION OF "+table+" FOR VALUES FROM ("+lit(noon)+") TO ("+lit(noon.Add(24*time.Hour))+")")
	exec(t, db, "CREATE TABLE "+table+"_rest PARTITION OF "+table+" DEFAULT")
	// Three rows of that morning land in the DEFAULT partition, one of the
	// afternoon in the hand-made one.
	for i, at := range []time.Time{day.Add(6 * time.Hour), day.Add(7 * time.Hour), day.Add(8 * time.Hour), day.Add(18 * time.Hour)} {
		exec(t, db, "INSERT INTO "+table+" (consumer, message_id, processed_at) VALUES ('billing', $1, "+lit(at)+")", "m"+string(rune('0'+i)))
	}
	if n := count(t, db, table+"_rest", ""); n != 3 {
		t.Fatalf("%d rows in the DEFAULT partition, want 3", n)
	}

	// What a Purger round (and DropPartitions) refuses the table with.
	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Table: table, OlderThan: 30 * 24 * time.Hour}})
	if err != nil {
		t.Fatal(err)
	}
	err = p.RunOnce(ctx).Err
	if !errors.Is(err, inbox.ErrIncompatibleTable) {
		t.Fatalf("Purger round: %v, want ErrIncompatibleTable for the DEFAULT partition", err)
	}
	_, fix, ok := strings.Cut(err.Error(), "; fix: ")
	if !ok {
		t.Fatalf("Purger round: %v: no fix given", err)
	}
	t.Logf("fix given:\n%s", fix)
	// Run as psql runs a file: statement by statement, going on after an
	// error.
	conn, err := db.Connx(ctx) // one session, as psql's
	if err != nil {
		t.Fatal(err)
	}
	for _, stmt := range statements(fix) {
		if _, err := conn.ExecContext(ctx, stmt); err != nil {
			t.Logf("fix statement failed: %v\n%s", err, stmt)
		}
	}
	conn.Close()
	var left int
	if err := db.GetContext(ctx, &left, "SELECT count(*) FROM "+table+" WHERE consumer = 'billing'"); err != nil {
		t.Fatal(err)
	}
	var stillThere bool
	db.GetContext(ctx, &stillThere, "SELECT to_regclass($1) IS NOT NULL", table+"_rest")
	if left != 4 {
		t.Errorf("after the DEFAULT partition's fix script, %d of the 4 processed rows are seen through %s (the DEFAULT partition's table exists: %v);"+
			" want all 4: a row the script could not move must never be dropped", left, table, stillThere)
	}
}
