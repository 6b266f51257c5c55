package inbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A new table gets weekly partitions from InitializeSchema: few enough that
// a 15-day window needs at most five, covering yesterday to a week ahead
// without a gap, and a key processed last week is still found.
func TestPartitionedNewTableIsWeekly(t *testing.T) {
	t.Parallel()
	db := testdb.OpenPostgres(t, "")
	table := "inbox_" + randomSuffix()
	t.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + table + " CASCADE") })
	ctx := context.Background()
	ib, err := inbox.New(inbox.Config{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table, Consumer: "billing"})
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.InitializeSchema(ctx); err != nil {
		t.Fatal(err)
	}
	if iv, err := inbox.TablePartitionInterval(ctx, db, table); err != nil || iv != inbox.PartitionWeek {
		t.Fatalf("interval = %q, %v; want week", iv, err)
	}
	names := partitionNames(t, db, table)
	if len(names) < 2 || len(names) > 3 {
		t.Errorf("partitions %v: want 2 or 3 weeks for yesterday to %d days ahead", names, inbox.DefaultPartitionsAhead)
	}
	for _, n := range names {
		if !strings.HasPrefix(n, table+"_w") {
			t.Errorf("partition %s is not weekly", n)
		}
	}
	if gaps := uncovered(t, db, table, -1, inbox.DefaultPartitionsAhead); len(gaps) > 0 {
		t.Errorf("days without a partition: %v", gaps)
	}
	// A Kafka-default window: 15 days back.
	if err := inbox.CreatePartitions(ctx, db, table, dbNow(t, db).AddDate(0, 0, -15), 16); err != nil {
		t.Fatal(err)
	}
	if names := partitionNames(t, db, table); len(names) > 5 {
		t.Errorf("15 days back to %d ahead: %d partitions %v, want at most 5", inbox.DefaultPartitionsAhead, len(names), names)
	}
	msg := message.NewMessage(watermill.NewUUID(), nil)
	exec(t, db, "INSERT INTO "+table+" VALUES ('billing', $1, now() - interval '8 days')", msg.UUID)
	called := false
	if _, err := ib.Middleware(func(*message.Message) ([]*message.Message, error) { called = true; return nil, nil })(msg); err != nil {
		t.Fatal(err)
	}
	if called {
		t.Error("a message processed 8 days ago (last week's partition) was processed again")
	}
}

// A table given daily partitions keeps them: InitializeSchema, a Purger
// round and CreatePartitions add days, never weeks, and asking for weeks
// is refused with ErrIncompatibleTable without creating anything.
func TestPartitionedDailyTableStaysDaily(t *testing.T) {
	t.Parallel()
	db := testdb.OpenPostgres(t, "")
	table := "inbox_" + randomSuffix()
	t.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + table + " CASCADE") })
	ctx := context.Background()
	newPartitionedInbox(t, db, table, nil) // daily
	if err := inbox.CreatePartitions(ctx, db, table, dbNow(t, db).AddDate(0, 0, -3), 3); err != nil {
		t.Fatal(err)
	}
	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table, OlderThan: 30 * 24 * time.Hour}})
	if err != nil {
		t.Fatal(err)
	}
	if round := p.RunOnce(ctx); round.Err != nil {
		t.Fatal(round.Err)
	}
	err = inbox.InitializePartitions(ctx, db, table, inbox.PartitionWeek)
	if !errors.Is(err, inbox.ErrIncompatibleTable) || !strings.Contains(err.Error(), "MigratePartitionInterval") {
		t.Errorf("weekly partitions on a daily table: err = %v, want ErrIncompatibleTable naming MigratePartitionInterval", err)
	}
	names := partitionNames(t, db, table)
	for _, n := range names {
		if !strings.HasPrefix(n, table+"_p") {
			t.Errorf("partition %s in a daily table", n)
		}
	}
	if len(names) != 3+1+inbox.DefaultPartitionsAhead { // 3 days back, today, 7 ahead
		t.Errorf("%d daily partitions %v, want %d", len(names), names, 3+1+inbox.DefaultPartitionsAhead)
	}
	if iv, err := inbox.TablePartitionInterval(ctx, db, table); err != nil || iv != inbox.PartitionDay {
		t.Errorf("interval = %q, %v; want day", iv, err)
	}
}

// Migrating a daily table to weeks: days fill the gap up to the next
// Monday, then weeks follow with no day uncovered; a key processed in a
// daily partition is still found; the daily partitions are dropped by
// their own end, the weekly one kept. Migrating back to days works the
// same way.
func TestMigratePartitionIntervalKeepsDeduplicating(t *testing.T) {
	t.Parallel()
	db := testdb.OpenPostgres(t, "")
	table := "inbox_" + randomSuffix()
	t.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + table + " CASCADE") })
	ctx := context.Background()
	ib := newPartitionedInbox(t, db, table, nil) // daily
	old := message.NewMessage(watermill.NewUUID(), nil)
	exec(t, db, "INSERT INTO "+table+" VALUES ('billing', $1, now())", old.UUID)
	dailyNewest := partitionNames(t, db, table)
	if err := inbox.MigratePartitionInterval(ctx, db, table, inbox.PartitionWeek); err != nil {
		t.Fatal(err)
	}
	if iv, err := inbox.TablePartitionInterval(ctx, db, table); err != nil || iv != inbox.PartitionWeek {
		t.Fatalf("after migration: interval = %q, %v; want week", iv, err)
	}
	if err := inbox.MigratePartitionInterval(ctx, db, table, inbox.PartitionWeek); err != nil { // a no-op now
		t.Fatal(err)
	}
	if err := ib.InitializeSchema(ctx); err != nil {
		t.Fatal(err)
	}
	if err := inbox.CreatePartitions(ctx, db, table, dbNow(t, db), 30); err != nil {
		t.Fatal(err)
	}
	names := partitionNames(t, db, table)
	weeks := 0
	for _, n := range names {
		if strings.HasPrefix(n, table+"_w") {
			weeks++
		}
	}
	if weeks < 3 || len(names)-weeks > len(dailyNewest)+6 {
		t.Errorf("partitions after migration %v: want the %d daily ones, at most 6 filler days, then weeks", names, len(dailyNewest))
	}
	if gaps := uncovered(t, db, table, -1, 29); len(gaps) > 0 {
		t.Errorf("days without a partition after migration: %v", gaps)
	}
	called := false
	if _, err := ib.Middleware(func(*message.Message) ([]*message.Message, error) { called = true; return nil, nil })(old); err != nil {
		t.Fatal(err)
	}
	if called {
		t.Error("a message processed in a daily partition was processed again after the migration")
	}
	// A 14-day-old row (in a partition of the new interval, before the
	// daily ones, which ends 7 to 14 days ago whatever today's weekday)
	// goes with its partition; the daily partitions, which end inside the
	// 5-day window, stay, and so does the key in one of them.
	if err := inbox.CreatePartitions(ctx, db, table, dbNow(t, db).AddDate(0, 0, -14), 2); err != nil {
		t.Fatal(err)
	}
	exec(t, db, "INSERT INTO "+table+" VALUES ('billing', 'old', now() - interval '14 days')")
	if _, err := inbox.DropPartitions(ctx, db, table, 5*24*time.Hour, nil); err != nil {
		t.Fatal(err)
	}
	if count(t, db, table, "message_id = 'old'") != 0 || count(t, db, table, "message_id = $1", old.UUID) != 1 {
		t.Errorf("after the drop: the 14-day-old row is still there, or today's is gone")
	}
	if gaps := uncovered(t, db, table, -1, 29); len(gaps) > 0 {
		t.Errorf("days without a partition after the drop: %v", gaps)
	}

	if err := inbox.MigratePartitionInterval(ctx, db, table, inbox.PartitionDay); err != nil {
		t.Fatal(err)
	}
	if iv, err := inbox.TablePartitionInterval(ctx, db, table); err != nil || iv != inbox.PartitionDay {
		t.Errorf("after migrating back: interval = %q, %v; want day", iv, err)
	}
	names = partitionNames(t, db, table)
	if last := names[len(names)-1]; !strings.HasPrefix(last, table+"_p") {
		t.Errorf("newest partition after migrating back: %s, want a day", last)
	}
	if gaps := uncovered(t, db, table, -1, 29); len(gaps) > 0 {
		t.Errorf("days without a partition after migrating back: %v", gaps)
	}
}

// Weekly partitions are dropped once their whole week is past the window.
func TestDropPartitionsWeekly(t *testing.T) {
	t.Parallel()
	db := testdb.OpenPostgres(t, "")
	table := "inbox_" + randomSuffix()
	t.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + table + " CASCADE") })
	ctx := context.Background()
	newPartitionedInboxEvery(t, db, table, nil, inbox.PartitionWeek)
	if err := inbox.CreatePartitions(ctx, db, table, dbNow(t, db).AddDate(0, 0, -30), 31); err != nil {
		t.Fatal(err)
	}
	for _, days := range []int{29, 22, 15, 8, 1, 0} {
		exec(t, db, "INSERT INTO "+table+" VALUES ('billing', $1, now() - $2 * interval '1 day')", "d"+string(rune('a'+days)), days)
	}
	// Rows whose week (Monday 00:00 UTC to Monday) ended 10 days ago or earlier.
	want := count(t, db, table, "date_trunc('week', processed_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' + interval '7 days' <= now() - interval '10 days'")
	dropped, err := inbox.DropPartitions(ctx, db, table, 10*24*time.Hour, nil)
	if err != nil {
		t.Fatal(err)
	}
	var rows int64
	for _, d := range dropped {
		rows += d.Rows
		if !strings.Contains(d.Name, table+"_w") {
			t.Errorf("dropped %s, not a weekly partition", d.Name)
		}
	}
	if rows != int64(want) || len(dropped) < 2 || count(t, db, table, "") != 6-want {
		t.Errorf("dropped %v (%d rows), %d rows left; want %d rows dropped", dropped, rows, count(t, db, table, ""), want)
	}
}

func TestParsePartitionInterval(t *testing.T) {
	t.Parallel()
	for _, s := range []string{"day", "week"} {
		if iv, err := inbox.ParsePartitionInterval(s); err != nil || string(iv) != s {
			t.Errorf("%q: %q, %v", s, iv, err)
		}
	}
	for _, s := range []string{"", "month", "Day", "1d"} {
		if _, err := inbox.ParsePartitionInterval(s); !errors.Is(err, inbox.ErrInvalidConfig) {
			t.Errorf("%q: err = %v, want ErrInvalidConfig", s, err)
		}
	}
}
