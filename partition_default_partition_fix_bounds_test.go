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
	table := "defpart_" + randomSuffix()
	t.Cleanup(func() {
		db.Exec("DROP TABLE IF EXISTS " + table + " CASCADE")
		db.Exec("DROP TABLE IF EXISTS " + table + "_rest CASCADE")
		db.Exec("DROP TABLE IF EXISTS " + table + "_p20260715 CASCADE")
	})
	if err := inbox.InitializePartitions(ctx, db, table, inbox.PartitionDay); err != nil {
		t.Fatal(err)
	}
	exec(t, db, "CREATE TABLE "+table+"_rest PARTITION OF "+table+" DEFAULT")
	// Two rows of a summer day that no partition covers.
	exec(t, db, "INSERT INTO "+table+" (consumer, message_id, processed_at) VALUES"+
		" ('billing', 'morning', '2026-07-15 06:00:00+00'), ('billing', 'late', '2026-07-15 23:30:00+00')")

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

	// The operator's session.
	conn, err := db.Connx(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, stmt := range append([]string{"SET DateStyle = 'SQL, DMY'", "SET TimeZone = 'Europe/Dublin'"}, statements(fix)...) {
		if _, err := conn.ExecContext(ctx, stmt); err != nil {
			t.Logf("fix statement failed: %v\n%s", err, stmt)
		}
	}
	conn.Close()

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
