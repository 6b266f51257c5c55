package inbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
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
// It holds at every PartitionInterval: the table gets the partitions of the
// interval, and the one holding now is split at a boundary 1.5 s ahead.
func TestPartitionedClaimAcrossBoundary(t *testing.T) {
	for _, iv := range []inbox.PartitionInterval{inbox.PartitionDay, inbox.PartitionWeek} {
		t.Run(string(iv), func(t *testing.T) {
			t.Parallel()
			claimAcrossBoundary(t, iv)
		})
	}
}

func claimAcrossBoundary(t *testing.T, iv inbox.PartitionInterval) {
	db := testdb.OpenPostgres(t, "")
	table := partitionedTable(t, db)
	if err := inbox.InitializePartitions(context.Background(), db, table, iv); err != nil {
		t.Fatal(err)
	}
	now := dbNow(t, db)
	start, end := slotOf(iv, now)
	if !now.Add(3 * time.Second).Before(end) {
		t.Skip("too close to the end of the current partition")
	}
	current := partitionOf(table, iv, start)
	exec(t, db, "DROP TABLE "+current)
	ts := func(x time.Time) string { return x.UTC().Format("2006-01-02 15:04:05.999999Z07:00") }
	boundary := ts(now.Add(1500 * time.Millisecond))
	exec(t, db, fmt.Sprintf("CREATE TABLE %s_before PARTITION OF %s FOR VALUES FROM ('%s') TO ('%s')", table, table, ts(start), boundary))
	exec(t, db, fmt.Sprintf("CREATE TABLE %s_after PARTITION OF %s FOR VALUES FROM ('%s') TO ('%s')", table, table, boundary, ts(end)))
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

// Partitions past the window are dropped whole; the rest stay. A purger round
// in partitioned mode does the same and creates the coming days.
// Partitions are created and dropped by the database clock, whatever the
// session's DateStyle and pgx query mode: in the exec and simple_protocol
// modes (those a transaction-mode pooler needs) pgx reads a timestamptz
// from its text, which only DateStyle ISO gives, and a role with DateStyle
// 'SQL, DMY' failed InitializeSchema and every Purger round (no partition
// ahead was created, and the claims failed once they ran out).
func TestDropPartitions(t *testing.T) {
	for name, param := range map[string]string{
		"defaults":                 "",
		"DateStyle SQL, DMY, exec": "DateStyle=SQL,DMY&default_query_exec_mode=exec",
		"DateStyle German, simple": "DateStyle=German&default_query_exec_mode=simple_protocol",
	} {
		t.Run(name, func(t *testing.T) { dropPartitionsUnder(t, param) })
	}
}

// dropPartitionsUnder is TestDropPartitions on a pool whose connections
// have param; the test's own reads go through a pool at the defaults.
func dropPartitionsUnder(t *testing.T, param string) {
	db := testdb.OpenPostgres(t, param)
	plain := testdb.OpenPostgres(t, "")
	table := dailyPartitionedTable(t, plain)
	ctx := context.Background()
	ib, err := inbox.New(inbox.Config{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table})
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.InitializeSchema(ctx); err != nil {
		t.Fatal(err)
	}
	if err := inbox.CreatePartitions(ctx, db, table, dbNow(t, plain).AddDate(0, 0, -9), 9); err != nil {
		t.Fatal(err)
	}
	for day := -9; day <= 0; day++ { // one row at noon UTC of each of the last ten days (today: now)
		exec(t, plain, fmt.Sprintf(`INSERT INTO %s VALUES ('billing', 'day%d',
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
	if len(dropped) != 6 || !strings.HasSuffix(dropped[0].Name, dbNow(t, plain).UTC().AddDate(0, 0, -9).Format("_p20060102")) {
		t.Errorf("dropped %+v, want the 6 partitions of days -9 to -4", dropped)
	}
	var rows int64
	for _, d := range dropped {
		rows += d.Rows
	}
	if rows != 6 || count(t, plain, table, "") != 4 {
		t.Errorf("dropped %d rows, %d left; want 6 and 4", rows, count(t, plain, table, ""))
	}

	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{
		DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table, OlderThan: 24 * time.Hour,
	}})
	if err != nil {
		t.Fatal(err)
	}
	round := p.RunOnce(ctx)
	if round.Err != nil || len(round.DroppedPartitions) != 2 || round.Deleted != 2 || round.Window != 24*time.Hour {
		t.Errorf("purger round = %+v, want days -3 and -2 dropped under a 24h window", round)
	}
	// Oldest row left: yesterday noon, in yesterday's partition, which
	// ended at the start of today: within the window, as after a deleting
	// round (its start, a day earlier, was past it on every healthy table).
	today := dbNow(t, plain).UTC().Truncate(24 * time.Hour)
	if want := dbNow(t, plain).Sub(today); round.OldestAge < want-time.Minute || round.OldestAge > want+time.Minute || round.OldestAge > round.Window {
		t.Errorf("oldest age = %v, want about %v (the end of yesterday's partition) and within the %v window", round.OldestAge, want, round.Window)
	}
	var ahead bool
	if err := plain.Get(&ahead, "SELECT to_regclass($1) IS NOT NULL", table+dbNow(t, plain).UTC().AddDate(0, 0, inbox.DefaultPartitionsAhead).Format("_p20060102")); err != nil || !ahead {
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

// The key lock is keyed by the table, not by how its name is written: two
// instances of one service that name the same table "inbox_x" and
// "public.inbox_x" (one from a config file, one from an env var) exclude each
// other, and one message delivered to both at once is processed once. (The
// NOT EXISTS cannot see the other's uncommitted row, and the primary key
// includes processed_at: the key lock is all that excludes them.)
func TestPartitioned_KeyLockIsKeyedByTheTableNotItsSpelling(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	table := "inbox_" + randomSuffix()
	t.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + table + " CASCADE") })
	a := newPartitionedInbox(t, db, table, nil)
	b := newPartitionedInbox(t, db, "public."+table, nil)
	if n := concurrentTwice(t, a, b); n != 1 {
		t.Errorf("handler ran %d times for one message (tables %q and %q), want 1; inbox rows: %d",
			n, table, "public."+table, count(t, db, table, ""))
	}
}

// PostgreSQLPartitioned claims at READ COMMITTED also when TxOptions is set
// with Isolation LevelDefault and the server's default_transaction_isolation
// is REPEATABLE READ. (At REPEATABLE READ the key-lock statement would take
// the snapshot before the lock is granted, and the NOT EXISTS would miss the
// first claim.) One message delivered twice at once is processed once.
func TestPartitioned_ClaimsAtReadCommittedWhateverTheServerDefault(t *testing.T) {
	db := testdb.OpenPostgres(t, "default_transaction_isolation=repeatable%20read")
	table := "inbox_" + randomSuffix()
	t.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + table + " CASCADE") })
	var level string
	if err := db.Get(&level, "SHOW default_transaction_isolation"); err != nil || level != "repeatable read" {
		t.Fatalf("session default %q, %v", level, err)
	}
	ib := newPartitionedInbox(t, db, table, &sql.TxOptions{}) // New accepts it
	if n := concurrentTwice(t, ib, ib); n != 1 {
		t.Errorf("handler ran %d times for one message, want 1; inbox rows: %d", n, count(t, db, table, ""))
	}
}

// Live claims while partitions are attached (two CreatePartitions at once)
// and old ones detached and dropped: no claim fails, none waits long, no
// message is processed twice.
func TestPartitioned_LiveClaimsNeitherFailNorRepeatDuringMaintenance(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	db.SetMaxOpenConns(16)
	table := "inbox_" + randomSuffix()
	t.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + table + " CASCADE") })
	ib := newPartitionedInboxEvery(t, db, table, nil, inbox.PartitionWeek)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Second)
	defer cancel()
	var calls, errs atomic.Int64
	var maxLat atomic.Int64
	ids := make([]string, 200)
	for i := range ids {
		ids[i] = watermill.NewUUID()
	}
	h := ib.Middleware(func(*message.Message) ([]*message.Message, error) { calls.Add(1); return nil, nil })
	var wg sync.WaitGroup
	for w := range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ctx.Err() == nil; i++ {
				s := time.Now()
				if _, err := h(message.NewMessage(ids[(i*7+w)%len(ids)], nil)); err != nil {
					errs.Add(1)
					t.Log(err)
				}
				if d := int64(time.Since(s)); d > maxLat.Load() {
					maxLat.Store(d)
				}
			}
		}()
	}
	now := dbNow(t, db)
	for round := 0; ctx.Err() == nil; round++ {
		var mw sync.WaitGroup
		for range 2 {
			mw.Add(1)
			go func() {
				defer mw.Done()
				if err := inbox.CreatePartitions(context.Background(), db, table, now.AddDate(0, 0, -40+round%20), 5); err != nil {
					t.Errorf("create: %v", err)
				}
			}()
		}
		mw.Wait()
		if _, err := inbox.DropPartitions(context.Background(), db, table, 10*24*time.Hour, nil); err != nil {
			t.Errorf("drop: %v", err)
		}
	}
	wg.Wait()
	if errs.Load() != 0 || calls.Load() != int64(len(ids)) {
		t.Errorf("claim errors %d, handler calls %d for %d distinct messages", errs.Load(), calls.Load(), len(ids))
	}
	t.Logf("max claim latency %v, calls %d", time.Duration(maxLat.Load()), calls.Load())
}

// A partition left "pending detach" by an interrupted DETACH PARTITION ...
// CONCURRENTLY is dropped by the next call, and Purger rounds keep working.
// DETACH ... CONCURRENTLY waits for every transaction that uses the parent (a
// slow handler); here the role's statement_timeout, as many deployments set,
// cancels it during that wait (pg_cancel_backend or a server-side cancel
// would do the same). The next calls finish the detach (DETACH ... FINALIZE)
// instead of starting it again.
func TestDropPartitions_FinishesADetachLeftPendingByAnInterruption(t *testing.T) {
	db := testdb.OpenPostgres(t, "statement_timeout=1000")
	table := "inbox_" + randomSuffix()
	t.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + table + " CASCADE") })
	newPartitionedInbox(t, db, table, nil)
	ctx := context.Background()
	if err := inbox.CreatePartitions(ctx, db, table, dbNow(t, db).AddDate(0, 0, -5), 3); err != nil {
		t.Fatal(err)
	}
	exec(t, db, "INSERT INTO "+table+" VALUES ('billing', 'old', now() - interval '4 days')")

	// A slow handler: a transaction that has touched the inbox table.
	slow, err := db.BeginTxx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := slow.Exec("SELECT count(*) FROM " + table + " WHERE consumer = 'x'"); err != nil {
		t.Fatal(err)
	}
	if _, err = inbox.DropPartitions(ctx, db, table, 48*time.Hour, nil); err == nil {
		t.Fatal("DropPartitions finished although a transaction used the parent past statement_timeout")
	}
	slow.Rollback()

	var pending int
	if err := db.Get(&pending, "SELECT count(*) FROM pg_inherits WHERE inhparent = $1::regclass AND inhdetachpending", table); err != nil {
		t.Fatal(err)
	}
	if pending != 1 {
		t.Fatalf("partitions pending detach after the interruption: %d, want 1", pending)
	}

	// The later calls run without the statement_timeout: DETACH ... FINALIZE
	// waits for every older snapshot in the database, and the other tests'
	// open transactions may hold one for longer than a second.
	later := testdb.OpenPostgres(t, "")
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for i := range 2 {
		dropped, err := inbox.DropPartitions(ctx, later, table, 48*time.Hour, nil)
		if err != nil {
			t.Errorf("drop #%d after the interruption: %v (dropped %v)", i+1, err, dropped)
		} else {
			t.Logf("drop #%d: dropped %v", i+1, dropped)
		}
	}
	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: later, Dialect: inbox.PostgreSQLPartitioned, Table: table, OlderThan: 48 * time.Hour}})
	if err != nil {
		t.Fatal(err)
	}
	if round := p.RunOnce(ctx); round.Err != nil {
		t.Errorf("purger round: %v", round.Err)
	}
	var left int
	if err := db.Get(&left, `SELECT count(*) FROM pg_class WHERE relkind = 'r' AND relname LIKE $1 ESCAPE '!'`, table+"!_p%"); err != nil {
		t.Fatal(err)
	}
	if left != 9 {
		t.Errorf("partition tables left: %d, want 9 (yesterday to today+7)", left)
	}
}

// An unqualified table whose parent is found through a search_path whose
// first schema is not the parent's (e.g. the default "$user", public once a
// schema named after the role exists): DropPartitions and a Purger round
// still find its partitions and remove the expired rows, wherever
// CreatePartitions put the partitions.
func TestDropPartitions_FindsThePartitionsWhateverTheSearchPath(t *testing.T) {
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
	if err := inbox.InitializePartitions(ctx, db, table, inbox.PartitionDay); err != nil {
		t.Fatal(err)
	}
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

// A partition from MINVALUE is dropped once its end passes the window, as
// any other, so a round's oldest row age goes by its end too: it read its
// oldest row, and a healthy round that rightly dropped nothing reported an
// age past the window (InboxPurgeFallingBehind fired until the partition's
// end passed the cutoff).
func TestPurgerRoundMeasuresAPartitionFromMinvalueByItsEnd(t *testing.T) {
	ctx := context.Background()
	db := testdb.OpenPostgres(t, "")
	table := "inbox_" + randomSuffix()
	dropLater(t, db, table)
	if err := inbox.InitializePartitions(ctx, db, table, inbox.PartitionDay); err != nil {
		t.Fatal(err)
	}
	yesterday := dbNow(t, db).UTC().Truncate(24*time.Hour).AddDate(0, 0, -1)
	exec(t, db, "CREATE TABLE "+table+"_old PARTITION OF "+table+" FOR VALUES FROM (MINVALUE) TO ('"+yesterday.Format(time.RFC3339)+"')")
	dropLater(t, db, table+"_old")
	insertRows(t, db, inbox.PostgreSQLPartitioned, table, "billing", "old", 1, 72*time.Hour)
	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{
		DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table, OlderThan: 48 * time.Hour,
	}})
	if err != nil {
		t.Fatal(err)
	}
	round := p.RunOnce(ctx)
	if round.Err != nil || len(round.DroppedPartitions) != 0 {
		t.Fatalf("round = %+v, want nothing dropped (the partition from MINVALUE ends within the 48h window)", round)
	}
	if want := dbNow(t, db).Sub(yesterday); round.OldestAge < want-time.Minute || round.OldestAge > want+time.Minute {
		t.Errorf("oldest age = %v, want about %v (the partition's end), within the %v window", round.OldestAge, want, round.Window)
	}
}
