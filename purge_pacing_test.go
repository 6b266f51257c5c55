package inbox_test

import (
	"context"
	"database/sql"
	"errors"
	"math"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// pacingLog records what the pacing hook saw: each full batch's duration
// and the pause chosen after it.
type pacingLog struct {
	mu      sync.Mutex
	batches []time.Duration
	pauses  []time.Duration
}

func (l *pacingLog) record(batch, pause time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.batches = append(l.batches, batch)
	l.pauses = append(l.pauses, pause)
}

// cost is what the pacer takes as the cost of full batch i: the shortest of
// it and the 7 full batches before it.
func cost(batches []time.Duration, i int) time.Duration {
	return slices.Min(batches[max(0, i-7) : i+1])
}

func sum(ds []time.Duration) (total time.Duration) {
	for _, d := range ds {
		total += d
	}
	return total
}

// pacedPurger returns a Purger of table with the given pacing whose batch
// hooks are before and log.
func pacedPurger(t *testing.T, db *sqlx.DB, table string, cfg inbox.PurgeConfig, before func(), log *pacingLog) *inbox.Purger {
	t.Helper()
	cfg.DB, cfg.Table, cfg.OlderThan = db, table, time.Hour
	if d, ok := dialectOf.Load(db); ok {
		cfg.Dialect = d.(inbox.Dialect)
	}
	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: cfg})
	if err != nil {
		t.Fatal(err)
	}
	inbox.WithPurgerBatchHooks(p, before, log.record)
	return p
}

// After every full batch the purge pauses at least (1-DutyCycle)/DutyCycle
// times the batch's cost (the shortest of the last 8 full batches), and the
// round reports those pauses and
// batches. A partitioned table's round drops partitions and reports no
// pacing.
func TestPurgePacesBatchesByTheirDuration(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		f := newFixture(t, db)
		f.newInbox(inbox.Config{})
		insertRows(t, db, tdb.Dialect, f.inbox, "billing", "old", 45, 2*time.Hour)
		insertRows(t, db, tdb.Dialect, f.inbox, "billing", "recent", 5, 30*time.Minute)
		const duty = 0.25
		var log pacingLog
		p := pacedPurger(t, db, f.inbox, inbox.PurgeConfig{BatchSize: 10, DutyCycle: duty, MaxPause: time.Minute}, nil, &log)
		round := p.RunOnce(context.Background())
		if round.Err != nil {
			t.Fatal(round.Err)
		}
		if tdb.Dialect == inbox.PostgreSQLPartitioned {
			if round.Pacing != (inbox.PurgePacing{}) || len(log.pauses) != 0 {
				t.Errorf("partition drop: pacing %+v, pauses %v; want none", round.Pacing, log.pauses)
			}
			return
		}
		if round.Deleted != 45 || f.inboxRows() != 5 {
			t.Fatalf("deleted %d, %d rows left; want 45 deleted, 5 left", round.Deleted, f.inboxRows())
		}
		// 4 full batches, each followed by a pause, and the short fifth.
		if len(log.pauses) != 4 || round.Pacing.Batches != 5 {
			t.Fatalf("pauses %v, pacing %+v; want 4 pauses and 5 batches", log.pauses, round.Pacing)
		}
		for i, pause := range log.pauses {
			want := time.Duration(float64(cost(log.batches, i)) * (1 - duty) / duty)
			if pause < want-time.Nanosecond {
				t.Errorf("pause %d = %v after a batch costing %v, want at least %v", i, pause, cost(log.batches, i), want)
			}
		}
		if round.Pacing.Paused < sum(log.pauses) {
			t.Errorf("reported paused %v, want at least the pauses chosen, %v", round.Pacing.Paused, sum(log.pauses))
		}
		if round.Pacing.BatchTime < sum(log.batches) {
			t.Errorf("reported batch time %v, want at least the full batches' %v", round.Pacing.BatchTime, sum(log.batches))
		}
		bt, paused := float64(round.Pacing.BatchTime), float64(round.Pacing.Paused)
		if got, want := round.Pacing.DutyCycle, bt/(bt+paused); math.Abs(got-want) > 1e-9 || got <= 0 || got >= 1 {
			t.Errorf("effective duty cycle %v, want %v, in (0, 1)", got, want)
		}
	})
}

// MaxPause caps every pacing pause; Pause is added on top of it.
func TestPurgePauseIsCappedByMaxPause(t *testing.T) {
	db := sqliteDB(t)
	f := newFixture(t, db)
	f.newInbox(inbox.Config{})
	insertRows(t, db, inbox.SQLite, f.inbox, "billing", "old", 30, 2*time.Hour)
	var log pacingLog
	cfg := inbox.WithPurgeBatchHooks(inbox.PurgeConfig{
		DB: db, Table: f.inbox, OlderThan: time.Hour, BatchSize: 10,
		DutyCycle: 0.001, MaxPause: time.Microsecond, Pause: 2 * time.Microsecond,
	}, nil, log.record)
	if n, err := inbox.Purge(context.Background(), cfg); err != nil || n != 30 {
		t.Fatalf("purge: %d, %v; want 30, nil", n, err)
	}
	if len(log.pauses) != 3 {
		t.Fatalf("pauses %v, want 3", log.pauses)
	}
	for _, pause := range log.pauses {
		if pause > 3*time.Microsecond || pause < 2*time.Microsecond {
			t.Errorf("pause %v, want MaxPause 1µs at most plus Pause 2µs", pause)
		}
	}
}

// One slow batch does not change the pacing (a checkpoint or a wait for a
// core is not the purge's cost); a slowdown of every batch does: once the
// last 8 full batches were all slow, the pause grows beyond the duty
// cycle's share of the cost (a back-off), and the round counts it.
func TestPurgeBacksOffWhenBatchesSlowDown(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if tdb.Dialect == inbox.PostgreSQLPartitioned {
			t.Skip("partitioned rounds drop partitions: no batches to pace")
		}
		f := newFixture(t, db)
		f.newInbox(inbox.Config{})
		insertRows(t, db, tdb.Dialect, f.inbox, "billing", "old", 205, 2*time.Hour)
		// Batch 3 alone is slowed, then every batch from 8 on.
		const duty, lone, from = 0.9, 3, 8
		var log pacingLog
		batch := 0
		var slowBy time.Duration
		slowdown := func() { // runs inside the batch's measured time
			if batch == lone || batch == from {
				log.mu.Lock()
				slowBy = 5*slices.Max(log.batches) + 20*time.Millisecond
				log.mu.Unlock()
			}
			if batch == lone || batch >= from {
				time.Sleep(slowBy)
			}
			batch++
		}
		p := pacedPurger(t, db, f.inbox, inbox.PurgeConfig{BatchSize: 10, DutyCycle: duty, MaxPause: time.Minute}, slowdown, &log)
		round := p.RunOnce(context.Background())
		if round.Err != nil || round.Deleted != 205 {
			t.Fatalf("round %+v, want 205 deleted", round)
		}
		if len(log.pauses) != 20 {
			t.Fatalf("pauses %v, want 20", log.pauses)
		}
		ratio := (1 - duty) / duty
		if pause, fast := log.pauses[lone], cost(log.batches, lone-1); pause > time.Duration(2*ratio*float64(fast)) {
			t.Errorf("pause after the lone slow batch (%v) = %v, want the fast batches' share (about %v)", log.batches[lone], pause, time.Duration(ratio*float64(fast)))
		}
		if round.Pacing.BackOffs < 1 {
			t.Errorf("back-offs = %d, want at least 1 once every recent batch was slow", round.Pacing.BackOffs)
		}
		last := from + 7 // the first full batch whose window holds only slow ones
		if want := 2 * time.Duration(float64(cost(log.batches, last))*ratio); log.pauses[last] < want-time.Nanosecond {
			t.Errorf("pause after 8 slow batches (cost %v) = %v, want at least twice the duty cycle's share, %v", cost(log.batches, last), log.pauses[last], want)
		}
	})
}

// A cancelled context ends a paced purge while it pauses, with the
// context's error; the batches before stay deleted, and a Purger's lock is
// free again.
func TestPurgeStopsDuringPauseWhenContextEnds(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if tdb.Dialect == inbox.PostgreSQLPartitioned {
			t.Skip("partitioned rounds drop partitions: no batches to pace")
		}
		f := newFixture(t, db)
		f.newInbox(inbox.Config{})
		insertRows(t, db, tdb.Dialect, f.inbox, "billing", "old", 50, 2*time.Hour)

		// Plain Purge: an hour's Pause, cancelled as it starts.
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		cfg := inbox.WithPurgeBatchHooks(inbox.PurgeConfig{
			DB: db, Dialect: tdb.Dialect, Table: f.inbox, OlderThan: time.Hour, BatchSize: 10, Pause: time.Hour,
		}, nil, func(time.Duration, time.Duration) { cancel() })
		n, err := inbox.Purge(ctx, cfg)
		if n != 10 || !errors.Is(err, context.Canceled) {
			t.Fatalf("purge: %d, %v; want 10 and context.Canceled", n, err)
		}
		if f.inboxRows() != 40 {
			t.Errorf("rows left = %d, want 40", f.inboxRows())
		}

		// A Purger round: pacing pauses of up to an hour.
		ctx, cancel = context.WithCancel(context.Background())
		defer cancel()
		var log pacingLog
		p := pacedPurger(t, db, f.inbox, inbox.PurgeConfig{BatchSize: 10, DutyCycle: 1e-9, MaxPause: time.Hour}, nil, &log)
		inbox.WithPurgerBatchHooks(p, nil, func(b, pause time.Duration) { log.record(b, pause); cancel() })
		round := p.RunOnce(ctx)
		if !errors.Is(round.Err, context.Canceled) || round.Deleted != 10 || round.Pacing.Batches != 1 {
			t.Errorf("round %+v, want 10 deleted in 1 batch and context.Canceled", round)
		}
		if f.inboxRows() != 30 {
			t.Errorf("rows left = %d, want 30", f.inboxRows())
		}
		if !eventuallyLockFree(t, tdb.Open(t), tdb.Dialect, f.inbox) {
			t.Error("the purge lock is still held after the cancelled round")
		}
	})
}

// DutyCycle 1 with no Pause runs the batches back to back: no pause, no
// back-off.
func TestPurgeFlatOutDoesNotPause(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if tdb.Dialect == inbox.PostgreSQLPartitioned {
			t.Skip("partitioned rounds drop partitions: no batches to pace")
		}
		f := newFixture(t, db)
		f.newInbox(inbox.Config{})
		insertRows(t, db, tdb.Dialect, f.inbox, "billing", "old", 50, 2*time.Hour)
		var log pacingLog
		p := pacedPurger(t, db, f.inbox, inbox.PurgeConfig{BatchSize: 10, DutyCycle: 1}, nil, &log)
		round := p.RunOnce(context.Background())
		if round.Err != nil || round.Deleted != 50 {
			t.Fatalf("round %+v, want 50 deleted", round)
		}
		if len(log.pauses) != 5 {
			t.Fatalf("pauses %v, want 5 decisions", log.pauses)
		}
		for _, pause := range log.pauses {
			if pause != 0 {
				t.Errorf("pauses %v, want all 0", log.pauses)
				break
			}
		}
		if pc := round.Pacing; pc.Paused != 0 || pc.BackOffs != 0 || pc.DutyCycle != 1 || pc.Batches != 6 {
			t.Errorf("pacing %+v, want 6 batches, nothing paused, duty cycle 1", pc)
		}
	})
}

// The zero pacing fields are the defaults: a duty cycle of 0.1, so each
// pause is at least 9 times its batch (and at most MaxPause's 1 s).
func TestPurgeDefaultPacing(t *testing.T) {
	db := sqliteDB(t)
	f := newFixture(t, db)
	f.newInbox(inbox.Config{})
	insertRows(t, db, inbox.SQLite, f.inbox, "billing", "old", 25, 2*time.Hour)
	var log pacingLog
	cfg := inbox.WithPurgeBatchHooks(inbox.PurgeConfig{DB: db, Table: f.inbox, OlderThan: time.Hour, BatchSize: 10}, nil, log.record)
	if n, err := inbox.Purge(context.Background(), cfg); err != nil || n != 25 {
		t.Fatalf("purge: %d, %v; want 25, nil", n, err)
	}
	if len(log.pauses) != 2 {
		t.Fatalf("pauses %v, want 2", log.pauses)
	}
	ratio := (1 - inbox.DefaultPurgeDutyCycle) / inbox.DefaultPurgeDutyCycle
	for i, pause := range log.pauses {
		want := min(time.Duration(float64(cost(log.batches, i))*ratio), inbox.DefaultPurgeMaxPause)
		if pause < want-time.Nanosecond || pause > inbox.DefaultPurgeMaxPause {
			t.Errorf("pause %v after a batch costing %v, want between %v and %v", pause, cost(log.batches, i), want, inbox.DefaultPurgeMaxPause)
		}
	}
}

// While a Purger's round pauses between batches it holds the purge lock
// and nothing else that could hold the database back: on PostgreSQL the
// lock's transaction has no transaction id and no snapshot (so it holds
// back no vacuum and no DETACH PARTITION ... CONCURRENTLY), and no lock on
// the table is held; on MySQL/MariaDB the session that holds GET_LOCK has no
// open InnoDB transaction.
func TestPurgerPausedRoundHoldsOnlyTheLock(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if tdb.Dialect != inbox.PostgreSQL && tdb.Dialect != inbox.MySQL {
			t.Skip("SQLite takes no purge lock; partitioned rounds drop partitions")
		}
		f := newFixture(t, db)
		f.newInbox(inbox.Config{})
		insertRows(t, db, tdb.Dialect, f.inbox, "billing", "old", 30, 2*time.Hour)
		ctx := context.Background()
		probe := tdb.Open(t)
		p := pacedPurger(t, db, f.inbox, inbox.PurgeConfig{BatchSize: 10}, nil, &pacingLog{})
		key, err := inbox.PurgeLockKey(ctx, probe, p)
		if err != nil {
			t.Fatal(err)
		}
		var checks int
		inbox.WithPurgerBatchHooks(p, nil, func(time.Duration, time.Duration) {
			checks++
			if tdb.Dialect == inbox.PostgreSQL {
				checkPausedPostgres(t, probe, f.inbox, key)
			} else {
				checkPausedMySQL(t, probe, key)
			}
		})
		round := p.RunOnce(ctx)
		if round.Err != nil || round.Deleted != 30 || checks != 3 {
			t.Fatalf("round %+v with %d checks; want 30 deleted, 3 paused checks", round, checks)
		}
	})
}

// checkPausedPostgres checks that the session holding the purge lock key is
// idle in a transaction without transaction id or snapshot, and that no
// session holds a lock on table.
func checkPausedPostgres(t *testing.T, probe *sqlx.DB, table string, key int64) {
	t.Helper()
	var holders []struct {
		NoXID  bool   `db:"no_xid"`
		NoXmin bool   `db:"no_xmin"`
		State  string `db:"state"`
	}
	// A bigint advisory key is (classid, objid) = (high, low 32 bits), objsubid 1.
	if err := probe.Select(&holders, `SELECT a.backend_xid IS NULL AS no_xid, a.backend_xmin IS NULL AS no_xmin, a.state
		FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
		WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
		  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
		  AND l.classid = $1::bigint::oid AND l.objid = $2::bigint::oid`,
		int64(uint64(key)>>32), int64(uint32(uint64(key)))); err != nil {
		t.Fatal(err)
	}
	if len(holders) != 1 || !holders[0].NoXID || !holders[0].NoXmin || holders[0].State != "idle in transaction" {
		t.Errorf("purge lock holders while paused: %+v; want one, idle in transaction, without xid or xmin", holders)
	}
	var tableLocks int
	if err := probe.Get(&tableLocks, "SELECT COUNT(*) FROM pg_locks WHERE relation = $1::regclass", table); err != nil {
		t.Fatal(err)
	}
	if tableLocks != 0 {
		t.Errorf("%d locks on %s while the purge pauses, want none", tableLocks, table)
	}
}

// checkPausedMySQL checks that the session holding the purge lock has no
// open InnoDB transaction.
func checkPausedMySQL(t *testing.T, probe *sqlx.DB, key int64) {
	t.Helper()
	var holder sql.NullInt64
	if err := probe.Get(&holder, "SELECT IS_USED_LOCK(?)", inbox.MySQLPurgeLockName(key)); err != nil {
		t.Fatal(err)
	}
	if !holder.Valid {
		t.Fatal("nobody holds the purge lock while the round pauses")
	}
	// Read from SHOW ENGINE INNODB STATUS, not information_schema.INNODB_TRX:
	// that is a cache InnoDB refreshes only when nobody read it in the last
	// 100 ms, so it may still list the batch that just committed, and other
	// tests polling it keep it stale (see innodbTransactions). The round
	// waits in this hook, so a transaction really left open stays listed.
	deadline := time.Now().Add(5 * time.Second)
	for {
		trxs, err := innodbTransactions(context.Background(), probe)
		if err != nil {
			t.Fatal(err)
		}
		var open []string
		for _, x := range trxs {
			if x.active && x.thread == holder.Int64 {
				open = append(open, x.text)
			}
		}
		if len(open) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("the purge lock's session %d has %d open InnoDB transactions while paused (%q), want none", holder.Int64, len(open), open)
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
}
