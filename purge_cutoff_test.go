package inbox_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// agingRows adds, to a new inbox table, 12 rows processed an hour ago and
// 20 processed between 1.5 s and 0.55 s ago, which pass the window (3 s) one after
// the other over the next second or two, and returns the table.
func agingRows(t *testing.T, db *sqlx.DB, d inbox.Dialect) string {
	t.Helper()
	table := "inbox_cutoff_" + randomSuffix()
	dropLater(t, db, table)
	ib, err := inbox.New(inbox.Config{DB: db, Table: table, Dialect: d})
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	insertRows(t, db, d, table, "billing", "old", 12, time.Hour)
	var values []string
	for i := range 20 {
		values = append(values, fmt.Sprintf("('billing', 'young-%d', %s)", i, agoSQL(d, 1500*time.Millisecond-time.Duration(i)*50*time.Millisecond)))
	}
	exec(t, db, "INSERT INTO "+table+" (consumer, message_id, processed_at) VALUES "+strings.Join(values, ", "))
	return table
}

// window is the purges' window here: 1.5 s more than the young rows' age
// when they are written, room for a loaded machine to reach the purge's
// check before the first of them passes it.
const window = 3 * time.Second

// raisedWindow is a WindowSource whose first answer is window and every later
// one an hour: a retention raised right after a purge checked its window.
type raisedWindow struct{ asked atomic.Int32 }

func (w *raisedWindow) SafeWindow(context.Context) (time.Duration, error) {
	if w.asked.Add(1) == 1 {
		return window, nil
	}
	return time.Hour, nil
}

// slowPurge is a purge of one row a batch, 200 ms apart: the 12 expired
// rows take it about 2.4 s, while the 20 young rows pass the window.
func slowPurge(db *sqlx.DB, d inbox.Dialect, table string) inbox.PurgeConfig {
	return inbox.PurgeConfig{DB: db, Dialect: d, Table: table, Window: &raisedWindow{}, BatchSize: 1, DutyCycle: 1, Pause: 200 * time.Millisecond}
}

// A purge keeps the cutoff of its window check: rows that age past the
// window while it runs are left for the next purge, which asks the window
// source again. Its cutoff followed the clock from batch to batch, so a
// long purge went on deleting rows by the window it read at its start after
// the source had raised it (a topic's retention raised, or set to -1, while a
// large backlog was purged): those messages, replayed, were processed twice.
func TestPurgeKeepsRowsThatAgePastItsWindowWhileItRuns(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		table := agingRows(t, db, tdb.Dialect)
		deleted, err := inbox.Purge(context.Background(), slowPurge(db, tdb.Dialect, table))
		if err != nil {
			t.Fatalf("purge: %v", err)
		}
		if young := count(t, db, table, "message_id LIKE 'young%'"); young != 20 || deleted != 12 {
			t.Errorf("purge deleted %d rows, %d of the 20 rows younger than its window at its start left; want the 12 expired rows deleted, all 20 left",
				deleted, young)
		}
	})
}

// The same through a Purger round limited to a consumer (on the
// partitioned dialect, the round's deletes beside its partition drops): the
// round deletes by the window it reports.
func TestPurgerRoundKeepsRowsThatAgePastItsWindowWhileItRuns(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		table := agingRows(t, db, tdb.Dialect)
		cfg := slowPurge(db, tdb.Dialect, table)
		cfg.Consumer = "billing"
		p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: cfg})
		if err != nil {
			t.Fatal(err)
		}
		r := p.RunOnce(context.Background())
		if r.Err != nil {
			t.Fatalf("round: %v", r.Err)
		}
		if young := count(t, db, table, "message_id LIKE 'young%'"); young != 20 || r.Deleted != 12 || r.Window != window {
			t.Errorf("round deleted %d rows by a window of %v, %d of the 20 rows younger than it at its start left; want 12, 3s, 20",
				r.Deleted, r.Window, young)
		}
	})
}

// holdOnlyConnection has another user of db take its one free connection
// for 2 s, the first time it is called.
func holdOnlyConnection(t *testing.T, db *sqlx.DB) func() {
	var once sync.Once
	return func() {
		once.Do(func() {
			conn, err := db.Conn(context.Background())
			if err != nil {
				t.Error(err)
				return
			}
			go func() { time.Sleep(2 * time.Second); conn.Close() }()
		})
	}
}

// A batch that waits for a pool connection deletes by the cutoff of the
// purge's start all the same: a batch whose window was counted when its
// statement was built went on against the database's time once it got a
// connection, and deleted rows that had aged past the window meanwhile.
func TestPurgeBatchThatWaitsForAConnectionKeepsTheCutoff(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		table := agingRows(t, db, tdb.Dialect)
		db.SetMaxOpenConns(1)
		cfg := inbox.WithPurgeBatchHooks(inbox.PurgeConfig{DB: db, Dialect: tdb.Dialect, Table: table, OlderThan: window, DutyCycle: 1},
			holdOnlyConnection(t, db), nil)
		deleted, err := inbox.Purge(context.Background(), cfg)
		if err != nil {
			t.Fatalf("purge: %v", err)
		}
		if young := count(t, db, table, "message_id LIKE 'young%'"); young != 20 || deleted != 12 {
			t.Errorf("purge deleted %d rows, %d of the 20 rows younger than its window at its start left; want 12 deleted, 20 left", deleted, young)
		}
	})
}

// The same for a Purger round on PostgreSQL, whose batches run on the pool
// beside the lock's connection.
func TestPurgerRoundBatchThatWaitsForAConnectionKeepsTheCutoff(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	table := agingRows(t, db, inbox.PostgreSQL)
	db.SetMaxOpenConns(2)
	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Table: table, Window: &raisedWindow{}, DutyCycle: 1}})
	if err != nil {
		t.Fatal(err)
	}
	inbox.WithPurgerBatchHooks(p, holdOnlyConnection(t, db), nil)
	r := p.RunOnce(context.Background())
	if r.Err != nil {
		t.Fatalf("round: %v", r.Err)
	}
	if young := count(t, db, table, "message_id LIKE 'young%'"); young != 20 || r.Deleted != 12 {
		t.Errorf("round (window %v) deleted %d rows, %d of the 20 rows younger than its window at its check left; want 12 deleted, 20 left",
			r.Window, r.Deleted, young)
	}
}

// A batch retried after a lock wait timeout deletes by the purge's cutoff:
// run again with the window it was built with, it deleted rows that had aged
// past the window during the failed attempt.
func TestPurgeBatchRetriedAfterALockTimeoutKeepsTheCutoff(t *testing.T) {
	for _, c := range []struct {
		name string
		d    inbox.Dialect
		open func(t *testing.T) *sqlx.DB
		lock string
	}{
		{"postgres", inbox.PostgreSQL, func(t *testing.T) *sqlx.DB { return testdb.OpenPostgres(t, "lock_timeout=1000") },
			"SELECT 1 FROM %s WHERE message_id = 'old-0' FOR UPDATE"},
		{"mysql", inbox.MySQL, func(t *testing.T) *sqlx.DB { return testdb.OpenMySQL(t, "innodb_lock_wait_timeout=1") },
			"SELECT 1 FROM %s WHERE consumer = 'billing' AND message_id = 'old-0' FOR UPDATE"},
	} {
		t.Run(c.name, func(t *testing.T) {
			db := c.open(t)
			table := agingRows(t, db, c.d)
			tx, err := db.Beginx() // another transaction holds an expired row for 2 s
			if err != nil {
				t.Fatal(err)
			}
			if _, err := tx.Exec(fmt.Sprintf(c.lock, table)); err != nil {
				t.Fatal(err)
			}
			go func() { time.Sleep(2 * time.Second); _ = tx.Rollback() }()
			deleted, err := inbox.Purge(context.Background(), inbox.PurgeConfig{DB: db, Dialect: c.d, Table: table, OlderThan: window, DutyCycle: 1})
			if err != nil {
				t.Fatalf("purge: %v", err)
			}
			if young := count(t, db, table, "message_id LIKE 'young%'"); young != 20 || deleted != 12 {
				t.Errorf("purge deleted %d rows, %d of the 20 rows younger than its window at its start left; want 12 deleted, 20 left", deleted, young)
			}
		})
	}
}

// A row written by hand with processed_at '-infinity' (PostgreSQL takes
// it: a backfill of rows processed at an unknown time) is purged, and the
// oldest-row age of a round is read beside one: the batch's resume bound
// failed to convert it ("cannot convert infinity to bigint") and rolled the
// batch back, so every purge failed on the same rows; the age read failed
// on its subtraction.
func TestPurgeOfAnInfiniteProcessedAt(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	table := "inbox_infinite_" + randomSuffix()
	dropLater(t, db, table)
	ib, err := inbox.New(inbox.Config{DB: db, Table: table})
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	exec(t, db, "INSERT INTO "+table+" (consumer, message_id, processed_at) VALUES ('billing', 'backfilled', '-infinity'), ('shipping', 'backfilled', '-infinity')")
	insertRows(t, db, inbox.PostgreSQL, table, "billing", "recent", 5, time.Minute)
	n, err := inbox.Purge(context.Background(), inbox.PurgeConfig{DB: db, Table: table, OlderThan: time.Hour, Consumer: "billing"})
	if err != nil || n != 1 {
		t.Fatalf("purge: deleted %d, %v; want the backfilled row of billing deleted", n, err)
	}
	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Table: table, OlderThan: time.Hour, Consumer: "billing"}})
	if err != nil {
		t.Fatal(err)
	}
	r := p.RunOnce(context.Background())
	if r.Err != nil || r.OldestAge < time.Minute || r.OldestAge > time.Hour {
		t.Errorf("round beside shipping's '-infinity' row: oldest %v (table %v), %v; want billing's minute-old rows", r.OldestAge, r.TableOldestAge, r.Err)
	}
	if st, err := inbox.Stats(context.Background(), db, nil, table); err != nil || st.Rows == 0 {
		t.Errorf("Stats beside shipping's '-infinity' row: %+v, %v", st, err)
	}
}

// askedWindow is a WindowSource that reports window and closes asked at
// its first call.
type askedWindow struct {
	window time.Duration
	once   sync.Once
	asked  chan struct{}
}

func (w *askedWindow) SafeWindow(context.Context) (time.Duration, error) {
	w.once.Do(func() { close(w.asked) })
	return w.window, nil
}

// DropPartitions keeps the cutoff of its window check while it waits for
// the purge lock (another instance's round holds it): a partition whose
// bound was inside the window at the check is kept, however long the wait.
// Its cutoff was read after the lock was granted, so each second of the
// wait moved it forward, and it dropped a partition whose row was inside
// the window it had checked (and inside the source's window when it
// dropped it, a retention raised meanwhile): that message, replayed, was
// processed twice.
func TestDropPartitionsKeepsTheCutoffOfItsCheckWhileItWaitsForTheLock(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	ctx := context.Background()
	table := dailyPartitionedTable(t, db)
	const retention = 48 * time.Hour
	// A partition whose upper bound is 3 s inside the window, and a row in
	// it 1 s inside.
	exec(t, db, "CREATE TABLE "+table+"_by_hand PARTITION OF "+table+
		" FOR VALUES FROM (now() - interval '49 hours') TO (now() - interval '48 hours' + interval '3 seconds')")
	exec(t, db, "INSERT INTO "+table+" (consumer, message_id, processed_at) VALUES ('billing', 'inside', now() - interval '48 hours' + interval '1 second')")
	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table, OlderThan: retention}})
	if err != nil {
		t.Fatal(err)
	}
	key, err := inbox.PurgeLockKey(ctx, db, p)
	if err != nil {
		t.Fatal(err)
	}
	holder, err := db.BeginTxx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback()
	if _, err := holder.Exec("SELECT pg_advisory_xact_lock($1)", key); err != nil {
		t.Fatal(err)
	}
	src := &askedWindow{window: retention, asked: make(chan struct{})}
	type result struct {
		dropped []inbox.DroppedPartition
		err     error
	}
	done := make(chan result, 1)
	go func() {
		dropped, err := inbox.DropPartitions(ctx, db, table, retention, src)
		done <- result{dropped, err}
	}()
	<-src.asked
	time.Sleep(5 * time.Second) // another round's lock, held a few seconds: the partition's bound passes the clock's cutoff
	if err := holder.Rollback(); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if r.err != nil {
		t.Fatalf("DropPartitions: %v", r.err)
	}
	if n := count(t, db, table, "message_id = 'inside'"); n != 1 {
		t.Errorf("DropPartitions dropped %v: the row 1 s inside the window at its check is gone;"+
			" want its partition kept until its bound passes the check's cutoff", r.dropped)
	}
}
