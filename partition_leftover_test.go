package inbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// DropPartitions drops any range partition past the window by its bounds,
// whatever its name: pg_partman 4.x names daily partitions
// <parent>_pYYYY_MM_DD, and hand-made ones may be named anything. One left
// detached by an interrupted call (a crash, a DROP that failed) was found
// again only when named as the library names its own and a plain table:
// never dropped, and never attached back when the window grew, its rows
// inside the window unseen by claims (a redelivery processed again).

// partmanLeftover creates, on a daily partitioned inbox table, the
// partition of 2026-10-05 under pg_partman 4.x's name, holding one row of
// consumer c, message m1, and returns the table and the partition.
func partmanLeftover(t *testing.T, db *sqlx.DB) (table, part string) {
	t.Helper()
	table = dailyPartitionedTable(t, db)
	part = table + "_p2026_10_05"
	t.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + part + " CASCADE") })
	exec(t, db, "CREATE TABLE "+part+" PARTITION OF "+table+" FOR VALUES FROM ('2026-10-05 00:00:00Z') TO ('2026-10-06 00:00:00Z')")
	exec(t, db, "INSERT INTO "+table+" VALUES ('c', 'm1', '2026-10-05 12:00:00Z')")
	return table, part
}

// leaveDetached does to part what a DropPartitions interrupted between its
// DETACH and its DROP leaves: marked (with mark), then detached.
func leaveDetached(t *testing.T, db *sqlx.DB, table, part, mark string) {
	t.Helper()
	exec(t, db, "COMMENT ON TABLE "+part+" IS '"+mark+"'")
	exec(t, db, "ALTER TABLE "+table+" DETACH PARTITION "+part)
}

// windowReaching returns a window that holds 2026-10-05 12:00 UTC, with 30
// days to spare, on the database's clock.
func windowReaching(t *testing.T, db *sqlx.DB) time.Duration {
	t.Helper()
	return dbNow(t, db).Sub(time.Date(2026, 10, 5, 12, 0, 0, 0, time.UTC)) + 30*day
}

// fixedWindowRound runs one Purger round over table with a fixed window.
func fixedWindowRound(t *testing.T, db *sqlx.DB, table string, window time.Duration) inbox.PurgeRound {
	t.Helper()
	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Table: table, Window: inbox.FixedWindow(window)}})
	if err != nil {
		t.Fatal(err)
	}
	return p.RunOnce(context.Background())
}

var october5 = [2]time.Time{time.Date(2026, 10, 5, 0, 0, 0, 0, time.UTC), time.Date(2026, 10, 6, 0, 0, 0, 0, time.UTC)}

func TestPartitionWithAnotherNameLeftDetachedByAFailedDropIsAttachedBackWhenTheWindowGrew(t *testing.T) {
	t.Parallel()
	db := testdb.OpenPostgres(t, "")
	table, part := partmanLeftover(t, db)
	// Someone's view over the partition: the round's DROP fails (2BP01)
	// after its DETACH, and leaves it detached and marked.
	exec(t, db, "CREATE VIEW "+table+"_v AS SELECT * FROM "+part)
	t.Cleanup(func() { db.Exec("DROP VIEW IF EXISTS " + table + "_v") })
	if r := fixedWindowRound(t, db, table, 2*day); r.Err == nil {
		t.Fatalf("first round (2 days): dropped %v and no error; want its DROP refused for the view", r.DroppedPartitions)
	}
	exec(t, db, "DROP VIEW "+table+"_v")
	if r := fixedWindowRound(t, db, table, windowReaching(t, db)); r.Err != nil || len(r.DroppedPartitions) != 0 {
		t.Fatalf("second round (the window grown): dropped %v, err %v; want nothing dropped, no error", r.DroppedPartitions, r.Err)
	}
	if n := count(t, db, table, "consumer = 'c' AND message_id = 'm1'"); n != 1 {
		t.Errorf("the row of m1, inside the window, is seen %d times through %s, want 1: a redelivery of m1 would be processed again", n, table)
	}
}

func TestLeftoverPartitionWithAnotherNameIsAttachedBackForItsOwnRange(t *testing.T) {
	t.Parallel()
	db := testdb.OpenPostgres(t, "")
	table, part := partmanLeftover(t, db)
	leaveDetached(t, db, table, part, inbox.DetachedPartitionMark("public."+table, october5[0], october5[1]))
	if r := fixedWindowRound(t, db, table, windowReaching(t, db)); r.Err != nil {
		t.Fatalf("round: %v", r.Err)
	}
	if n := count(t, db, table, "consumer = 'c' AND message_id = 'm1'"); n != 1 {
		t.Errorf("the row of m1, inside the window, is seen %d times through %s, want 1", n, table)
	}
	var bound string
	if err := db.Get(&bound, "SELECT COALESCE((SELECT pg_get_expr(c.relpartbound, c.oid) FROM pg_class c WHERE c.oid = to_regclass($1) AND c.relispartition), '')", part); err != nil {
		t.Fatal(err)
	}
	var want string
	if err := db.Get(&want, "SELECT format('FOR VALUES FROM (%L) TO (%L)', '2026-10-05 00:00:00Z'::timestamptz, '2026-10-06 00:00:00Z'::timestamptz)"); err != nil {
		t.Fatal(err)
	}
	if bound != want {
		t.Errorf("%s attached with bound %q, want %q (the range it had)", part, bound, want)
	}
}

func TestLeftoverPartitionWithAnotherNameIsDroppedOncePastTheWindow(t *testing.T) {
	t.Parallel()
	db := testdb.OpenPostgres(t, "")
	table, part := partmanLeftover(t, db)
	leaveDetached(t, db, table, part, inbox.DetachedPartitionMark("public."+table, october5[0], october5[1]))
	dropped, err := inbox.DropPartitions(context.Background(), db, table, 2*day, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(dropped) != 1 || dropped[0].Name != "public."+part || dropped[0].Rows != 1 {
		t.Errorf("dropped %v, want public.%s with its 1 row", dropped, part)
	}
	var exists bool
	if err := db.Get(&exists, "SELECT to_regclass($1) IS NOT NULL", part); err != nil {
		t.Fatal(err)
	}
	if exists {
		t.Errorf("%s, left detached past the window, is still there", part)
	}
}

func TestSubpartitionedLeftoverIsAttachedBackWhenTheWindowGrew(t *testing.T) {
	t.Parallel()
	db := testdb.OpenPostgres(t, "")
	table := dailyPartitionedTable(t, db)
	part := table + "_p20261005"
	t.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + part + " CASCADE") })
	exec(t, db, "CREATE TABLE "+part+" PARTITION OF "+table+" FOR VALUES FROM ('2026-10-05 00:00:00Z') TO ('2026-10-06 00:00:00Z') PARTITION BY HASH (consumer)")
	exec(t, db, "CREATE TABLE "+part+"_h0 PARTITION OF "+part+" FOR VALUES WITH (MODULUS 1, REMAINDER 0)")
	exec(t, db, "INSERT INTO "+table+" VALUES ('c', 'm1', '2026-10-05 12:00:00Z')")
	leaveDetached(t, db, table, part, inbox.DetachedPartitionMark("public."+table, october5[0], october5[1]))
	if r := fixedWindowRound(t, db, table, windowReaching(t, db)); r.Err != nil {
		t.Fatalf("round: %v", r.Err)
	}
	if n := count(t, db, table, "consumer = 'c' AND message_id = 'm1'"); n != 1 {
		t.Errorf("the row of m1, inside the window, is seen %d times through %s, want 1", n, table)
	}
}

// A partition with a name not of the library, left detached by the
// version before (whose mark does not hold the range), cannot be attached
// back for a range the library can tell: the round says so, with the
// statements that do it by hand, and drops nothing of it.
func TestLeftoverWithAnotherNameAndNoRangeInItsMarkIsReported(t *testing.T) {
	t.Parallel()
	db := testdb.OpenPostgres(t, "")
	table, part := partmanLeftover(t, db)
	leaveDetached(t, db, table, part, inbox.DetachedPartitionMarkWithoutRange("public."+table))
	r := fixedWindowRound(t, db, table, windowReaching(t, db))
	if !errors.Is(r.Err, inbox.ErrIncompatibleTable) || len(r.DroppedPartitions) != 0 {
		t.Fatalf("round: dropped %v, err %v; want nothing dropped and ErrIncompatibleTable saying to attach %s by hand", r.DroppedPartitions, r.Err, part)
	}
	if n := count(t, db, part, "message_id = 'm1'"); n != 1 {
		t.Errorf("the row of m1 in %s: %d, want 1", part, n)
	}
}

// The mark of earlier versions, the comment alone, does not say whose
// leftover a table is: only a table named as the library names the inbox
// table's partitions is taken for its own, and another inbox table's
// leftover in the same schema is left to it.
func TestLeftoverWithTheBareMarkOfEarlierVersionsIsLeftToItsOwnTable(t *testing.T) {
	t.Parallel()
	db := testdb.OpenPostgres(t, "")
	mine, theirs := dailyPartitionedTable(t, db), dailyPartitionedTable(t, db)
	if err := inbox.CreatePartitions(context.Background(), db, theirs, october5[0], 1); err != nil {
		t.Fatal(err)
	}
	left := theirs + "_p20261005"
	t.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + left) })
	exec(t, db, "INSERT INTO "+theirs+" VALUES ('c', 'm1', '2026-10-05 12:00:00Z')")
	leaveDetached(t, db, theirs, left, inbox.DetachedPartitionComment)

	if r := fixedWindowRound(t, db, mine, 2*day); r.Err != nil || len(r.DroppedPartitions) != 0 {
		t.Fatalf("%s's round: dropped %v, err %v; want nothing of %s's dropped", mine, r.DroppedPartitions, r.Err, theirs)
	}
	if r := fixedWindowRound(t, db, mine, windowReaching(t, db)); r.Err != nil {
		t.Fatalf("%s's round with a longer window: %v", mine, r.Err)
	}
	if n := count(t, db, left, "message_id = 'm1'"); n != 1 {
		t.Fatalf("%s's leftover holds %d rows of m1 after %s's rounds, want 1", theirs, n, mine)
	}
	if n := count(t, db, mine, "message_id = 'm1'"); n != 0 {
		t.Errorf("%s's leftover was attached to %s", theirs, mine)
	}
	if r := fixedWindowRound(t, db, theirs, windowReaching(t, db)); r.Err != nil {
		t.Fatalf("%s's round: %v", theirs, r.Err)
	}
	if n := count(t, db, theirs, "message_id = 'm1'"); n != 1 {
		t.Errorf("%s's row of m1, inside its window, is seen %d times through it, want 1", theirs, n)
	}
}
