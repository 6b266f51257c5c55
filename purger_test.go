package inbox_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A round deletes the expired rows, measures the oldest row left, and logs
// one Info line.
func TestPurgerRound(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		skipPartitionedRounds(t, tdb)
		f := newFixture(t, db)
		f.newInbox(inbox.Config{})
		insertRows(t, db, tdb.Dialect, f.inbox, "billing", "old", 1200, 2*time.Hour)
		insertRows(t, db, tdb.Dialect, f.inbox, "billing", "recent", 10, 30*time.Minute)
		logger := newCaptureLogger()
		p, err := inbox.NewPurger(inbox.PurgerConfig{
			Purge:  inbox.PurgeConfig{DB: db, Table: f.inbox, OlderThan: time.Hour, BatchSize: 500},
			Logger: logger,
		})
		if err != nil {
			t.Fatal(err)
		}
		round := p.RunOnce(context.Background())
		if round.Err != nil || round.Skipped || round.Deleted != 1200 {
			t.Fatalf("round = %+v, want 1200 deleted", round)
		}
		if round.OldestAge < 29*time.Minute || round.OldestAge > 31*time.Minute {
			t.Errorf("oldest age = %v, want about 30m", round.OldestAge)
		}
		if round.Window != time.Hour {
			t.Errorf("window = %v, want OlderThan (1h)", round.Window)
		}
		if f.inboxRows() != 10 {
			t.Errorf("rows left = %d, want 10", f.inboxRows())
		}
		var infos int
		for _, l := range *logger.lines {
			if l.level == "info" && l.fields["deleted"] == int64(1200) && l.fields["table"] == f.inbox {
				infos++
			}
		}
		if infos != 1 {
			t.Errorf("log lines %v, want one Info line with deleted=1200 and the table", *logger.lines)
		}
	})
}

// Every round reports the window it purged by: OlderThan when set (also
// above the source's safe window), otherwise the safe window the source
// reports for that round, which follows a change of the broker's retention
// from one round to the next; with a Consumer too. A round whose window
// source fails reports no window.
func TestPurgerRoundReportsItsWindow(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		f := newFixture(t, db)
		f.newInbox(inbox.Config{})
		insertRows(t, db, tdb.Dialect, f.inbox, "billing", "old", 10, 4*time.Hour)
		retention := &settableWindow{}
		round := func(cfg inbox.PurgeConfig) inbox.PurgeRound {
			t.Helper()
			cfg.DB, cfg.Table = db, f.inbox
			p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: cfg})
			if err != nil {
				t.Fatal(err)
			}
			return p.RunOnce(context.Background())
		}
		for _, tc := range []struct {
			name      string
			cfg       inbox.PurgeConfig
			retention time.Duration
			want      time.Duration
		}{
			{"OlderThan alone", inbox.PurgeConfig{OlderThan: 6 * time.Hour}, 0, 6 * time.Hour},
			{"safe window from the source", inbox.PurgeConfig{Window: retention}, 5 * time.Hour, 5 * time.Hour},
			{"the source's window changed since the last round", inbox.PurgeConfig{Window: retention}, 7 * time.Hour, 7 * time.Hour},
			{"OlderThan above the safe window", inbox.PurgeConfig{OlderThan: 8 * time.Hour, Window: retention}, 5 * time.Hour, 8 * time.Hour},
			{"one consumer", inbox.PurgeConfig{Consumer: "billing", Window: retention}, 9 * time.Hour, 9 * time.Hour},
		} {
			retention.set(tc.retention, nil)
			if r := round(tc.cfg); r.Err != nil || r.Window != tc.want {
				t.Errorf("%s: round %+v, want window %v", tc.name, r, tc.want)
			}
		}
		if tdb.Dialect != inbox.PostgreSQLPartitioned { // rows 4h old are in a partition not yet past any window
			retention.set(3*time.Hour, nil)
			if r := round(inbox.PurgeConfig{Window: retention}); r.Err != nil || r.Window != 3*time.Hour || r.Deleted != 10 {
				t.Errorf("3h safe window: round %+v, want the 10 rows of 4h ago deleted under a 3h window", r)
			}
		}
		broken := errors.New("retention unreadable")
		retention.set(0, broken)
		if r := round(inbox.PurgeConfig{Window: retention}); !errors.Is(r.Err, broken) || r.Window != 0 {
			t.Errorf("failing window source: round %+v, want its error and no window", r)
		}
	})
}

// Another instance holding the lock makes a round skip; two purgers racing
// never fail and together delete exactly the expired rows.
func TestPurgerInstancesDoNotFight(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		skipPartitionedRounds(t, tdb)
		f := newFixture(t, db)
		f.newInbox(inbox.Config{})
		insertRows(t, db, tdb.Dialect, f.inbox, "billing", "old", 3000, 2*time.Hour)
		insertRows(t, db, tdb.Dialect, f.inbox, "billing", "recent", 10, 30*time.Minute)
		newPurger := func() *inbox.Purger {
			p, err := inbox.NewPurger(inbox.PurgerConfig{
				Purge: inbox.PurgeConfig{DB: db, Table: f.inbox, OlderThan: time.Hour, BatchSize: 100},
			})
			if err != nil {
				t.Fatal(err)
			}
			return p
		}
		a, b := newPurger(), newPurger()
		db.SetMaxOpenConns(5) // two rounds and the test's lock: a round needs two connections on PostgreSQL
		if tdb.Dialect != inbox.SQLite {
			ctx := context.Background()
			release, got, err := inbox.PurgeLock(ctx, db, a)
			if !got || err != nil {
				t.Fatalf("lock: %v %v", got, err)
			}
			if round := b.RunOnce(ctx); !round.Skipped || round.Deleted != 0 || round.Window != 0 || round.Err != nil {
				t.Errorf("round while another instance holds the lock = %+v, want skipped", round)
			}
			if err := release(); err != nil {
				t.Fatal(err)
			}
		}
		var deleted atomic.Int64
		var wg sync.WaitGroup
		for _, p := range []*inbox.Purger{a, b, a, b} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				round := p.RunOnce(context.Background())
				if round.Err != nil {
					t.Errorf("round: %v", round.Err)
				}
				deleted.Add(round.Deleted)
			}()
		}
		wg.Wait()
		if deleted.Load() != 3000 || f.inboxRows() != 10 {
			t.Errorf("deleted %d, rows left %d; want 3000 and 10", deleted.Load(), f.inboxRows())
		}
	})
}

func TestNewPurgerErrors(t *testing.T) {
	if _, err := inbox.NewPurger(inbox.PurgerConfig{}); !errors.Is(err, inbox.ErrInvalidConfig) {
		t.Errorf("empty config: %v", err)
	}
	if _, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: sqliteDB(t), OlderThan: time.Hour}, Interval: -time.Second}); !errors.Is(err, inbox.ErrInvalidConfig) {
		t.Errorf("negative interval: %v", err)
	}
}

// The purge lock is keyed by the table, not by how its name is written: an
// instance configured with "x" skips its round while one configured with
// "public.x" holds the lock.
func TestPurger_LockIsKeyedByTheTableNotItsSpelling(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	f := newFixture(t, db)
	f.newInbox(inbox.Config{})
	mk := func(table string) *inbox.Purger {
		p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Table: table, OlderThan: time.Hour}})
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	a, b := mk("public."+f.inbox), mk(f.inbox)
	ctx := context.Background()
	release, got, err := inbox.PurgeLock(ctx, db, a)
	if !got || err != nil {
		t.Fatal(got, err)
	}
	defer release()
	if r := b.RunOnce(ctx); !r.Skipped {
		t.Errorf("instance A holds the purge lock of public.%s; instance B (table %q) ran its round anyway: %+v", f.inbox, f.inbox, r)
	}
}

// A round whose context ends right after the server granted the purge lock,
// before the client read the answer (a router closing, a deadline), leaves
// the lock free: another instance can take it once the round is over. The
// connector runs the cancellation at that moment (afterLock).
func TestPurger_RoundCancelledAsTheLockIsGrantedLeavesTheLockFree(t *testing.T) {
	for _, tc := range []struct {
		name, driverName, dsn string
		drv                   driver.Driver
		dialect               inbox.Dialect
	}{
		{"postgres", "pgx", testdb.PostgresDSN(), stdlib.GetDefaultDriver(), inbox.PostgreSQL},
		{"mysql", "mysql", testdb.MySQLDSN(), &mysql.MySQLDriver{}, inbox.MySQL},
	} {
		t.Run(tc.name, func(t *testing.T) {
			db := sqlx.NewDb(sql.OpenDB(hookConnector{tc.drv, tc.dsn}), tc.driverName)
			t.Cleanup(func() { db.Close() })
			db.SetMaxOpenConns(1)
			var probe *sqlx.DB
			if tc.dialect == inbox.MySQL {
				probe = testdb.OpenMySQL(t, "")
			} else {
				probe = testdb.OpenPostgres(t, "")
			}
			f := newFixture(t, probe)
			f.newInbox(inbox.Config{})
			p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Table: f.inbox, OlderThan: time.Hour}})
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			fn := func() { cancel() }
			afterLock.Store(&fn)
			r := p.RunOnce(ctx)
			afterLock.Store(nil)
			t.Logf("round: %+v", r)
			// The round is over: its connection is back in the pool, or
			// closed. A closed session's locks go when the server has
			// noticed the closed socket, which is soon but not at once:
			// wait for that, boundedly. A pooled session holding the lock
			// would keep it for the whole wait.
			if !eventuallyLockFree(t, probe, tc.dialect, f.inbox) {
				other, _ := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: probe, Table: f.inbox, OlderThan: time.Hour}})
				t.Errorf("round ended with %v, but the purge lock stays held by the pooled connection; "+
					"another instance: skipped=%v; same purger's next round unlocks once: lock free after it = %v",
					r.Err, other.RunOnce(context.Background()).Skipped,
					func() bool { p.RunOnce(context.Background()); return lockFree(t, probe, tc.dialect, f.inbox) }())
			}
		})
	}
}

// skipPartitionedRounds skips a case that counts the rows a round deletes
// by the hour: a round on a partitioned table drops whole partitions only
// (partition_bounds_test.go and TestDropPartitions cover it), whatever the
// Purger's dialect.
func skipPartitionedRounds(t *testing.T, tdb testDB) {
	t.Helper()
	if tdb.Dialect == inbox.PostgreSQLPartitioned {
		t.Skip("a Purger round on a partitioned table drops whole partitions, not rows by the hour")
	}
}

// A purge limited to one consumer (PurgeConfig.Consumer: consumers that
// share a table with windows of their own) measures the oldest row of that
// consumer: another consumer's older rows are not its to delete. The whole
// table's oldest row made such a purge look behind its window for good
// (InboxPurgeFallingBehind fired, the headroom read -119h). The whole
// table's oldest row is measured apart (TableOldestAge): rows of a consumer
// that no purge deletes grow past every window, and a consumer's own oldest
// row could not show them.
func TestPurgerRoundLimitedToAConsumerMeasuresItsOwnOldestRowAndTheTables(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		f := newFixture(t, db)
		if tdb.Dialect == inbox.PostgreSQLPartitioned {
			f.inbox = lastSixDaysPartitionedTable(t, db)
		} else {
			f.newInbox(inbox.Config{})
		}
		insertRows(t, db, tdb.Dialect, f.inbox, "ledger", "kept", 10, 5*24*time.Hour)
		insertRows(t, db, tdb.Dialect, f.inbox, "orders", "expired", 10, 2*time.Hour)
		insertRows(t, db, tdb.Dialect, f.inbox, "orders", "recent", 10, 30*time.Minute)
		p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{
			DB: db, Dialect: tdb.Dialect, Table: f.inbox, Consumer: "orders", OlderThan: time.Hour,
		}})
		if err != nil {
			t.Fatal(err)
		}
		round := p.RunOnce(context.Background())
		if round.Err != nil || round.Deleted != 10 {
			t.Fatalf("round = %+v, want orders' 10 expired rows deleted", round)
		}
		if round.OldestAge > round.Window {
			t.Errorf("oldest age = %v, past the %v window: want the age of orders' oldest row (30m), not ledger's (5 days)", round.OldestAge, round.Window)
		}
		if tdb.Dialect != inbox.PostgreSQLPartitioned && (round.OldestAge < 29*time.Minute || round.OldestAge > 31*time.Minute) {
			t.Errorf("oldest age = %v, want about 30m", round.OldestAge)
		}
		if n := count(t, db, f.inbox, "consumer = 'ledger'"); n != 10 {
			t.Errorf("%d of ledger's rows left, want 10", n)
		}
		// ledger's rows, 5 days old; on the partitioned table, how long ago
		// their daily partition ended.
		lo, hi := 5*24*time.Hour-time.Minute, 5*24*time.Hour+time.Minute
		if tdb.Dialect == inbox.PostgreSQLPartitioned {
			lo = 4*24*time.Hour - time.Minute
		}
		if round.TableOldestAge < lo || round.TableOldestAge > hi {
			t.Errorf("table's oldest age = %v, want between %v and %v (ledger's rows)", round.TableOldestAge, lo, hi)
		}
	})
}

// Purgers of consumers that share a table, each limited to its own
// consumer with its own window, do not skip each other's rounds: a round
// limited to a consumer waits for the purge lock, which another consumer's
// round may hold, instead of skipping (one skipped whenever the other held
// it, as often as not in one process, and InboxPurgeNotRunning fired for
// the one that lost three rounds in a row). A purge of every consumer still
// skips while another instance holds the lock.
func TestPurgersOfConsumersThatShareATableDoNotSkipEachOther(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if tdb.Dialect == inbox.SQLite {
			t.Skip("SQLite takes no purge lock: its writers are serialised by the database")
		}
		f := newFixture(t, db)
		if tdb.Dialect == inbox.PostgreSQLPartitioned {
			f.inbox = lastSixDaysPartitionedTable(t, db)
		} else {
			f.newInbox(inbox.Config{})
		}
		insertRows(t, db, tdb.Dialect, f.inbox, "orders", "expired", 10, 2*time.Hour)
		insertRows(t, db, tdb.Dialect, f.inbox, "ledger", "expired", 10, 3*24*time.Hour)
		purgerOf := func(consumer string, window time.Duration) *inbox.Purger {
			p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{
				DB: db, Dialect: tdb.Dialect, Table: f.inbox, Consumer: consumer, OlderThan: window,
			}})
			if err != nil {
				t.Fatal(err)
			}
			return p
		}
		orders, ledger := purgerOf("orders", time.Hour), purgerOf("ledger", 2*24*time.Hour)
		db.SetMaxOpenConns(6)
		ctx := context.Background()
		release, got, err := inbox.PurgeLock(ctx, db, orders) // orders' round in progress
		if !got || err != nil {
			t.Fatalf("lock: %v %v", got, err)
		}
		if r := purgerOf("", 4*24*time.Hour).RunOnce(ctx); !r.Skipped {
			t.Errorf("a purge of every consumer while another round holds the lock: %+v, want skipped", r)
		}
		rounds := make(chan inbox.PurgeRound, 2)
		go func() { rounds <- ledger.RunOnce(ctx) }()
		go func() { rounds <- orders.RunOnce(ctx) }() // another instance of orders' purger
		if err := release(); err != nil {
			t.Fatal(err)
		}
		var deleted int64
		for range 2 {
			r := <-rounds
			if r.Skipped || r.Err != nil {
				t.Errorf("a consumer's round while another held the lock: %+v, want it to wait and run", r)
			}
			deleted += r.Deleted
		}
		if deleted != 20 || f.inboxRows() != 0 {
			t.Errorf("%d deleted, %d rows left; want both consumers' 10 expired rows deleted", deleted, f.inboxRows())
		}
	})
}

// Two purgers of consumers that share a PostgreSQL table, on a pool of two
// connections (the least a PostgreSQL purge takes: one holds the lock's
// transaction, the other runs the round), both finish their rounds when
// they start at once: the one that waits for the lock holds no connection
// between its tries.
func TestPurgersOfConsumersThatShareATableFinishOnAPoolOfTwo(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if tdb.Dialect == inbox.SQLite {
			t.Skip("SQLite takes no purge lock")
		}
		if tdb.Dialect == inbox.PostgreSQLPartitioned {
			// Before the rows: one of 3 days ago has no partition on the
			// days when yesterday's week began after it.
			t.Skip("the rows of the last days need their partitions: TestPurgersOfConsumersThatShareATableDoNotSkipEachOther covers this dialect's waits")
		}
		f := newFixture(t, db)
		f.newInbox(inbox.Config{Dialect: tdb.Dialect})
		insertRows(t, db, tdb.Dialect, f.inbox, "orders", "expired", 10, 2*time.Hour)
		insertRows(t, db, tdb.Dialect, f.inbox, "ledger", "expired", 10, 3*24*time.Hour)
		db.SetMaxOpenConns(2)
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		rounds := make(chan inbox.PurgeRound, 2)
		for consumer, window := range map[string]time.Duration{"orders": time.Hour, "ledger": 2 * 24 * time.Hour} {
			p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{
				DB: db, Dialect: tdb.Dialect, Table: f.inbox, Consumer: consumer, OlderThan: window,
			}})
			if err != nil {
				t.Fatal(err)
			}
			go func() { rounds <- p.RunOnce(ctx) }()
		}
		for range 2 {
			if r := <-rounds; r.Skipped || r.Err != nil || r.Deleted != 10 {
				t.Errorf("round on a pool of two: %+v, want its consumer's 10 expired rows deleted", r)
			}
		}
	})
}
