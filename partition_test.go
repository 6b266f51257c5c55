package inbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A message claimed just before a partition boundary and delivered again,
// concurrently, just after it: the primary key cannot see across partitions,
// the key lock does. The second delivery waits for the first, then skips.
func TestPartitionedClaimAcrossBoundary(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	table := partitionedTable(t, db)
	boundary := dbNow(t, db).Add(1500 * time.Millisecond).UTC().Format("2006-01-02 15:04:05.999999Z07:00")
	exec(t, db, fmt.Sprintf("CREATE TABLE %s_before PARTITION OF %s FOR VALUES FROM (MINVALUE) TO ('%s')", table, table, boundary))
	exec(t, db, fmt.Sprintf("CREATE TABLE %s_after PARTITION OF %s FOR VALUES FROM ('%s') TO (MAXVALUE)", table, table, boundary))
	ib, err := inbox.New(inbox.Config{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table})
	if err != nil {
		t.Fatal(err)
	}
	var c calls
	entered, release := make(chan struct{}), make(chan struct{})
	var first atomic.Bool
	handler := func(msg *message.Message) error {
		c.inc(msg.UUID)
		if first.CompareAndSwap(false, true) {
			close(entered)
			<-release
		}
		return nil
	}
	a, b := newFeed(), newFeed()
	for _, in := range []*feed{a, b} {
		runRouter(t, func(r *message.Router) {
			r.AddMiddleware(ib.Middleware)
			r.AddConsumerHandler("billing", "orders", in, handler)
		})
	}
	msg := message.NewMessage(watermill.NewUUID(), nil)
	ackedA := make(chan bool, 1)
	go func() { ackedA <- a.deliver(t, msg) }()
	<-entered // claimed in the partition before the boundary, not committed
	var after bool
	for !after {
		time.Sleep(50 * time.Millisecond)
		if err := db.Get(&after, "SELECT now() >= $1::timestamptz", boundary); err != nil {
			t.Fatal(err)
		}
	}
	ackedB := make(chan bool, 1)
	go func() { ackedB <- b.deliver(t, msg) }() // its row would go after the boundary
	time.Sleep(300 * time.Millisecond)
	close(release)
	if !<-ackedA || !<-ackedB {
		t.Fatal("a delivery was nacked")
	}
	if got := c.get(msg.UUID); got != 1 {
		t.Errorf("handler calls = %d, want 1", got)
	}
	var parts []string
	if err := db.Select(&parts, "SELECT tableoid::regclass::text FROM "+table); err != nil {
		t.Fatal(err)
	}
	if len(parts) != 1 || parts[0] != table+"_before" {
		t.Errorf("inbox rows in partitions %v, want one, in %s_before", parts, table)
	}
}

// A redelivery days later finds the key in an older partition.
func TestPartitionedRedeliveryFromOlderPartition(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	table := "inbox_" + randomSuffix()
	t.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + table + " CASCADE") })
	ib, err := inbox.New(inbox.Config{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table, Consumer: "billing"})
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	msg := message.NewMessage(watermill.NewUUID(), nil)
	exec(t, db, "INSERT INTO "+table+" VALUES ('billing', $1, now() - interval '1 day')", msg.UUID)
	called := false
	if _, err := ib.Middleware(func(*message.Message) ([]*message.Message, error) { called = true; return nil, nil })(msg); err != nil {
		t.Fatal(err)
	}
	if called {
		t.Error("a message processed yesterday (older partition) was processed again")
	}
}

// Partitions past the window are dropped whole; the rest stay. A purger
// round in partitioned mode does the same and creates the coming days.
func TestDropPartitions(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	table := "inbox_" + randomSuffix()
	t.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + table + " CASCADE") })
	ib, err := inbox.New(inbox.Config{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table})
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := inbox.CreatePartitions(ctx, db, table, dbNow(t, db).AddDate(0, 0, -9), 9); err != nil {
		t.Fatal(err)
	}
	for day := -9; day <= 0; day++ { // one row at noon UTC of each of the last ten days (today: now)
		exec(t, db, fmt.Sprintf(`INSERT INTO %s VALUES ('billing', 'day%d',
			CASE WHEN %d = 0 THEN now() ELSE date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' + interval '%d days 12 hours' END)`,
			table, day, day, day))
	}
	if _, err := inbox.DropPartitions(ctx, db, table, 3*24*time.Hour, fixedWindow(5*24*time.Hour)); !errors.Is(err, inbox.ErrWindowTooShort) {
		t.Errorf("3-day drop under a 5-day safe window: err = %v, want ErrWindowTooShort", err)
	}
	dropped, err := inbox.DropPartitions(ctx, db, table, 3*24*time.Hour, nil)
	if err != nil {
		t.Fatal(err)
	}
	// Day -4 ends at the start of day -3, which is at least 3 days ago.
	if len(dropped) != 6 || !strings.HasSuffix(dropped[0].Name, dbNow(t, db).UTC().AddDate(0, 0, -9).Format("_p20060102")) {
		t.Errorf("dropped %+v, want the 6 partitions of days -9 to -4", dropped)
	}
	var rows int64
	for _, d := range dropped {
		rows += d.Rows
	}
	if rows != 6 || count(t, db, table, "") != 4 {
		t.Errorf("dropped %d rows, %d left; want 6 and 4", rows, count(t, db, table, ""))
	}

	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{
		DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table, OlderThan: 24 * time.Hour,
	}})
	if err != nil {
		t.Fatal(err)
	}
	round := p.RunOnce(ctx)
	if round.Err != nil || len(round.DroppedPartitions) != 2 || round.Deleted != 2 {
		t.Errorf("purger round = %+v, want days -3 and -2 dropped", round)
	}
	// Oldest row left: yesterday noon, in yesterday's partition.
	if round.OldestAge < 24*time.Hour || round.OldestAge > 48*time.Hour {
		t.Errorf("oldest age = %v, want between 1 and 2 days (start of yesterday)", round.OldestAge)
	}
	var ahead bool
	if err := db.Get(&ahead, "SELECT to_regclass($1) IS NOT NULL", table+dbNow(t, db).UTC().AddDate(0, 0, inbox.DefaultPartitionsAhead).Format("_p20060102")); err != nil || !ahead {
		t.Errorf("partition %d days ahead missing (%v)", inbox.DefaultPartitionsAhead, err)
	}
}

func TestPartitionedNeedsReadCommitted(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	_, err := inbox.New(inbox.Config{DB: db, Dialect: inbox.PostgreSQLPartitioned, TxOptions: &sql.TxOptions{Isolation: sql.LevelRepeatableRead}})
	if !errors.Is(err, inbox.ErrInvalidConfig) || !strings.Contains(err.Error(), "READ COMMITTED") {
		t.Errorf("err = %v, want ErrInvalidConfig about READ COMMITTED", err)
	}
}
