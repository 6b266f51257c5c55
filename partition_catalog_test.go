package inbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A partition's bounds mean the same instants whatever the session's
// DateStyle, TimeZone and timezone_abbreviations: a partition that still
// holds a row inside the window is kept, partitions ahead are made with no
// gap, and a Purger round works. With DateStyle 'SQL' or 'Postgres' the
// bounds were read back through a zone abbreviation (Irish summer time's
// "IST" as Israel's +02, Israel's "IST" as India's +05:30 under the India
// set, Kolkata's "IST" as Israel's), so DropPartitions dropped a partition
// an hour or more before its bound reached the cutoff, CreatePartitions left
// a gap no claim could land in, and with Guam's "ChST", which does not read
// back at all, every round failed.
func TestPartitionBoundsMeanTheSameInEverySessionTimeZone(t *testing.T) {
	t.Parallel()
	t.Run("a partition with a row inside the window is kept", func(t *testing.T) {
		t.Parallel()
		for name, c := range map[string]struct {
			param string
			week  time.Time // the Monday the partition starts
		}{
			"Dublin in summer":               {"DateStyle=SQL,DMY&timezone=Europe/Dublin", time.Date(2026, 6, 29, 0, 0, 0, 0, time.UTC)},
			"Jerusalem, India abbreviations": {"DateStyle=Postgres&timezone=Asia/Jerusalem&timezone_abbreviations=India", time.Date(2026, 11, 23, 0, 0, 0, 0, time.UTC)},
		} {
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				ctx := context.Background()
				plain := testdb.OpenPostgres(t, "")
				table := partitionedTableEvery(t, plain, inbox.PartitionWeek)
				if err := inbox.CreatePartitions(ctx, plain, table, c.week, 7); err != nil {
					t.Fatal(err)
				}
				bound := c.week.AddDate(0, 0, 7)
				exec(t, plain, "INSERT INTO "+table+" (consumer, message_id, processed_at) VALUES ('c', 'inside', $1)", bound.Add(-10*time.Minute))
				olderThan := time.Since(bound.Add(-30 * time.Minute)) // the cutoff: 20 minutes before the row
				if _, err := inbox.DropPartitions(ctx, testdb.OpenPostgres(t, c.param), table, olderThan, nil); err != nil {
					t.Fatal(err)
				}
				if n := count(t, plain, table, "message_id = 'inside'"); n != 1 {
					t.Error("the partition of a row processed 20 minutes after the cutoff was dropped")
				}
			})
		}
	})
	t.Run("partitions ahead leave no gap", func(t *testing.T) {
		t.Parallel()
		ctx := context.Background()
		plain := testdb.OpenPostgres(t, "")
		table := dailyPartitionedTable(t, plain)
		db := testdb.OpenPostgres(t, "DateStyle=SQL,DMY&timezone=Asia/Kolkata")
		today := dbNow(t, plain).UTC().Truncate(24 * time.Hour)
		for range 2 {
			if err := inbox.CreatePartitions(ctx, db, table, today, 12); err != nil {
				t.Fatal(err)
			}
		}
		for day := range 12 {
			at := today.AddDate(0, 0, day).Add(time.Hour)
			if _, err := plain.Exec("INSERT INTO "+table+" VALUES ('c', $1, $2)", at.String(), at); err != nil {
				t.Errorf("a claim at %v has no partition: %v", at, err)
			}
		}
		if names := partitionNames(t, plain, table); len(names) != 13 { // yesterday, today and 11 days ahead
			t.Errorf("partitions %v, want 13 daily ones", names)
		}
	})
	t.Run("rounds work where an abbreviation does not read back", func(t *testing.T) {
		t.Parallel()
		ctx := context.Background()
		plain := testdb.OpenPostgres(t, "")
		table := partitionedTableEvery(t, plain, inbox.PartitionWeek)
		db := testdb.OpenPostgres(t, "DateStyle=SQL,DMY&timezone=Pacific/Guam")
		p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Dialect: inbox.PostgreSQLPartitioned,
			Table: table, OlderThan: 15 * 24 * time.Hour}})
		if err != nil {
			t.Fatal(err)
		}
		if r := p.RunOnce(ctx); r.Err != nil {
			t.Errorf("purger round: %v", r.Err)
		}
		ib, err := inbox.New(inbox.Config{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table})
		if err != nil {
			t.Fatal(err)
		}
		if err := ib.InitializeSchema(ctx); err != nil {
			t.Errorf("InitializeSchema: %v", err)
		}
		if err := ib.Verify(ctx); err != nil {
			t.Errorf("Verify: %v", err)
		}
	})
}

// A partition moved to another schema while attached (an archive) is
// addressed in its own schema: DropPartitions drops it once past the window,
// and never a table of the same name in the parent's schema (a partition for
// other days, which was dropped in its place with its rows).
func TestPartitionInAnotherSchemaIsAddressedThere(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	plain := testdb.OpenPostgres(t, "")
	archive := "archive_" + randomSuffix()
	exec(t, plain, "CREATE SCHEMA "+archive)
	t.Cleanup(func() { plain.Exec("DROP SCHEMA IF EXISTS " + archive + " CASCADE") })
	table := partitionedTableEvery(t, plain, inbox.PartitionWeek)
	old := table + "_w20261005"
	exec(t, plain, "CREATE TABLE "+old+" PARTITION OF "+table+" FOR VALUES FROM ('2026-10-05 00:00:00Z') TO ('2026-10-12 00:00:00Z')")
	exec(t, plain, "INSERT INTO "+table+" VALUES ('c', 'old', '2026-10-06 00:00:00Z')")
	exec(t, plain, "ALTER TABLE "+old+" SET SCHEMA "+archive)
	// Named like the archived one, in the parent's schema, for days ahead.
	exec(t, plain, "CREATE TABLE "+old+" PARTITION OF "+table+" FOR VALUES FROM ('2099-03-01 00:00:00Z') TO ('2099-03-08 00:00:00Z')")
	exec(t, plain, "INSERT INTO "+table+" VALUES ('c', 'future', '2099-03-02 00:00:00Z')")
	ib, err := inbox.New(inbox.Config{DB: plain, Dialect: inbox.PostgreSQLPartitioned, Table: table})
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.Verify(ctx); err != nil {
		t.Fatalf("Verify: %v", err)
	}
	dropped, err := inbox.DropPartitions(ctx, plain, table, 15*24*time.Hour, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(dropped) != 1 || dropped[0].Name != archive+"."+old || dropped[0].Rows != 1 {
		t.Errorf("dropped %+v, want %s.%s with its 1 row", dropped, archive, old)
	}
	if n := count(t, plain, table, "message_id = 'future'"); n != 1 {
		t.Error("the row of 2099-03-02 is gone with its partition")
	}
}

// A partition that a DropPartitions interrupted between DETACH and DROP left
// detached, in the range a Purger keeps covered (yesterday's, with a window
// under a day), does not stop InitializeSchema or the rounds, and the next
// round drops it once past the window: it is attached again, or, when it
// cannot be (a column added to the table since it was detached: 42804), left
// out of the range, which lies in the past. Every round and InitializeSchema
// failed on its name (42P07), and no partition ahead was made any more.
func TestPartitionLeftDetachedInTheKeptRangeIsDroppedByTheNextRound(t *testing.T) {
	t.Parallel()
	for name, sinceDetach := range map[string]string{
		"attached again":              "",
		"a column added to the table": "ALTER TABLE {t} ADD COLUMN note text",
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			plain := testdb.OpenPostgres(t, "")
			table := dailyPartitionedTable(t, plain)
			now := dbNow(t, plain).UTC()
			today := now.Truncate(24 * time.Hour)
			if now.Sub(today) < 2*time.Second {
				t.Skip("too close to midnight UTC for a window shorter than today")
			}
			yesterday := table + today.AddDate(0, 0, -1).Format("_p20060102")
			exec(t, plain, "INSERT INTO "+table+" VALUES ('c', 'y', $1)", today.Add(-time.Hour))
			// What a DropPartitions interrupted between its DETACH and its DROP leaves.
			exec(t, plain, "COMMENT ON TABLE "+yesterday+" IS '"+inbox.DetachedPartitionComment+"'")
			exec(t, plain, "ALTER TABLE "+table+" DETACH PARTITION "+yesterday+" CONCURRENTLY") // as DropPartitions does
			if sinceDetach != "" {
				exec(t, plain, strings.ReplaceAll(sinceDetach, "{t}", table))
			}
			olderThan := now.Sub(today) / 2 // yesterday is past it
			ib, err := inbox.New(inbox.Config{DB: plain, Dialect: inbox.PostgreSQLPartitioned, Table: table})
			if err != nil {
				t.Fatal(err)
			}
			if err := ib.InitializeSchema(ctx); err != nil {
				t.Errorf("InitializeSchema: %v", err)
			}
			// Attached again, it carries nothing Verify refuses (DETACH
			// ... CONCURRENTLY added a CHECK of its bound).
			if err := ib.Verify(ctx); err != nil {
				t.Errorf("Verify: %v", err)
			}
			p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: plain, Table: table, OlderThan: olderThan}})
			if err != nil {
				t.Fatal(err)
			}
			r := p.RunOnce(ctx)
			if r.Err != nil || r.Deleted != 1 {
				t.Errorf("purger round: deleted %d, err %v; want yesterday's row, no error", r.Deleted, r.Err)
			}
			var left bool
			if err := plain.Get(&left, "SELECT to_regclass($1) IS NOT NULL", yesterday); err != nil || left {
				t.Errorf("%s, past the window, is still there (%v)", yesterday, err)
			}
			if missing := uncovered(t, plain, table, 0, inbox.DefaultPartitionsAhead); len(missing) > 0 {
				t.Errorf("days without a partition: %v", missing)
			}
		})
	}
}

// A detached table named like a partition of the inbox table that no
// DropPartitions detached (pg_partman's retention with retention_keep_table
// keeps them as archives under such names) is never dropped, however old
// its rows; one that an interrupted DropPartitions left is.
func TestDetachedTableThatNoDropLeftIsNeverDropped(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	plain := testdb.OpenPostgres(t, "")
	table := dailyPartitionedTable(t, plain)
	if err := inbox.CreatePartitions(ctx, plain, table, time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC), 2); err != nil {
		t.Fatal(err)
	}
	archive, leftover := table+"_p20260101", table+"_p20260102"
	exec(t, plain, "INSERT INTO "+table+" VALUES ('c', 'archived', '2026-01-01 12:00:00Z'), ('c', 'left', '2026-01-02 12:00:00Z')")
	exec(t, plain, "ALTER TABLE "+table+" DETACH PARTITION "+archive) // pg_partman's retention
	exec(t, plain, "COMMENT ON TABLE "+leftover+" IS '"+inbox.DetachedPartitionComment+"'")
	exec(t, plain, "ALTER TABLE "+table+" DETACH PARTITION "+leftover) // an interrupted DropPartitions
	t.Cleanup(func() { plain.Exec("DROP TABLE IF EXISTS " + archive + ", " + leftover) })
	dropped, err := inbox.DropPartitions(ctx, plain, table, 24*time.Hour, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range dropped {
		if d.Name == "public."+archive {
			t.Errorf("the archive %s, which no DropPartitions detached, was dropped", archive)
		}
	}
	if n := count(t, plain, archive, ""); n != 1 {
		t.Errorf("archive rows left: %d, want 1", n)
	}
	var left bool
	if err := plain.Get(&left, "SELECT to_regclass($1) IS NOT NULL", leftover); err != nil || left {
		t.Errorf("the leftover %s of an interrupted DropPartitions is still there (%v)", leftover, err)
	}
}

// A claim refused with check_violation (23514) by something else than a
// missing partition (a trigger that validates ids, added after the table
// was verified) is the message's error: not transient, so that a poison
// queue filter takes it, and not reported as a missing partition.
func TestClaimRefusedByAValidationTriggerIsNotTransient(t *testing.T) {
	t.Parallel()
	for _, d := range []inbox.Dialect{inbox.PostgreSQL, inbox.PostgreSQLPartitioned} {
		t.Run(d.String(), func(t *testing.T) {
			t.Parallel()
			db := testdb.OpenPostgres(t, "")
			f := newFixture(t, db)
			ib := f.newInbox(inbox.Config{Dialect: d})
			rec := &recorder{}
			in := newFeed()
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(rec.Middleware, ib.Middleware)
				r.AddConsumerHandler("billing", "orders", in, func(*message.Message) error { return nil })
			})
			if !in.deliver(t, message.NewMessage("good-1", nil)) { // the table is verified
				t.Fatalf("first message nacked: %v", rec.last())
			}
			exec(t, db, "CREATE FUNCTION "+f.inbox+"_check() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "+
				"IF NEW.message_id LIKE 'bad%' THEN RAISE EXCEPTION 'bad id' USING ERRCODE = 'check_violation'; END IF; RETURN NEW; END $$")
			t.Cleanup(func() { db.Exec("DROP FUNCTION IF EXISTS " + f.inbox + "_check() CASCADE") })
			exec(t, db, "CREATE TRIGGER "+f.inbox+"_check BEFORE INSERT ON "+f.inbox+" FOR EACH ROW EXECUTE FUNCTION "+f.inbox+"_check()")
			if in.deliver(t, message.NewMessage("bad-1", nil)) {
				t.Fatal("a message whose claim the trigger refused was acked")
			}
			if err := rec.last(); inbox.IsTransient(err) || errors.Is(err, inbox.ErrIncompatibleTable) {
				t.Errorf("nacked with %v, want the trigger's error, not transient", err)
			}
		})
	}
}

// A partition moved to another schema while attached (which the library
// supports) and left detached there by a DropPartitions interrupted between
// its DETACH and its DROP, while the window has grown since, holds rows
// inside the window that claims do not see. Only the parent's schema was
// searched for such tables: no round attached it back or said anything, and
// a redelivery of its messages was processed again. The mark names the
// inbox table, so another inbox table of the same name in a third schema
// leaves it alone.
func TestPartitionLeftDetachedInAnotherSchemaIsAttachedBack(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	plain := testdb.OpenPostgres(t, "")
	archive, other := "archive_"+randomSuffix(), "other_"+randomSuffix()
	exec(t, plain, "CREATE SCHEMA "+archive)
	exec(t, plain, "CREATE SCHEMA "+other)
	t.Cleanup(func() { plain.Exec("DROP SCHEMA IF EXISTS " + archive + ", " + other + " CASCADE") })
	table := dailyPartitionedTable(t, plain)
	if err := inbox.CreatePartitions(ctx, plain, table, time.Date(2026, 10, 5, 0, 0, 0, 0, time.UTC), 1); err != nil {
		t.Fatal(err)
	}
	moved := table + "_p20261005"
	exec(t, plain, "INSERT INTO "+table+" VALUES ('c', 'm1', '2026-10-05 12:00:00Z')")
	exec(t, plain, "ALTER TABLE "+moved+" SET SCHEMA "+archive)
	// What a DropPartitions interrupted between its DETACH and its DROP leaves.
	exec(t, plain, "COMMENT ON TABLE "+archive+"."+moved+" IS '"+inbox.DetachedPartitionMarkWithoutRange("public."+table)+"'")
	exec(t, plain, "ALTER TABLE "+table+" DETACH PARTITION "+archive+"."+moved)
	// The window has grown since: the row is inside it.
	window := dbNow(t, plain).Sub(time.Date(2026, 10, 5, 12, 0, 0, 0, time.UTC)) + 30*day

	// An inbox table of the same name in another schema, maintained with
	// that window, leaves the table alone: it is not its partition.
	if err := inbox.InitializePartitions(ctx, plain, other+"."+table, inbox.PartitionDay); err != nil {
		t.Fatal(err)
	}
	if _, err := inbox.DropPartitions(ctx, plain, other+"."+table, window, nil); err != nil {
		t.Fatal(err)
	}
	var attachedTo string
	parent := func() string {
		t.Helper()
		if err := plain.Get(&attachedTo, "SELECT COALESCE((SELECT inhparent::regclass::text FROM pg_inherits WHERE inhrelid = to_regclass($1)), '')", archive+"."+moved); err != nil {
			t.Fatal(err)
		}
		return attachedTo
	}
	if got := parent(); got != "" {
		t.Fatalf("%s.%s was attached to %s, another inbox table of the same name", archive, moved, got)
	}

	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: plain, Dialect: inbox.PostgreSQLPartitioned, Table: table,
		Window: inbox.FixedWindow(window)}})
	if err != nil {
		t.Fatal(err)
	}
	if r := p.RunOnce(ctx); r.Err != nil || len(r.DroppedPartitions) != 0 {
		t.Fatalf("round: dropped %v, err %v; want nothing dropped, no error", r.DroppedPartitions, r.Err)
	}
	if n := count(t, plain, table, "message_id = 'm1'"); n != 1 {
		t.Errorf("the row of m1, inside the window, is seen %d times through %s, want 1: a redelivery of m1 would be processed again", n, table)
	}
	if got := parent(); got != table {
		t.Errorf("%s.%s is attached to %q, want %s", archive, moved, got, table)
	}
}

// A partition that an interrupted DropPartitions left detached, holding
// another consumer's rows, is attached back by a round limited to one
// consumer: those rows may be inside their own consumer's window, and a
// detached table's rows are not seen by claims. It was left detached for
// good (only a round without a consumer would drop it).
func TestConsumerPurgerAttachesBackALeftoverHoldingAnotherConsumersRows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	plain := testdb.OpenPostgres(t, "")
	table := dailyPartitionedTable(t, plain)
	if err := inbox.CreatePartitions(ctx, plain, table, time.Date(2026, 1, 2, 0, 0, 0, 0, time.UTC), 1); err != nil {
		t.Fatal(err)
	}
	leftover := table + "_p20260102"
	exec(t, plain, "INSERT INTO "+table+" VALUES ('slow', 's1', '2026-01-02 12:00:00Z'), ('fast', 'f1', '2026-01-02 12:00:00Z')")
	// What a DropPartitions interrupted between its DETACH and its DROP leaves.
	exec(t, plain, "COMMENT ON TABLE "+leftover+" IS '"+inbox.DetachedPartitionMarkWithoutRange("public."+table)+"'")
	exec(t, plain, "ALTER TABLE "+table+" DETACH PARTITION "+leftover)
	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: plain, Dialect: inbox.PostgreSQLPartitioned, Table: table,
		OlderThan: 3 * day, Consumer: "fast"}})
	if err != nil {
		t.Fatal(err)
	}
	if r := p.RunOnce(ctx); r.Err != nil {
		t.Fatal(r.Err)
	}
	if n := count(t, plain, table, "consumer = 'slow'"); n != 1 {
		t.Errorf("slow's row in the leftover: seen %d times through %s, want 1", n, table)
	}
	if n := count(t, plain, table, "consumer = 'fast'"); n != 0 {
		t.Errorf("fast's expired row: %d left, want it deleted", n)
	}
}

// A round limited to one consumer whose DETACH stopped waiting half way
// (pending) because a claim of another consumer, begun inside the
// partition's range, wrote there after the look and held it: the next round
// found the pending partition holding that row and left it pending, so
// claims did not see the row (its redelivery was processed again) and every
// later DETACH of the table failed (55000). It is now finished and attached
// back.
func TestConsumerPurgerAttachesBackAPendingPartitionHoldingAnotherConsumersRow(t *testing.T) {
	defer inbox.SetDetachWait(inbox.SetDetachWait(time.Second))
	db, table, noon, p := oldPartitionsForConsumers(t, 10)
	ctx := context.Background()
	var part string
	if err := db.Get(&part, "SELECT tableoid::regclass::text FROM "+table+" WHERE message_id = 'f3'"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + part) })
	// Holds the round's DETACH at its first step until slow has claimed.
	holdDetach, err := db.BeginTxx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer holdDetach.Rollback() //nolint:errcheck // no-op once rolled back
	if _, err := holdDetach.ExecContext(ctx, "LOCK TABLE ONLY "+table+" IN SHARE UPDATE EXCLUSIVE MODE"); err != nil {
		t.Fatal(err)
	}
	done := make(chan inbox.PurgeRound, 1)
	go func() { done <- p.RunOnce(ctx) }()
	waitForLockWaiter(t, db, "%DETACH PARTITION%"+part+"%")
	// slow's claim, its transaction begun in the partition's range, after
	// the look: it holds the DETACH's second step past its wait.
	claim := openSlowClaim(t, db, table, "s3", noon)
	if err := holdDetach.Rollback(); err != nil {
		t.Fatal(err)
	}
	if r := <-done; r.Err == nil {
		t.Fatal("the first round's DETACH did not stop waiting: the case did not happen")
	}
	if err := claim.Commit(); err != nil {
		t.Fatal(err)
	}
	// The next rounds' DETACH FINALIZE waits for every older snapshot in
	// the database: another test process's transactions too.
	inbox.SetDetachWait(time.Minute)
	if r := p.RunOnce(ctx); r.Err != nil {
		t.Errorf("second round: %v", r.Err)
	}
	var state string
	if err := db.Get(&state, "SELECT COALESCE((SELECT CASE WHEN inhdetachpending THEN 'pending' ELSE 'attached' END"+
		" FROM pg_inherits WHERE inhrelid = to_regclass($1)), 'detached')", part); err != nil {
		t.Fatal(err)
	}
	if state != "attached" {
		t.Errorf("the partition holding slow's committed row is %s after the second round, want attached", state)
	}
	if n := count(t, db, table, "consumer = 'slow'"); n != 1 {
		t.Errorf("slow's row: seen %d times through %s, want 1", n, table)
	}
	if r := p.RunOnce(ctx); r.Err != nil {
		t.Errorf("third round: %v", r.Err)
	}
}
