package inbox_test

// Concurrent deliveries: of one message to several workers, and of many
// messages to SQLite's single writer.

import (
	"context"
	"database/sql"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/go-sql-driver/mysql"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// Two routers with one consumer name receive M at once, and both have begun
// their transaction before either claims (a barrier right after BEGIN); the
// handler inserts one business row and sleeps 300 ms. At READ COMMITTED and
// REPEATABLE READ there is one business row, one inbox row, one commit; the
// loser is a duplicate (ack) or, where the database reports an isolation
// error (PostgreSQL at REPEATABLE READ: 40001), a nack that the
// transient-aware poison queue lets through and whose redelivery is skipped.
//
// No statement runs between BEGIN and the claim on the plain dialects, so on
// PostgreSQL at REPEATABLE READ the loser's snapshot is the claim's own: a
// winner that committed during the loser's wait is a serialization failure,
// never a stale "not processed". The partitioned dialect runs a statement
// before the claim (the key lock), which would take the snapshot before the
// lock is granted; it is pinned to READ COMMITTED, and New refuses REPEATABLE
// READ for it.
//
// "session default" runs REPEATABLE READ as the sessions' default
// (default_transaction_isolation in the PostgreSQL DSN; MySQL's own default)
// with Config.TxOptions unset, as a DBA's setting would: the partitioned
// dialect must still claim at READ COMMITTED, or the loser, whose snapshot
// its key lock took before the winner committed, would not see the winner's
// row and would process M again.
func TestConcurrentClaim_TwoWorkersWithOpenTransactionsProcessOnce(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		level sql.IsolationLevel
		opts  *sql.TxOptions
	}{
		{"READ COMMITTED", sql.LevelReadCommitted, &sql.TxOptions{Isolation: sql.LevelReadCommitted}},
		{"REPEATABLE READ", sql.LevelRepeatableRead, &sql.TxOptions{Isolation: sql.LevelRepeatableRead}},
		{"REPEATABLE READ session default", sql.LevelRepeatableRead, nil},
	} {
		level := tc.level
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
				switch {
				case tdb.Dialect == inbox.SQLite:
					// With the recommended _txlock=immediate, BEGIN takes the
					// write lock: the second transaction cannot open before the
					// first ends, so the race cannot happen. A deferred BEGIN is
					// the only way both are open at once. SQLite ignores the
					// level: it is always SERIALIZABLE.
					db = openSQLiteWith(t, "_journal_mode=WAL&_busy_timeout=10000&_synchronous=NORMAL")
				case tc.opts == nil && isPostgres(tdb.Dialect):
					db = testdb.OpenPostgres(t, "default_transaction_isolation=repeatable%20read")
				} // MySQL/MariaDB: REPEATABLE READ is the server's default
				dialectOf.Store(db, tdb.Dialect)
				var session string
				if tc.opts == nil && tdb.Dialect != inbox.SQLite {
					var err error
					if isPostgres(tdb.Dialect) {
						err = db.Get(&session, "SELECT current_setting('default_transaction_isolation')")
					} else if err = db.Get(&session, "SELECT @@transaction_isolation"); err != nil {
						err = db.Get(&session, "SELECT @@tx_isolation") // MariaDB before 11.1
					}
					if err != nil {
						t.Fatal(err)
					}
					if session != "repeatable read" && session != "REPEATABLE-READ" {
						t.Fatalf("session default isolation = %q, want REPEATABLE READ", session)
					}
				}
				f := newFixture(t, db)
				opts := tc.opts
				if tdb.Dialect == inbox.PostgreSQLPartitioned && opts != nil && opts.Isolation != sql.LevelReadCommitted {
					_, err := inbox.New(inbox.Config{DB: db, Dialect: tdb.Dialect, Table: f.inbox, TxOptions: opts})
					if !errors.Is(err, inbox.ErrInvalidConfig) {
						t.Errorf("New with %v on the partitioned dialect: err = %v, want ErrInvalidConfig", level, err)
					}
					return
				}
				ctx, cancel := context.WithTimeout(context.Background(), caseTimeout)
				defer cancel()

				var hooks hookCounts
				ib := f.newInbox(hooks.config(inbox.Config{TxOptions: opts}))
				inbox.SetAfterBegin(ib, newBarrier(ctx, 2).arrive)
				poison, sink := poisonUnlessTransient(t)
				out := &outcomes{}
				var c calls
				handler := func(msg *message.Message) error {
					c.inc(msg.UUID)
					if err := f.insertRow(msg, msg.UUID+":"+msg.Metadata.Get("delivery")); err != nil {
						return err
					}
					time.Sleep(300 * time.Millisecond)
					return nil
				}
				workers := map[string]*feed{"A": newFeed(), "B": newFeed()}
				for _, in := range workers {
					runRouter(t, func(r *message.Router) {
						r.AddMiddleware(poison, out.Middleware, ib.Middleware)
						r.AddConsumerHandler("billing", "orders", in, handler)
					})
				}

				msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
				acked := sendToEach(ctx, t, workers, func(string) *message.Message { return msg })
				if t.Failed() {
					return
				}

				if c.get(msg.UUID) != 1 || hooks.processed.Load() != 1 || f.businessRows() != 1 || f.inboxRows() != 1 {
					t.Fatalf("handler calls %d, commits %d, business rows %d, inbox rows %d; want 1 each",
						c.get(msg.UUID), hooks.processed.Load(), f.businessRows(), f.inboxRows())
				}
				var loser string
				for label := range workers {
					if err := out.last(label); err != nil || !acked[label] {
						if loser != "" {
							t.Fatalf("both deliveries failed: A %v, B %v", out.last("A"), out.last("B"))
						}
						loser = label
					}
				}
				wantNack := tdb.Dialect == inbox.PostgreSQL && level == sql.LevelRepeatableRead
				switch {
				case loser == "" && wantNack:
					t.Errorf("loser acked; want a serialization failure (40001) nack at %v on PostgreSQL", level)
				case loser == "":
					if hooks.duplicates.Load() != 1 {
						t.Errorf("duplicates = %d, want 1", hooks.duplicates.Load())
					}
				default:
					err := out.last(loser)
					if acked[loser] || !inbox.IsTransient(err) {
						t.Errorf("loser %s: acked %v, err %v; want a nack with a transient error", loser, acked[loser], err)
					}
					if wantNack && sqlState(err) != "40001" {
						t.Errorf("loser %s: err %v, want SQLSTATE 40001", loser, err)
					}
					if !wantNack {
						t.Errorf("loser %s nacked with %v; want it skipped as a duplicate at %v", loser, err, level)
					}
					t.Logf("loser %s nacked: %v", loser, err)
					a, err := workers[loser].send(ctx, delivery(msg, loser+"-redelivery"))
					if err != nil || !a || hooks.duplicates.Load() != 1 || c.get(msg.UUID) != 1 {
						t.Errorf("redelivery: acked %v (%v), duplicates %d, handler calls %d; want acked, 1, 1",
							a, err, hooks.duplicates.Load(), c.get(msg.UUID))
					}
				}
				if p := sink.poisoned(); len(p) != 0 {
					t.Errorf("%d messages reached the poison topic: %s", len(p), p[0].Metadata.Get(middleware.ReasonForPoisonedKey))
				}
				if f.businessRows() != 1 || f.inboxRows() != 1 || db.Stats().InUse != 0 {
					t.Errorf("end: business rows %d, inbox rows %d, connections in use %d; want 1, 1, 0",
						f.businessRows(), f.inboxRows(), db.Stats().InUse)
				}
			})
		})
	}
}

// Three deliveries of M at once: the first claims, and its handler fails once
// both others wait on the key. Exactly one of the others commits. On
// MySQL/MariaDB the two waiters deadlock (1213) when the first rolls back:
// the victim is nacked, not poisoned, and its redelivery is skipped. On
// PostgreSQL there is no deadlock: one waiter claims, the other sees the
// commit and skips. On SQLite the waiters wait in BEGIN IMMEDIATE for the
// write lock.
func TestConcurrentClaim_OneWaiterCommitsAfterTheFirstOfThreeRollsBack(t *testing.T) {
	t.Parallel()
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		appName := "cases_" + randomSuffix()
		if isPostgres(tdb.Dialect) { // to find this pool's sessions in pg_stat_activity
			db = testdb.OpenPostgres(t, "application_name="+appName)
			dialectOf.Store(db, tdb.Dialect)
		}
		f := newFixture(t, db)
		var hooks hookCounts
		ib := f.newInbox(hooks.config(inbox.Config{}))
		poison, sink := poisonUnlessTransient(t)
		out := &outcomes{}
		ctx, cancel := context.WithTimeout(context.Background(), caseTimeout)
		defer cancel()

		// waiting reports the deliveries waiting behind the first.
		var entered atomic.Int32
		countEntries := func(h message.HandlerFunc) message.HandlerFunc {
			return func(msg *message.Message) ([]*message.Message, error) {
				if msg.Metadata.Get("delivery") != "1" {
					entered.Add(1)
				}
				return h(msg)
			}
		}
		waiting := lockWaiters(tdb.Dialect, tdb.Open(t), appName, f.inbox)
		if tdb.Dialect == inbox.SQLite { // no lock view: they entered, and cannot pass the first's write lock
			waiting = func(context.Context) (int, error) { return int(entered.Load()), nil }
		}
		firstIn := make(chan struct{})
		// seenWaiting: both others were seen waiting on the key before the
		// first failed. InnoDB refreshes innodb_trx only once nobody read it
		// for 100 ms, so a session polling it faster (another test on the
		// server) can hide them: after 5 s the first fails anyway, as
		// three deliveries in a row would, and the deadlock is not required.
		var seenWaiting atomic.Bool
		var c calls
		handler := func(msg *message.Message) error {
			c.inc(msg.UUID)
			if err := f.insertRow(msg, msg.UUID+":"+msg.Metadata.Get("delivery")); err != nil {
				return err
			}
			if msg.Metadata.Get("delivery") != "1" {
				return nil
			}
			close(firstIn)
			patience := time.After(5 * time.Second)
			for {
				n, err := waiting(msg.Context())
				if err != nil {
					return err
				}
				if n == 2 {
					seenWaiting.Store(true)
					return errors.New("first delivery fails after the others queued")
				}
				select {
				case <-patience:
					return errors.New("first delivery fails after the others queued")
				case <-time.After(150 * time.Millisecond): // > InnoDB's 100 ms, see seenWaiting
				}
			}
		}
		feeds := map[string]*feed{"1": newFeed(), "2": newFeed(), "3": newFeed()}
		for _, in := range feeds {
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(poison, out.Middleware, countEntries, ib.Middleware)
				r.AddConsumerHandler("billing", "orders", in, handler)
			})
		}

		msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
		var mu sync.Mutex
		acked := map[string]bool{}
		var wg sync.WaitGroup
		deliver := func(label string) {
			wg.Go(func() {
				a, err := feeds[label].send(ctx, delivery(msg, label))
				if err != nil {
					t.Error(err)
				}
				mu.Lock()
				acked[label] = a
				mu.Unlock()
			})
		}
		deliver("1")
		select {
		case <-firstIn:
		case <-ctx.Done():
			t.Fatal("the first delivery never reached its handler")
		}
		deliver("2")
		deliver("3")
		wg.Wait()
		if t.Failed() {
			return
		}

		// The first delivery's failure is the message's own: poisoned (acked).
		if out.last("1") == nil || out.last("1").Error() != "first delivery fails after the others queued" {
			t.Fatalf("first delivery: err %v; want the handler's failure", out.last("1"))
		}
		if hooks.processed.Load() != 1 || f.businessRows() != 1 || f.inboxRows() != 1 || c.get(msg.UUID) != 2 {
			t.Fatalf("commits %d, business rows %d, inbox rows %d, handler calls %d; want 1, 1, 1, 2",
				hooks.processed.Load(), f.businessRows(), f.inboxRows(), c.get(msg.UUID))
		}
		deadlocks := 0
		for _, label := range []string{"2", "3"} {
			if acked[label] {
				continue
			}
			err := out.last(label)
			var myErr *mysql.MySQLError
			if tdb.Dialect != inbox.MySQL || !errors.As(err, &myErr) || myErr.Number != 1213 || !inbox.IsTransient(err) {
				t.Errorf("delivery %s nacked with %v; the only nack expected is a MySQL deadlock (1213)", label, err)
				continue
			}
			deadlocks++
			if a, err := feeds[label].send(ctx, delivery(msg, label+"-redelivery")); err != nil || !a {
				t.Errorf("redelivery of %s: acked %v (%v), last error %v", label, a, err, out.last(label+"-redelivery"))
			}
		}
		// Both waiters were seen in LOCK WAIT before the first rolled back:
		// InnoDB then grants both their shared locks, both need the exclusive
		// one, and one is the deadlock victim, every time.
		switch {
		case tdb.Dialect == inbox.MySQL && seenWaiting.Load() && deadlocks != 1:
			t.Errorf("deadlocks = %d, want 1 on MySQL/MariaDB", deadlocks)
		case !seenWaiting.Load():
			t.Logf("the two others were not seen waiting on the key; deadlocks: %d", deadlocks)
		}
		if f.businessRows() != 1 || f.inboxRows() != 1 || c.get(msg.UUID) != 2 {
			t.Errorf("end: business rows %d, inbox rows %d, handler calls %d; want 1, 1, 2",
				f.businessRows(), f.inboxRows(), c.get(msg.UUID))
		}
		if p := sink.poisoned(); len(p) != 1 || p[0].Metadata.Get("delivery") != "1" {
			t.Errorf("poison topic holds %d messages; want only the first delivery's, whose handler failed", len(p))
		}
	})
}

// SQLite under concurrent writers (WAL, a pool of 4 connections, 8 messages
// in flight at all times, 200 distinct ids, handlers that read and then write
// through the transaction) processes every message. With the settings the
// README recommends (testdb.SQLiteParams: busy_timeout and _txlock=immediate)
// there is not one "database is locked" error. With plain defaults (WAL only)
// such errors happen; each is a transient nack, never poisoned, and
// redelivery (up to a bound) gets all 200 processed. busy_timeout alone is
// enough to avoid them in the inbox, because the claim is the transaction's
// first statement: it waits for the write lock before it has read anything.
// SQLite only: the servers lock rows, not the database.
func TestSQLite_ConcurrentWritersAreAllProcessed(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, params string
		noErrors     bool
	}{
		{"recommended", testdb.SQLiteParams, true},
		{"plain defaults", "_journal_mode=WAL", false},
		{"busy_timeout only", "_journal_mode=WAL&_busy_timeout=10000", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			db := openSQLiteWith(t, tc.params)
			db.SetMaxOpenConns(4)
			f := newFixture(t, db)
			var hooks hookCounts
			ib := f.newInbox(hooks.config(inbox.Config{}))
			poison, sink := poisonUnlessTransient(t)
			out := &outcomes{}
			in := newFeed()
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(poison, out.Middleware, ib.Middleware)
				r.AddConsumerHandler("ledger", "orders", in, func(msg *message.Message) error {
					tx, _ := inbox.TxFromContext(msg.Context())
					var before int
					if err := tx.GetContext(msg.Context(), &before, "SELECT COUNT(*) FROM "+f.business); err != nil {
						return err
					}
					return f.writeBusinessRow(msg)
				})
			})

			ctx, cancel := context.WithTimeout(context.Background(), caseTimeout)
			defer cancel()
			const messages, inFlight, maxDeliveries = 200, 8, 1000
			ids := make(chan string, messages)
			for range messages {
				ids <- watermill.NewUUID()
			}
			close(ids)
			var nacks atomic.Int32
			var wg sync.WaitGroup
			for range inFlight { // each worker keeps one message in flight
				wg.Go(func() {
					for id := range ids {
						msg := message.NewMessage(id, nil)
						for n := 1; ; n++ {
							acked, err := in.send(ctx, msg.Copy())
							if err != nil {
								t.Error(err)
								return
							}
							if acked {
								break
							}
							nacks.Add(1)
							if n == maxDeliveries {
								t.Errorf("message %s: still nacked after %d deliveries", id, n)
								return
							}
							// A broker redelivers after a pause; without one, a
							// writer with no busy_timeout can lose every race
							// to the 7 others.
							time.Sleep(time.Duration(min(n, 20)) * time.Millisecond)
						}
					}
				})
			}
			wg.Wait()

			if f.businessRows() != messages || f.inboxRows() != messages || hooks.processed.Load() != messages {
				t.Errorf("business rows %d, inbox rows %d, commits %d; want %d each",
					f.businessRows(), f.inboxRows(), hooks.processed.Load(), messages)
			}
			failures := out.failures()
			for _, err := range failures {
				if !inbox.IsTransient(err) {
					t.Errorf("non-transient failure: %v", err)
					break
				}
			}
			if p := sink.poisoned(); len(p) != 0 {
				t.Errorf("%d messages poisoned: %s", len(p), p[0].Metadata.Get(middleware.ReasonForPoisonedKey))
			}
			if tc.noErrors && len(failures) != 0 {
				t.Errorf("%d failures with %s, want none; first: %v", len(failures), tc.params, failures[0])
			}
			if len(failures) > 0 {
				t.Logf("%s: %d nacks, all transient, e.g. %v", tc.name, nacks.Load(), failures[0])
			}
		})
	}
}
