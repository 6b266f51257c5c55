package inbox_test

// A purge deletes a row only when it is provably past the window, whatever
// the table's shape and whatever tool made its partitions: partitions go by
// the bounds the catalog holds, not by their names; tables the purge cannot
// maintain are refused loudly; row batches reach no other table's rows.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

const day = 24 * time.Hour

// A partition named like a daily one ("<table>_pYYYYMMDD", as pg_partman
// names its partitions whatever their interval) that really covers three
// weeks up to tomorrow keeps its row claimed a minute ago through
// DropPartitions and Purger rounds of either dialect; an older hand-made
// partition whose real upper bound is past the window is dropped.
func TestDropPartitionsGoesByTheCatalogsBoundsNotTheName(t *testing.T) {
	t.Parallel()
	db := testdb.OpenPostgres(t, "")
	ctx := context.Background()
	table := partitionedTable(t, db)
	now := dbNow(t, db).UTC()
	wide := table + "_p" + now.AddDate(0, 0, -20).Format("20060102")
	monthly := table + "_p" + now.AddDate(0, 0, -60).Format("20060102")
	exec(t, db, "CREATE TABLE "+monthly+" PARTITION OF "+table+
		" FOR VALUES FROM (date_trunc('day', now() - interval '60 days', 'UTC')) TO (date_trunc('day', now() - interval '20 days', 'UTC'))")
	exec(t, db, "CREATE TABLE "+wide+" PARTITION OF "+table+
		" FOR VALUES FROM (date_trunc('day', now() - interval '20 days', 'UTC')) TO (date_trunc('day', now() + interval '1 day', 'UTC'))")
	exec(t, db, "INSERT INTO "+table+" VALUES ('billing', 'recent', now() - interval '1 minute'), ('billing', 'old', now() - interval '40 days')")

	ib, err := inbox.New(inbox.Config{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table})
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.Verify(ctx); err != nil {
		t.Errorf("Verify: %v, want a table with hand-made range partitions accepted", err)
	}
	dropped, err := inbox.DropPartitions(ctx, db, table, 7*day, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(dropped) != 1 || dropped[0].Name != "public."+monthly || dropped[0].Rows != 1 {
		t.Errorf("dropped %+v, want only %s with its one row", dropped, monthly)
	}
	for _, d := range []inbox.Dialect{nil, inbox.PostgreSQLPartitioned} {
		p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Dialect: d, Table: table, OlderThan: 7 * day}})
		if err != nil {
			t.Fatal(err)
		}
		if round := p.RunOnce(ctx); round.Err != nil || round.Deleted != 0 {
			t.Errorf("Purger round (dialect %v): %+v, want nothing deleted", d, round)
		}
	}
	if n := count(t, db, table, "message_id = 'recent'"); n != 1 {
		t.Errorf("the row claimed a minute ago: %d left, want 1", n)
	}
	// The rounds fill the days after the wide partition.
	if gaps := uncovered(t, db, table, 0, inbox.DefaultPartitionsAhead); len(gaps) > 0 {
		t.Errorf("days without a partition after the rounds: %v", gaps)
	}
}

// A DEFAULT partition stops DETACH ... CONCURRENTLY and, once it holds rows,
// the creation of partitions: Verify, DropPartitions, CreatePartitions and
// a Purger round refuse the table with ErrIncompatibleTable and the fix,
// and delete nothing.
func TestPartitionedTableWithADefaultPartitionIsRefused(t *testing.T) {
	t.Parallel()
	db := testdb.OpenPostgres(t, "")
	ctx := context.Background()
	table := dailyPartitionedTable(t, db)
	if err := inbox.CreatePartitions(ctx, db, table, dbNow(t, db).AddDate(0, 0, -9), 9); err != nil {
		t.Fatal(err)
	}
	exec(t, db, "CREATE TABLE "+table+"_rest PARTITION OF "+table+" DEFAULT")
	exec(t, db, "INSERT INTO "+table+" VALUES ('billing', 'old', now() - interval '5 days'), ('billing', 'far', now() + interval '60 days')")

	ib, err := inbox.New(inbox.Config{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table})
	if err != nil {
		t.Fatal(err)
	}
	refused := func(what string, err error) {
		t.Helper()
		if !errors.Is(err, inbox.ErrIncompatibleTable) || !strings.Contains(err.Error(), "DETACH PARTITION") {
			t.Errorf("%s: %v, want ErrIncompatibleTable naming the DEFAULT partition and how to detach it", what, err)
		}
	}
	refused("Verify", ib.Verify(ctx))
	_, err = inbox.DropPartitions(ctx, db, table, 2*day, nil)
	refused("DropPartitions", err)
	refused("CreatePartitions", inbox.CreatePartitions(ctx, db, table, dbNow(t, db), 30))
	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Table: table, OlderThan: 2 * day}})
	if err != nil {
		t.Fatal(err)
	}
	refused("Purger round", p.RunOnce(ctx).Err)
	if n := count(t, db, table, ""); n != 2 {
		t.Errorf("rows left: %d, want 2", n)
	}
}

// A partitioned table whose bounds say nothing of processed_at: keyed by
// another column, by an expression, or by a processed_at of type timestamp
// (wall-clock bounds, which the catalog read in UTC moves by the zone's
// offset). Verify, DropPartitions, CreatePartitions and Purger rounds of
// either dialect refuse it with ErrIncompatibleTable, and the row
// processed a moment ago stays: DropPartitions and the rounds dropped its
// partition.
func TestPartitionedTableKeyedByAnythingButProcessedAtTimestamptzIsRefused(t *testing.T) {
	t.Parallel()
	db := testdb.OpenPostgres(t, "")
	ctx := context.Background()
	cases := []struct {
		name  string
		setup func(table string)
	}{
		{"another timestamptz column", func(table string) {
			exec(t, db, "CREATE TABLE "+table+` (consumer text COLLATE "C" NOT NULL, message_id text COLLATE "C" NOT NULL,
				processed_at timestamptz NOT NULL DEFAULT now(), filed_at timestamptz NOT NULL DEFAULT now() - interval '60 days',
				PRIMARY KEY (consumer, message_id, filed_at)) PARTITION BY RANGE (filed_at)`)
			exec(t, db, "CREATE TABLE "+table+"_p20000101 PARTITION OF "+table+
				" FOR VALUES FROM (now() - interval '90 days') TO (now() - interval '30 days')")
			exec(t, db, "INSERT INTO "+table+" (consumer, message_id) VALUES ('billing', 'recent')")
		}},
		{"an expression", func(table string) {
			// processed_at's wall-clock time 12 hours behind UTC.
			exec(t, db, "CREATE TABLE "+table+` (consumer text COLLATE "C" NOT NULL, message_id text COLLATE "C" NOT NULL,
				processed_at timestamptz NOT NULL DEFAULT now()) PARTITION BY RANGE ((processed_at AT TIME ZONE 'Etc/GMT+12'))`)
			exec(t, db, "DO $$BEGIN EXECUTE format('CREATE TABLE "+table+"_p20000101 PARTITION OF "+table+
				" FOR VALUES FROM (%L) TO (%L)', now() AT TIME ZONE 'Etc/GMT+12' - interval '1 hour', now() AT TIME ZONE 'Etc/GMT+12' + interval '1 hour'); END$$")
			exec(t, db, "INSERT INTO "+table+" (consumer, message_id) VALUES ('billing', 'recent')")
		}},
		{"a reversed operator class", func(table string) {
			// A btree operator class that sorts timestamptz backwards: FROM
			// is then the later bound, and TO, 30 days ago, is not the
			// partition's latest time.
			ops, cmp := table+"_rev_ops", table+"_rev_cmp"
			t.Cleanup(func() {
				db.Exec("DROP OPERATOR FAMILY IF EXISTS " + ops + " USING btree CASCADE")
				db.Exec("DROP FUNCTION IF EXISTS " + cmp + "(timestamptz, timestamptz)")
			})
			exec(t, db, "CREATE FUNCTION "+cmp+"(timestamptz, timestamptz) RETURNS int LANGUAGE sql IMMUTABLE STRICT AS 'SELECT timestamptz_cmp($2, $1)'")
			exec(t, db, "CREATE OPERATOR CLASS "+ops+" FOR TYPE timestamptz USING btree AS"+
				" OPERATOR 1 >, OPERATOR 2 >=, OPERATOR 3 =, OPERATOR 4 <=, OPERATOR 5 <, FUNCTION 1 "+cmp+"(timestamptz, timestamptz)")
			exec(t, db, "CREATE TABLE "+table+` (consumer text COLLATE "C" NOT NULL, message_id text COLLATE "C" NOT NULL,
				processed_at timestamptz NOT NULL DEFAULT now()) PARTITION BY RANGE (processed_at `+ops+`)`)
			exec(t, db, "DO $$BEGIN EXECUTE format('CREATE TABLE "+table+"_p20000101 PARTITION OF "+table+
				" FOR VALUES FROM (%L) TO (%L)', now() + interval '1 hour', now() - interval '30 days'); END$$")
			exec(t, db, "INSERT INTO "+table+" (consumer, message_id) VALUES ('billing', 'recent')")
		}},
		{"processed_at timestamp without time zone", func(table string) {
			exec(t, db, "CREATE TABLE "+table+` (consumer text COLLATE "C" NOT NULL, message_id text COLLATE "C" NOT NULL,
				processed_at timestamp NOT NULL, PRIMARY KEY (consumer, message_id, processed_at)) PARTITION BY RANGE (processed_at)`)
			// Made and written by sessions 12 hours behind UTC: the bounds
			// are their wall-clock times.
			tx, err := db.BeginTxx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback()
			for _, stmt := range []string{
				"SET LOCAL TimeZone = 'Etc/GMT+12'",
				"DO $$BEGIN EXECUTE format('CREATE TABLE " + table + "_p20000101 PARTITION OF " + table +
					" FOR VALUES FROM (%L) TO (%L)', localtimestamp - interval '1 hour', localtimestamp + interval '1 hour'); END$$",
				"INSERT INTO " + table + " VALUES ('billing', 'recent', localtimestamp)",
			} {
				if _, err := tx.ExecContext(ctx, stmt); err != nil {
					t.Fatalf("%s: %v", stmt, err)
				}
			}
			if err := tx.Commit(); err != nil {
				t.Fatal(err)
			}
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			table := "inbox_" + randomSuffix()
			t.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + table + " CASCADE") })
			c.setup(table)
			refused := func(what string, err error) {
				t.Helper()
				if !errors.Is(err, inbox.ErrIncompatibleTable) {
					t.Errorf("%s: %v, want ErrIncompatibleTable", what, err)
				}
			}
			ib, err := inbox.New(inbox.Config{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table})
			if err != nil {
				t.Fatal(err)
			}
			refused("Verify", ib.Verify(ctx))
			_, err = inbox.DropPartitions(ctx, db, table, 10*time.Hour, nil)
			refused("DropPartitions", err)
			refused("CreatePartitions", inbox.CreatePartitions(ctx, db, table, dbNow(t, db), 3))
			for _, d := range []inbox.Dialect{nil, inbox.PostgreSQLPartitioned} {
				p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Dialect: d, Table: table,
					Window: inbox.FixedWindow(10 * time.Hour)}})
				if err != nil {
					t.Fatal(err)
				}
				refused(fmt.Sprintf("Purger round (dialect %v)", d), p.RunOnce(ctx).Err)
			}
			if n := count(t, db, table, "message_id = 'recent'"); n != 1 {
				t.Errorf("the row processed a moment ago: %d left, want 1", n)
			}
		})
	}
}

// A plain table replaced by a partitioned one between two batches of a
// purge: the next batch (a statement by ctid, written for the plain table)
// deletes no row of the partitioned one, where the same ctid names a recent
// row in every partition.
func TestPurgeOfATableTurnedPartitionedMidwayDeletesNoRecentRow(t *testing.T) {
	t.Parallel()
	db := testdb.OpenPostgres(t, "")
	ctx := context.Background()
	table := "inbox_" + randomSuffix()
	t.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + table + ", " + table + "_plain CASCADE") })
	if err := inbox.CreateTableOnly(ctx, db, inbox.PostgreSQL, table); err != nil {
		t.Fatal(err)
	}
	insertRows(t, db, inbox.PostgreSQL, table, "billing", "expired", 250, 10*day)

	batches := 0
	cfg := inbox.WithPurgeBatchHooks(inbox.PurgeConfig{DB: db, Table: table, OlderThan: 7 * day, BatchSize: 100, DutyCycle: 1}, func() {
		if batches++; batches != 2 {
			return
		}
		exec(t, db, "ALTER TABLE "+table+" RENAME TO "+table+"_plain")
		exec(t, db, "CREATE TABLE "+table+" (LIKE "+table+"_plain) PARTITION BY RANGE (processed_at)")
		exec(t, db, "CREATE TABLE "+table+"_old PARTITION OF "+table+" FOR VALUES FROM (now() - interval '30 days') TO (now() - interval '5 days')")
		exec(t, db, "CREATE TABLE "+table+"_new PARTITION OF "+table+" FOR VALUES FROM (now() - interval '5 days') TO (now() + interval '1 day')")
		insertRows(t, db, inbox.PostgreSQL, table, "billing", "expired", 300, 9*day)
		insertRows(t, db, inbox.PostgreSQL, table, "billing", "recent", 300, time.Hour)
	}, nil)
	if _, err := inbox.Purge(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	if batches < 2 {
		t.Fatalf("the purge ran %d batches, want at least 2", batches)
	}
	if n := count(t, db, table, "message_id LIKE 'recent-%'"); n != 300 {
		t.Errorf("rows processed an hour ago: %d left, want 300", n)
	}
}

// A plain inbox table with an inheritance child: Purge and a Purger round
// refuse it with ErrIncompatibleTable before deleting anything (a ctid names
// a row in the child too), whichever PostgreSQL dialect they are given.
func TestPurgeRefusesATableWithInheritanceChildren(t *testing.T) {
	t.Parallel()
	db := testdb.OpenPostgres(t, "")
	ctx := context.Background()
	table := "inbox_" + randomSuffix()
	t.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + table + " CASCADE") })
	if err := inbox.CreateTableOnly(ctx, db, inbox.PostgreSQL, table); err != nil {
		t.Fatal(err)
	}
	exec(t, db, "CREATE TABLE "+table+"_child () INHERITS ("+table+")")
	insertRows(t, db, inbox.PostgreSQL, table, "billing", "expired", 100, 10*day)
	insertRows(t, db, inbox.PostgreSQL, table+"_child", "billing", "recent", 100, time.Hour)

	// The dialect inferred (PostgreSQL), or PostgreSQLPartitioned given for
	// this plain table, whose batches by primary key deleted the child's
	// rows too.
	for _, d := range []inbox.Dialect{nil, inbox.PostgreSQLPartitioned} {
		_, err := inbox.Purge(ctx, inbox.PurgeConfig{DB: db, Dialect: d, Table: table, OlderThan: 7 * day})
		if !errors.Is(err, inbox.ErrIncompatibleTable) || !strings.Contains(err.Error(), "NO INHERIT") {
			t.Errorf("Purge, dialect %v: %v, want ErrIncompatibleTable with the fix", d, err)
		}
		p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Dialect: d, Table: table, OlderThan: 7 * day}})
		if err != nil {
			t.Fatal(err)
		}
		if err := p.RunOnce(ctx).Err; !errors.Is(err, inbox.ErrIncompatibleTable) {
			t.Errorf("Purger round, dialect %v: %v, want ErrIncompatibleTable", d, err)
		}
	}
	if n := count(t, db, table, ""); n != 200 {
		t.Errorf("rows left (the table's and its child's): %d, want 200", n)
	}
}

// Consumers sharing a partitioned table may have different windows: a
// Purger for consumer "fast" (3 days) drops a partition only when it holds
// no other consumer's row, and deletes its own expired rows from the rest;
// "slow"'s 5-day-old row stays.
func TestConsumerPurgerKeepsPartitionsHoldingOtherConsumersRows(t *testing.T) {
	t.Parallel()
	db := testdb.OpenPostgres(t, "")
	ctx := context.Background()
	table := dailyPartitionedTable(t, db)
	if err := inbox.CreatePartitions(ctx, db, table, dbNow(t, db).AddDate(0, 0, -9), 9); err != nil {
		t.Fatal(err)
	}
	noon := func(days int) string {
		return fmt.Sprintf("date_trunc('day', now(), 'UTC') - interval '%d days' + interval '12 hours'", days)
	}
	exec(t, db, "INSERT INTO "+table+" VALUES ('slow', 's5', "+noon(5)+"), ('fast', 'f5', "+noon(5)+"), ('fast', 'f6', "+noon(6)+
		"), ('fast', 'f1', now() - interval '1 hour')")
	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{
		DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table, OlderThan: 3 * day, Consumer: "fast",
	}})
	if err != nil {
		t.Fatal(err)
	}
	round := p.RunOnce(ctx)
	if round.Err != nil {
		t.Fatal(round.Err)
	}
	if round.Window != 3*day {
		t.Errorf("window = %v, want OlderThan (3 days)", round.Window)
	}
	if n := count(t, db, table, "consumer = 'slow'"); n != 1 {
		t.Errorf("slow's 5-day-old row: %d left, want 1", n)
	}
	var fast []string
	if err := db.Select(&fast, "SELECT message_id FROM "+table+" WHERE consumer = 'fast' ORDER BY 1"); err != nil {
		t.Fatal(err)
	}
	if strings.Join(fast, ",") != "f1" || round.Deleted != 2 {
		t.Errorf("fast's rows left %v, %d deleted; want [f1] and 2 deleted", fast, round.Deleted)
	}
	for _, name := range round.DroppedPartitions {
		if name == partitionOf(table, inbox.PartitionDay, dbNow(t, db).AddDate(0, 0, -5)) {
			t.Errorf("dropped %s, which holds slow's row", name)
		}
	}
}

// A claim's processed_at is its transaction's start, so a claim of another
// consumer whose transaction began inside a partition's range commits its
// row there while a round limited to consumer "fast" looks at that
// partition. The round looked at committed rows only, found none of
// another consumer's, and its DETACH PARTITION CONCURRENTLY waited for the
// claim to commit, then dropped the partition with "slow"'s row, inside
// slow's own window. It now waits for the transactions writing to the
// partition before it looks.
func TestConsumerPurgerKeepsARowAnotherConsumerCommitsWhileItLooks(t *testing.T) {
	t.Parallel()
	db, table, noon, p := oldPartitionsForConsumers(t, 8)
	ctx := context.Background()
	// slow's handler transaction, its claim in the partition of three days
	// ago (what a transaction begun then writes), not yet committed.
	slow := openSlowClaim(t, db, table, "s2", noon)
	done := make(chan inbox.PurgeRound, 1)
	go func() { done <- p.RunOnce(ctx) }()
	// The round waits on slow's transaction (for its look, or, as before,
	// for its DETACH) before slow commits.
	waitForLockWaiter(t, db, "%"+table+"%")
	if err := slow.Commit(); err != nil {
		t.Fatal(err)
	}
	round := <-done
	if round.Err != nil {
		t.Fatal(round.Err)
	}
	if n := count(t, db, table, "consumer = 'slow'"); n != 1 {
		t.Errorf("slow's row committed while the round looked: %d left, want 1 (dropped with %v)", n, round.DroppedPartitions)
	}
	if n := count(t, db, table, "consumer = 'fast'"); n != 0 || round.Deleted != 1 {
		t.Errorf("fast's 3-day-old row: %d left, %d deleted; want it deleted", n, round.Deleted)
	}
}

// The look's lock ends with its transaction, before the DETACH: a claim of
// another consumer whose transaction began inside the partition's range can
// still write there after the look. Here the redelivery of slow's message,
// which waited on the claim's key lock behind the first delivery (the one
// the look waited for), claims once that one rolls back; the DETACH waited
// for it to commit and the partition was dropped with its row. The round
// now looks again once the DETACH is done, and attaches the partition back.
func TestConsumerPurgerKeepsARowAnotherConsumerWritesAfterItLooked(t *testing.T) {
	t.Parallel()
	db, table, noon, p := oldPartitionsForConsumers(t, 8)
	ctx := context.Background()
	key := time.Now().UnixNano() // the claim's key lock of (slow, s3), as the dialect takes it
	first, err := db.BeginTxx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Rollback() //nolint:errcheck // no-op once rolled back
	for _, stmt := range []string{"SELECT pg_advisory_xact_lock($1)", "INSERT INTO " + table + " VALUES ('slow', 's3', " + noon + ")"} {
		args := []any{}
		if strings.Contains(stmt, "$1") {
			args = append(args, key)
		}
		if _, err := first.ExecContext(ctx, stmt, args...); err != nil {
			t.Fatal(err)
		}
	}
	// Holds the DETACH back (it needs this lock on the table; claims do
	// not) until the redelivery has claimed, which otherwise races the
	// DETACH's first step for the partition.
	holdDetach, err := db.BeginTxx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer holdDetach.Rollback() //nolint:errcheck // no-op once rolled back
	if _, err := holdDetach.ExecContext(ctx, "LOCK TABLE ONLY "+table+" IN SHARE UPDATE EXCLUSIVE MODE"); err != nil {
		t.Fatal(err)
	}
	// The redelivery, its transaction begun in the same range: it waits for
	// the key, finds no row, claims, and its handler commits.
	redelivery, err := db.BeginTxx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer redelivery.Rollback() //nolint:errcheck // no-op after Commit
	claimed := make(chan struct{})
	redelivered := make(chan error, 1)
	go func() {
		var exists bool
		if _, err := redelivery.ExecContext(ctx, "SELECT pg_advisory_xact_lock($1)", key); err != nil {
			redelivered <- err
			return
		}
		if err := redelivery.GetContext(ctx, &exists, "SELECT EXISTS (SELECT 1 FROM "+table+" WHERE consumer = 'slow' AND message_id = 's3')"); err != nil || exists {
			redelivered <- fmt.Errorf("claim: row exists %v, %v", exists, err)
			return
		}
		if _, err := redelivery.ExecContext(ctx, "INSERT INTO "+table+" VALUES ('slow', 's3', "+noon+")"); err != nil {
			redelivered <- err
			return
		}
		close(claimed)
		time.Sleep(100 * time.Millisecond) // the handler
		redelivered <- redelivery.Commit()
	}()
	done := make(chan inbox.PurgeRound, 1)
	go func() { done <- p.RunOnce(ctx) }()
	waitForLockWaiter(t, db, "LOCK TABLE %"+table+"%") // the look, waiting for the first delivery
	if err := first.Rollback(); err != nil {           // the first delivery's handler failed
		t.Fatal(err)
	}
	select {
	case <-claimed:
	case err := <-redelivered:
		t.Fatalf("the redelivery's claim: %v", err)
	}
	if err := holdDetach.Rollback(); err != nil {
		t.Fatal(err)
	}
	if err := <-redelivered; err != nil {
		t.Fatal(err)
	}
	round := <-done
	if round.Err != nil {
		t.Fatal(round.Err)
	}
	if n := count(t, db, table, "consumer = 'slow'"); n != 1 {
		t.Errorf("slow's row, committed after the look: %d seen through the table, want 1 (dropped with %v)", n, round.DroppedPartitions)
	}
}

// A Purger whose dialect is inferred from the driver (PostgreSQL) on a
// partitioned table maintains it as PostgreSQLPartitioned does: it drops
// the partitions past the window and creates the coming days'.
func TestPurgerWithInferredDialectMaintainsAPartitionedTable(t *testing.T) {
	t.Parallel()
	db := testdb.OpenPostgres(t, "")
	ctx := context.Background()
	table := partitionedTable(t, db)
	if err := inbox.InitializePartitions(ctx, db, table, inbox.PartitionDay); err != nil {
		t.Fatal(err)
	}
	exec(t, db, "DROP TABLE "+partitionOf(table, inbox.PartitionDay, dbNow(t, db).AddDate(0, 0, inbox.DefaultPartitionsAhead)))
	if err := inbox.CreatePartitions(ctx, db, table, dbNow(t, db).AddDate(0, 0, -10), 5); err != nil {
		t.Fatal(err)
	}
	exec(t, db, "INSERT INTO "+table+" VALUES ('billing', 'old', now() - interval '8 days')")
	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Table: table, OlderThan: 3 * day}})
	if err != nil {
		t.Fatal(err)
	}
	round := p.RunOnce(ctx)
	if round.Err != nil || len(round.DroppedPartitions) != 5 || round.Deleted != 1 {
		t.Errorf("round = %+v, want the 5 partitions of days -10 to -6 dropped with their row", round)
	}
	if gaps := uncovered(t, db, table, 0, inbox.DefaultPartitionsAhead); len(gaps) > 0 {
		t.Errorf("days without a partition after the round: %v", gaps)
	}
}

// A claim function given settings of its own (ALTER FUNCTION ... SET
// search_path) to a schema with a table of the same name would record claims
// there: Verify names the settings and the fix, a delivery is nacked with
// nothing recorded anywhere, and once the settings are reset the claim lands
// in the inbox table.
func TestClaimFunctionWithSettingsOfItsOwnIsRefused(t *testing.T) {
	t.Parallel()
	db := testdb.OpenPostgres(t, "")
	ctx := context.Background()
	table := "inbox_" + randomSuffix()
	other := "decoy_" + randomSuffix()
	t.Cleanup(func() {
		db.Exec("DROP TABLE IF EXISTS " + table + " CASCADE")
		db.Exec("DROP SCHEMA IF EXISTS " + other + " CASCADE")
	})
	newPartitionedInboxEvery(t, db, table, nil, inbox.PartitionWeek)
	exec(t, db, "CREATE SCHEMA "+other)
	exec(t, db, "CREATE TABLE "+other+"."+table+" (LIKE public."+table+")")
	exec(t, db, "ALTER FUNCTION "+table+"_claim(text, text, bigint, bytea) SET search_path = "+other)

	deliver := func() (acked bool, calls int32) {
		t.Helper()
		ib, err := inbox.New(inbox.Config{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table})
		if err != nil {
			t.Fatal(err)
		}
		if err := ib.Verify(ctx); err != nil {
			t.Logf("Verify: %v", err)
		}
		in := newFeed()
		var n atomic.Int32
		r := runRouter(t, func(r *message.Router) {
			r.AddMiddleware(ib.Middleware)
			r.AddConsumerHandler("billing", "orders", in, func(*message.Message) error { n.Add(1); return nil })
		})
		defer r.Close()
		sendCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		acked, err = in.send(sendCtx, message.NewMessage(watermill.NewUUID(), nil))
		if err != nil {
			t.Fatal(err)
		}
		return acked, n.Load()
	}
	ib, err := inbox.New(inbox.Config{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table})
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.Verify(ctx); !errors.Is(err, inbox.ErrIncompatibleTable) || !strings.Contains(err.Error(), "RESET ALL") {
		t.Errorf("Verify: %v, want ErrIncompatibleTable naming the function's settings and RESET ALL", err)
	}
	if acked, calls := deliver(); acked || calls != 0 {
		t.Errorf("delivery with the altered function: acked %v, handler calls %d; want a nack before the handler", acked, calls)
	}
	if n, decoy := count(t, db, table, ""), count(t, db, other+"."+table, ""); n != 0 || decoy != 0 {
		t.Errorf("claims: %d in the inbox table, %d in %s.%s; want none", n, decoy, other, table)
	}
	exec(t, db, "ALTER FUNCTION "+table+"_claim(text, text, bigint, bytea) RESET ALL")
	if acked, calls := deliver(); !acked || calls != 1 {
		t.Errorf("delivery after RESET ALL: acked %v, handler calls %d; want an ack after one call", acked, calls)
	}
	if n, decoy := count(t, db, table, ""), count(t, db, other+"."+table, ""); n != 1 || decoy != 0 {
		t.Errorf("claims: %d in the inbox table, %d in %s.%s; want 1 and 0", n, decoy, other, table)
	}
}

// For random table shapes (plain; partitioned by day, by week, or by
// hand-made ranges of random widths, some named like the library's daily
// partitions of other days) and random windows, whichever purge runs
// (Purge with the dialect inferred or given, DropPartitions, a Purger round
// of either dialect), every row newer than the window is still there
// afterwards; a row purge leaves no row older than it.
func TestPurgeNeverDeletesARowInsideTheWindow(t *testing.T) {
	t.Parallel()
	db := testdb.OpenPostgres(t, "")
	ctx := context.Background()
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(uint64(seed), 0))
	const margin = time.Minute // rows age while the purge runs
	for i := range 8 {
		shape := []string{"plain", "daily", "weekly", "hand-made"}[rng.IntN(4)]
		window := time.Duration(1+rng.IntN(20*24)) * time.Hour
		table := "inbox_" + randomSuffix()
		t.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + table + " CASCADE") })
		partitioned := shape != "plain"
		switch shape {
		case "plain":
			if err := inbox.CreateTableOnly(ctx, db, inbox.PostgreSQL, table); err != nil {
				t.Fatal(err)
			}
		case "daily", "weekly":
			iv := map[string]inbox.PartitionInterval{"daily": inbox.PartitionDay, "weekly": inbox.PartitionWeek}[shape]
			if err := inbox.InitializePartitions(ctx, db, table, iv); err != nil {
				t.Fatal(err)
			}
			if err := inbox.CreatePartitions(ctx, db, table, dbNow(t, db).AddDate(0, 0, -45), 46); err != nil {
				t.Fatal(err)
			}
		case "hand-made":
			ddl, err := inbox.SchemaSQL(inbox.PostgreSQLPartitioned, table)
			if err != nil {
				t.Fatal(err)
			}
			for _, stmt := range statements(ddl) {
				exec(t, db, stmt)
			}
			var ranges []string
			for from, n := -45*24, 0; from < 48; n++ {
				to := from + 1 + rng.IntN(20*24)
				name := fmt.Sprintf("%s_x%d", table, n)
				if rng.IntN(2) == 0 { // named like the library's daily partition of some past day
					name = table + dbNow(t, db).AddDate(0, 0, -1-n).UTC().Format("_p20060102")
				}
				exec(t, db, fmt.Sprintf("CREATE TABLE %s PARTITION OF %s FOR VALUES FROM (date_trunc('hour', now()) + interval '%d hours') TO (date_trunc('hour', now()) + interval '%d hours')",
					name, table, from, to))
				ranges = append(ranges, fmt.Sprintf("%s [%dh, %dh)", name, from, to))
				from = to
			}
			t.Logf("case %d: partitions %v", i, ranges)
		}
		ages := map[string]time.Duration{}
		var values []string
		for j := range 80 {
			age := time.Duration(rng.Int64N(int64(44 * day)))
			id := fmt.Sprintf("m%d", j)
			ages[id] = age
			values = append(values, fmt.Sprintf("('c%d', '%s', now() - interval '%d microseconds')", rng.IntN(2), id, age.Microseconds()))
		}
		exec(t, db, "INSERT INTO "+table+" (consumer, message_id, processed_at) VALUES "+strings.Join(values, ", "))

		ops := []string{"Purge", "Purge with dialect", "Purger", "Purger with dialect"}
		if partitioned {
			ops = append(ops, "DropPartitions", "Purger for one consumer")
		}
		op := ops[rng.IntN(len(ops))]
		var dialect inbox.Dialect
		if strings.HasSuffix(op, "with dialect") {
			dialect = inbox.PostgreSQL
			if partitioned {
				dialect = inbox.PostgreSQLPartitioned
			}
		}
		cfg := inbox.PurgeConfig{DB: db, Dialect: dialect, Table: table, OlderThan: window, BatchSize: 1 + rng.IntN(30), DutyCycle: 1}
		if op == "Purger for one consumer" {
			cfg.Consumer = "c0"
		}
		t.Logf("case %d: %s table, window %v, %s, batch %d", i, shape, window, op, cfg.BatchSize)
		var err error
		switch {
		case strings.HasPrefix(op, "Purge "), op == "Purge":
			_, err = inbox.Purge(ctx, cfg)
		case op == "DropPartitions":
			_, err = inbox.DropPartitions(ctx, db, table, window, nil)
		default:
			p, perr := inbox.NewPurger(inbox.PurgerConfig{Purge: cfg})
			if perr != nil {
				t.Fatal(perr)
			}
			err = p.RunOnce(ctx).Err
		}
		if err != nil {
			t.Fatalf("case %d: %s: %v", i, op, err)
		}
		var left []string
		if err := db.Select(&left, "SELECT message_id FROM "+table); err != nil {
			t.Fatal(err)
		}
		kept := map[string]bool{}
		for _, id := range left {
			kept[id] = true
		}
		for id, age := range ages {
			if age < window-margin && !kept[id] {
				t.Errorf("case %d: row %s, %v old, was deleted under a %v window", i, id, age, window)
			}
			if !partitioned && age > window+margin && kept[id] {
				t.Errorf("case %d: row %s, %v old, was kept under a %v window", i, id, age, window)
			}
		}
	}
}

// A key that has an expired row and a recent one in another partition (the
// recent one written without the claim's lock, by hand or by an old
// version): Purge deletes the expired row only.
func TestPartitionedPurgeDeletesTheExpiredRowNotItsKeysRecentTwin(t *testing.T) {
	t.Parallel()
	db := testdb.OpenPostgres(t, "")
	ctx := context.Background()
	table := dailyPartitionedTable(t, db)
	if err := inbox.CreatePartitions(ctx, db, table, dbNow(t, db).AddDate(0, 0, -9), 9); err != nil {
		t.Fatal(err)
	}
	exec(t, db, "INSERT INTO "+table+" VALUES ('billing', 'm1', now() - interval '8 days'), ('billing', 'm1', now() - interval '1 hour')")
	for _, d := range []inbox.Dialect{nil, inbox.PostgreSQLPartitioned} {
		if _, err := inbox.Purge(ctx, inbox.PurgeConfig{DB: db, Dialect: d, Table: table, OlderThan: 7 * day}); err != nil {
			t.Fatal(err)
		}
	}
	if n := count(t, db, table, "processed_at > now() - interval '1 day'"); n != 1 {
		t.Errorf("recent rows of the key: %d left, want 1", n)
	}
	if n := count(t, db, table, ""); n != 1 {
		t.Errorf("rows left: %d, want 1 (the expired one deleted)", n)
	}
}
