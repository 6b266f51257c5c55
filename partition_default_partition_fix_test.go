package inbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"

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
	table := partitionedTableWithDefault(t, db, "_noon")
	day := dbNow(t, db).UTC().Truncate(24*time.Hour).AddDate(0, 0, -3)
	noon := day.Add(12 * time.Hour)
	lit := func(x time.Time) string { return "'" + x.Format("2006-01-02 15:04:05") + "+00'" }
	// A partition made by hand, noon to noon, beside the DEFAULT partition.
	exec(t, db, "CREATE TABLE "+table+"_noon PARTITION OF "+table+" FOR VALUES FROM ("+lit(noon)+") TO ("+lit(noon.Add(24*time.Hour))+")")
	// Three rows of that morning land in the DEFAULT partition, one of the
	// afternoon in the hand-made one.
	for i, at := range []time.Time{day.Add(6 * time.Hour), day.Add(7 * time.Hour), day.Add(8 * time.Hour), day.Add(18 * time.Hour)} {
		exec(t, db, "INSERT INTO "+table+" (consumer, message_id, processed_at) VALUES ('billing', $1, "+lit(at)+")", "m"+string(rune('0'+i)))
	}
	if n := count(t, db, table+"_rest", ""); n != 3 {
		t.Fatalf("%d rows in the DEFAULT partition, want 3", n)
	}
	// Run as psql runs a file: statement by statement, going on after an
	// error, in one session.
	runDefaultPartitionFix(t, db, defaultPartitionFix(t, db, table))
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

// The DEFAULT partition's fix script makes a partition for each UTC day its
// rows are of, writing the bounds with format('%L', <timestamptz>): that is
// the timestamptz as text in the session's DateStyle and TimeZone, read back
// by CREATE TABLE ... FOR VALUES in the same session. With DateStyle SQL and
// TimeZone Europe/Dublin (an operator's psql, a role's settings) a summer
// bound is written '15/07/2026 01:00:00 IST' and read back through
// timezone_abbreviations as Israel's +02: the day's partition starts and
// ends an hour early, its last hour's rows have no partition (the INSERT
// that moves them fails) and the day before overlaps it. The library reads
// partition bounds with DateStyle ISO and TimeZone UTC for exactly this
// reason (TestPartitionBoundsMeanTheSameInEverySessionTimeZone); the script
// it hands the operator does not. The partition must cover the UTC day,
// whatever the session that runs the script.
func TestDefaultPartitionFixMakesUTCDaysWhateverTheSessionsDateStyle(t *testing.T) {
	t.Parallel()
	db := testdb.OpenPostgres(t, "")
	ctx := context.Background()
	table := partitionedTableWithDefault(t, db, "_p20260715")
	// Two rows of a summer day that no partition covers.
	exec(t, db, "INSERT INTO "+table+" (consumer, message_id, processed_at) VALUES"+
		" ('billing', 'morning', '2026-07-15 06:00:00+00'), ('billing', 'late', '2026-07-15 23:30:00+00')")
	// The operator's session.
	runDefaultPartitionFix(t, db, defaultPartitionFix(t, db, table), "SET DateStyle = 'SQL, DMY'", "SET TimeZone = 'Europe/Dublin'")

	read, err := db.Connx(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer read.Close()
	exec1 := func(q string) {
		if _, err := read.ExecContext(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	exec1("SET DateStyle = 'ISO'")
	exec1("SET TimeZone = 'UTC'")
	var bounds []string
	if err := read.SelectContext(ctx, &bounds, "SELECT pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"+
		" WHERE i.inhparent = to_regclass($1) AND pg_get_expr(c.relpartbound, c.oid) LIKE '%2026-07-1%'", table); err != nil {
		t.Fatal(err)
	}
	want := "FOR VALUES FROM ('2026-07-15 00:00:00+00') TO ('2026-07-16 00:00:00+00')"
	if len(bounds) != 1 || bounds[0] != want {
		t.Errorf("the fix script, run in a session with DateStyle SQL and TimeZone Europe/Dublin, made the partitions %q"+
			" (in UTC) for the rows of 2026-07-15; want exactly %q", bounds, want)
	}
}

// partitionedTableWithDefault makes a daily partitioned inbox table (a new
// name) with a DEFAULT partition <table>_rest, and drops them, and the
// table <table><extra> a test makes, when the test ends.
func partitionedTableWithDefault(t *testing.T, db *sqlx.DB, extra string) string {
	t.Helper()
	table := "defpart_" + randomSuffix()
	t.Cleanup(func() {
		db.Exec("DROP TABLE IF EXISTS " + table + " CASCADE")
		db.Exec("DROP TABLE IF EXISTS " + table + "_rest CASCADE")
		db.Exec("DROP TABLE IF EXISTS " + table + extra + " CASCADE")
	})
	if err := inbox.InitializePartitions(context.Background(), db, table, inbox.PartitionDay); err != nil {
		t.Fatal(err)
	}
	exec(t, db, "CREATE TABLE "+table+"_rest PARTITION OF "+table+" DEFAULT")
	return table
}

// defaultPartitionFix returns the fix a Purger round gives for table's
// DEFAULT partition, failing the test unless the round refuses the table
// with ErrIncompatibleTable and a fix.
func defaultPartitionFix(t *testing.T, db *sqlx.DB, table string) string {
	t.Helper()
	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Table: table, OlderThan: 30 * 24 * time.Hour}})
	if err != nil {
		t.Fatal(err)
	}
	err = p.RunOnce(context.Background()).Err
	if !errors.Is(err, inbox.ErrIncompatibleTable) {
		t.Fatalf("Purger round: %v, want ErrIncompatibleTable for the DEFAULT partition", err)
	}
	_, fix, ok := strings.Cut(err.Error(), "; fix: ")
	if !ok {
		t.Fatalf("Purger round: %v: no fix given", err)
	}
	return fix
}

// runDefaultPartitionFix runs the settings, then the fix, statement by
// statement in one session, going on after an error, as psql runs a file.
func runDefaultPartitionFix(t *testing.T, db *sqlx.DB, fix string, settings ...string) {
	t.Helper()
	ctx := context.Background()
	conn, err := db.Connx(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	for _, stmt := range append(settings, statements(fix)...) {
		if _, err := conn.ExecContext(ctx, stmt); err != nil {
			t.Logf("fix statement failed: %v\n%s", err, stmt)
		}
	}
}
