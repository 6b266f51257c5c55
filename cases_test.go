package inbox_test

// Cases reported against other inbox implementations (issue 6, item 3). Each
// is a named test that runs through a real message.Router on every database
// where it applies and asserts what users see: business rows, inbox rows,
// handler calls, acks and nacks, poison queue, connections and sessions.

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
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

// Case "same message, two workers, snapshot isolation": two routers with one
// consumer name receive M at once; both have begun their transaction before
// either claims (a barrier right after BEGIN); the handler inserts one
// business row and sleeps 300 ms. At READ COMMITTED and REPEATABLE READ:
// one business row, one inbox row, one commit; the loser is a duplicate
// (ack) or, where the database reports an isolation error (PostgreSQL at
// REPEATABLE READ: 40001), a nack that the transient-aware poison queue lets
// through and whose redelivery is skipped.
//
// No statement runs between BEGIN and the claim on the plain dialects, so
// on PostgreSQL at REPEATABLE READ the loser's snapshot is the claim's own:
// a winner that committed during the loser's wait is a serialization
// failure, never a stale "not processed". The partitioned dialect runs a
// statement before the claim (the key lock), which would take the snapshot
// before the lock is granted; it is pinned to READ COMMITTED, and New
// refuses REPEATABLE READ for it.
//
// "session default" runs REPEATABLE READ as the sessions' default
// (default_transaction_isolation in the PostgreSQL DSN; MySQL's own default)
// with Config.TxOptions unset, as a DBA's setting would: the partitioned dialect
// must still claim at READ COMMITTED, or the loser, whose snapshot its key
// lock took before the winner committed, would not see the winner's row
// and would process M again.
func TestCaseSameMessageTwoWorkersSnapshotIsolation(t *testing.T) {
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
				var mu sync.Mutex
				acked := map[string]bool{}
				var wg sync.WaitGroup
				for label, in := range workers {
					wg.Go(func() {
						a, err := in.send(ctx, delivery(msg, label))
						if err != nil {
							t.Error(err)
						}
						mu.Lock()
						acked[label] = a
						mu.Unlock()
					})
				}
				wg.Wait()
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

// The other isolation error a handler meets at REPEATABLE READ: two workers
// process two messages at once, and both handlers read a shared row and
// then update it. The second update fails with the database's isolation
// error (PostgreSQL 40001; MariaDB with innodb_snapshot_isolation=ON, the
// default since 11.6, 1020 "Record has changed since last read"). It must
// be a nack, kept from the poison queue by IsTransient, and its redelivery
// is processed: the counter ends at 2. Databases that report no such error
// at REPEATABLE READ (SQLite, MySQL without snapshot isolation) and the
// partitioned dialect (READ COMMITTED only) do not apply.
func TestCaseIsolationErrorInHandler(t *testing.T) {
	t.Parallel()
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		switch tdb.Dialect {
		case inbox.SQLite, inbox.PostgreSQLPartitioned:
			t.Skip("no isolation error at REPEATABLE READ here")
		case inbox.MySQL:
			var on string
			if err := db.Get(&on, "SELECT @@innodb_snapshot_isolation"); err != nil {
				t.Skipf("no innodb_snapshot_isolation on this server: %v", err)
			}
			param := "innodb_snapshot_isolation=ON"
			if tdb.Name == "mysql-clientFoundRows" {
				param += "&clientFoundRows=true"
			}
			db = testdb.OpenMySQL(t, param)
		}
		f := newFixture(t, db)
		counter := "counter_" + randomSuffix()
		exec(t, db, "CREATE TABLE "+counter+" (id INT NOT NULL PRIMARY KEY, n INT NOT NULL)")
		dropLater(t, db, counter)
		exec(t, db, "INSERT INTO "+counter+" (id, n) VALUES (1, 0)")
		ctx, cancel := context.WithTimeout(context.Background(), caseTimeout)
		defer cancel()

		var hooks hookCounts
		ib := f.newInbox(hooks.config(inbox.Config{TxOptions: &sql.TxOptions{Isolation: sql.LevelRepeatableRead}}))
		poison, sink := poisonUnlessTransient(t)
		out := &outcomes{}
		bothRead := newBarrier(ctx, 2)
		handler := func(msg *message.Message) error {
			tx, _ := inbox.TxFromContext(msg.Context())
			var n int
			if err := tx.GetContext(msg.Context(), &n, "SELECT n FROM "+counter+" WHERE id = 1"); err != nil {
				return err
			}
			bothRead.arrive()
			if _, err := tx.ExecContext(msg.Context(), tx.Rebind("UPDATE "+counter+" SET n = ? WHERE id = 1"), n+1); err != nil {
				return err
			}
			return f.writeBusinessRow(msg)
		}
		workers := map[string]*feed{"A": newFeed(), "B": newFeed()}
		for _, in := range workers {
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(poison, out.Middleware, ib.Middleware)
				r.AddConsumerHandler("billing", "orders", in, handler)
			})
		}
		msgs := map[string]*message.Message{
			"A": message.NewMessage(watermill.NewUUID(), nil),
			"B": message.NewMessage(watermill.NewUUID(), nil),
		}
		var mu sync.Mutex
		acked := map[string]bool{}
		var wg sync.WaitGroup
		for label, in := range workers {
			wg.Go(func() {
				a, err := in.send(ctx, delivery(msgs[label], label))
				if err != nil {
					t.Error(err)
				}
				mu.Lock()
				acked[label] = a
				mu.Unlock()
			})
		}
		wg.Wait()
		if t.Failed() {
			return
		}
		if p := sink.poisoned(); len(p) != 0 {
			t.Fatalf("the isolation error went to the poison queue: %s", p[0].Metadata.Get(middleware.ReasonForPoisonedKey))
		}
		var loser string
		for label := range workers {
			if !acked[label] {
				loser = label
			}
		}
		if loser == "" || acked["A"] == acked["B"] {
			t.Fatalf("acked A %v, B %v; want one commit and one isolation error (nack)", acked["A"], acked["B"])
		}
		err := out.last(loser)
		t.Logf("loser %s: %v", loser, err)
		if !inbox.IsTransient(err) {
			t.Errorf("loser's error %v is not transient", err)
		}
		if a, err := workers[loser].send(ctx, delivery(msgs[loser], loser+"-redelivery")); err != nil || !a {
			t.Fatalf("redelivery: acked %v (%v), last error %v", a, err, out.last(loser+"-redelivery"))
		}
		var n int
		if err := db.Get(&n, "SELECT n FROM "+counter+" WHERE id = 1"); err != nil {
			t.Fatal(err)
		}
		if n != 2 || f.businessRows() != 2 || f.inboxRows() != 2 || hooks.processed.Load() != 2 {
			t.Errorf("counter %d, business rows %d, inbox rows %d, commits %d; want 2 each",
				n, f.businessRows(), f.inboxRows(), hooks.processed.Load())
		}
	})
}

// Case "consumer name drift": billing and shipping share one table and both
// get M; the application restarts (new pool, new Inbox, new router: as on a
// new host or process) and M is redelivered to both. Two inbox rows, each
// handler ran once in total, and the consumer column holds exactly the
// handler names: nothing of the host or the process is in the key.
func TestCaseConsumerNameDrift(t *testing.T) {
	t.Parallel()
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		reopen := func() *sqlx.DB { return tdb.Open(t) }
		if tdb.Dialect == inbox.SQLite { // tdb.Open makes a new file: reopen the same one
			path := filepath.Join(t.TempDir(), "inbox.db")
			db = openSQLite(t, path)
			reopen = func() *sqlx.DB { return openSQLite(t, path) }
		}
		f := newFixture(t, db)
		var billing, shipping calls
		msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
		// run is one life of the application: its own pool, inbox and router.
		run := func(life string, db *sqlx.DB) {
			dialectOf.Store(db, tdb.Dialect)
			app := &fixture{t: t, db: db, inbox: f.inbox, business: f.business}
			ib := app.newInbox(inbox.Config{})
			billingIn, shippingIn := newFeed(), newFeed()
			r := runRouter(t, func(r *message.Router) {
				r.AddMiddleware(ib.Middleware)
				r.AddConsumerHandler("billing", "orders", billingIn, func(msg *message.Message) error {
					billing.inc(msg.UUID)
					return app.writeBusinessRow(msg)
				})
				r.AddConsumerHandler("shipping", "orders", shippingIn, func(msg *message.Message) error {
					shipping.inc(msg.UUID)
					return app.writeBusinessRow(msg)
				})
			})
			if !billingIn.deliver(t, msg) || !shippingIn.deliver(t, msg) {
				t.Fatalf("%s: nacked", life)
			}
			if err := r.Close(); err != nil {
				t.Fatal(err)
			}
			if err := ib.Close(); err != nil {
				t.Fatal(err)
			}
		}
		run("first life", db)
		run("after the restart", reopen())

		if billing.get(msg.UUID) != 1 || shipping.get(msg.UUID) != 1 {
			t.Errorf("handler calls in total: billing %d, shipping %d; want 1 and 1",
				billing.get(msg.UUID), shipping.get(msg.UUID))
		}
		var consumers []string
		if err := db.Select(&consumers, "SELECT consumer FROM "+f.inbox+" ORDER BY consumer"); err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(consumers, []string{"billing", "shipping"}) {
			t.Errorf("consumer column = %q, want exactly the handler names [billing shipping]", consumers)
		}
		if f.businessRows() != 2 {
			t.Errorf("business rows = %d, want 2", f.businessRows())
		}
	})
}

// claimOnThisTx checks, from inside the handler, that the message's inbox
// row was written by the handler's own transaction: visible through it,
// invisible from another connection (it is not committed yet), and on
// PostgreSQL stamped with this transaction's id.
func claimOnThisTx(msg *message.Message, d inbox.Dialect, db *sqlx.DB, table string) error {
	ctx := msg.Context()
	tx, ok := inbox.TxFromContext(ctx)
	if !ok {
		return errors.New("no inbox transaction")
	}
	consumer := message.HandlerNameFromCtx(ctx)
	where := " FROM " + table + " WHERE consumer = ? AND message_id = ?"
	var inTx, outside int
	if err := tx.GetContext(ctx, &inTx, tx.Rebind("SELECT COUNT(*)"+where), consumer, msg.UUID); err != nil {
		return err
	}
	if err := db.GetContext(ctx, &outside, db.Rebind("SELECT COUNT(*)"+where), consumer, msg.UUID); err != nil {
		return err
	}
	if inTx != 1 || outside != 0 {
		return fmt.Errorf("inbox row seen %d times through the handler's transaction and %d times from another connection, want 1 and 0", inTx, outside)
	}
	if isPostgres(d) {
		var same bool
		if err := tx.GetContext(ctx, &same, tx.Rebind("SELECT (SELECT xmin::text"+where+") = pg_current_xact_id()::xid::text"),
			consumer, msg.UUID); err != nil {
			return err
		}
		if !same {
			return errors.New("the inbox row's xmin is not the handler's transaction id")
		}
	}
	return nil
}

// Case "inbox mark and business write split": the handler writes a business
// row and then fails, or the commit fails. Nothing of either is kept and the
// message is nacked; after a redelivery there is exactly one of each. Inside
// the handler, the claim is checked to be on the handler's transaction.
//
// A third way to split them: the handler's statement is a deadlock victim
// and the handler ignores the error. The database has rolled the whole
// transaction back, the inbox row with it. PostgreSQL then fails every
// statement and turns COMMIT into ROLLBACK; MySQL/MariaDB run the handler's
// later statements outside any transaction (autocommit: they are kept) and
// accept the COMMIT with nothing to commit. Either way the message must be
// nacked, never acked without its inbox row.
func TestCaseInboxMarkAndBusinessWriteSplit(t *testing.T) {
	t.Parallel()
	for _, failure := range []string{"handler fails", "commit fails", "handler ignores a deadlock"} {
		t.Run(failure, func(t *testing.T) {
			t.Parallel()
			forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
				if failure == "handler ignores a deadlock" && tdb.Dialect == inbox.SQLite {
					t.Skip("one writer at a time: no deadlock")
				}
				f := newFixture(t, db)
				var hooks hookCounts
				ib := f.newInbox(hooks.config(inbox.Config{}))
				breakCommit := commitBreaker(t, tdb.Dialect, db)
				var victim func(*message.Message, *sqlx.Tx) error
				var ignored error
				if failure == "handler ignores a deadlock" {
					victim = deadlockVictim(t, tdb.Dialect, db)
				}
				var failing atomic.Bool
				failing.Store(true)
				out := &outcomes{}
				in := newFeed()
				runRouter(t, func(r *message.Router) {
					r.AddMiddleware(out.Middleware, ib.Middleware)
					r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
						if err := claimOnThisTx(msg, tdb.Dialect, db, f.inbox); err != nil {
							t.Errorf("delivery %s: %v", msg.Metadata.Get("delivery"), err)
						}
						if err := f.writeBusinessRow(msg); err != nil {
							return err
						}
						if !failing.Load() {
							return nil
						}
						tx, _ := inbox.TxFromContext(msg.Context())
						switch failure {
						case "handler fails":
							return errors.New("payment service unavailable")
						case "commit fails":
							return breakCommit(msg, tx)
						}
						// A sloppy handler: it ignores the errors of its statements.
						ignored = victim(msg, tx)
						_ = f.insertRow(msg, msg.UUID+":after the ignored error")
						return nil
					})
				})
				ctx, cancel := context.WithTimeout(context.Background(), caseTimeout)
				defer cancel()

				msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
				if acked, err := in.send(ctx, delivery(msg, "first")); err != nil || acked {
					t.Fatalf("failed delivery: acked %v (%v), want a nack (ignored error: %v)", acked, err, ignored)
				}
				t.Logf("first delivery: %v", out.last("first"))
				if failure != "handler fails" && hooks.failed.Load() != 1 {
					t.Errorf("OnFailed calls = %d, want 1", hooks.failed.Load())
				}
				afterRows := 0
				if failure == "handler ignores a deadlock" {
					var code string
					var myErr *mysql.MySQLError
					if errors.As(ignored, &myErr) {
						code = fmt.Sprint(myErr.Number)
					}
					if code != "1213" && sqlState(ignored) != "40P01" {
						t.Fatalf("the handler's statement failed with %v, want a deadlock", ignored)
					}
					if tdb.Dialect == inbox.MySQL {
						if err := out.last("first"); !errors.Is(err, inbox.ErrTxRolledBack) || !inbox.IsTransient(err) {
							t.Errorf("nacked with %v, want ErrTxRolledBack (transient)", err)
						}
						afterRows = 1 // autocommitted: writes after an ignored deadlock are not the inbox's
					}
				}
				if f.businessRows() != afterRows || f.inboxRows() != 0 {
					t.Fatalf("after the failure: business rows %d, inbox rows %d, want %d and 0", f.businessRows(), f.inboxRows(), afterRows)
				}
				failing.Store(false)
				for _, label := range []string{"redelivery", "second redelivery"} {
					if acked, err := in.send(ctx, delivery(msg, label)); err != nil || !acked {
						t.Fatalf("%s: acked %v (%v), last error %v", label, acked, err, out.last(label))
					}
				}
				if f.businessRows() != afterRows+1 || f.inboxRows() != 1 || hooks.processed.Load() != 1 || hooks.duplicates.Load() != 1 {
					t.Errorf("after redeliveries: business rows %d, inbox rows %d, commits %d, duplicates %d; want %d, 1, 1, 1",
						f.businessRows(), f.inboxRows(), hooks.processed.Load(), hooks.duplicates.Load(), afterRows+1)
				}
			})
		})
	}
}

// Case "middleware order": the handler inserts a row and then fails.
//   - PoisonQueue outside the inbox: the message goes to the poison topic,
//     no inbox row and no business row are left, and a replay of it from
//     there is processed.
//   - Retry outside, with a handler that fails once and then succeeds: one
//     business row, one inbox row, each attempt in a transaction of its own.
//   - The wrong orders cannot be seen by the inbox (a middleware is an opaque
//     function), so they are documented here and in the README: Retry inside
//     the inbox keeps the failed attempt's write (two rows), and on
//     PostgreSQL an attempt that failed on SQL makes every later attempt fail
//     with 25P02; PoisonQueue inside commits the poisoned message's inbox row
//     and the failed handler's write, so its replay is skipped.
func TestCaseMiddlewareOrder(t *testing.T) {
	t.Parallel()
	// failOnce is a handler that inserts a row (its id names the attempt) and
	// fails on its first attempt.
	failOnce := func(f *fixture, attempts *atomic.Int32) message.NoPublishHandlerFunc {
		return func(msg *message.Message) error {
			n := attempts.Add(1)
			if err := f.insertRow(msg, fmt.Sprintf("%s:%d", msg.UUID, n)); err != nil {
				return err
			}
			if n == 1 {
				return errors.New("card declined")
			}
			return nil
		}
	}
	retry := middleware.Retry{MaxRetries: 2, InitialInterval: time.Millisecond}.Middleware

	t.Run("PoisonQueue outside", func(t *testing.T) {
		t.Parallel()
		forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
			f := newFixture(t, db)
			ib := f.newInbox(inbox.Config{})
			sink := &poisonSink{}
			poison, err := middleware.PoisonQueue(sink, "poison")
			if err != nil {
				t.Fatal(err)
			}
			var attempts atomic.Int32
			in := newFeed()
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(poison, ib.Middleware)
				r.AddConsumerHandler("billing", "orders", in, failOnce(f, &attempts))
			})
			msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
			if !in.deliver(t, msg) {
				t.Fatal("poisoned message nacked, want acked (it went to the poison topic)")
			}
			poisoned := sink.poisoned()
			if len(poisoned) != 1 || poisoned[0].UUID != msg.UUID {
				t.Fatalf("poison topic holds %d messages, want M", len(poisoned))
			}
			if f.businessRows() != 0 || f.inboxRows() != 0 {
				t.Fatalf("after poisoning: business rows %d, inbox rows %d; want 0 and 0", f.businessRows(), f.inboxRows())
			}
			if !in.deliver(t, poisoned[0]) { // the replay from the poison topic
				t.Fatal("replay nacked")
			}
			if attempts.Load() != 2 || f.businessRows() != 1 || f.inboxRows() != 1 {
				t.Errorf("after the replay: handler calls %d, business rows %d, inbox rows %d; want 2, 1, 1",
					attempts.Load(), f.businessRows(), f.inboxRows())
			}
		})
	})

	t.Run("Retry outside", func(t *testing.T) {
		t.Parallel()
		forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
			f := newFixture(t, db)
			ib := f.newInbox(inbox.Config{})
			var attempts atomic.Int32
			in := newFeed()
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(retry, ib.Middleware)
				r.AddConsumerHandler("billing", "orders", in, failOnce(f, &attempts))
			})
			msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
			if !in.deliver(t, msg) {
				t.Fatal("nacked")
			}
			if attempts.Load() != 2 || f.businessRows() != 1 || f.inboxRows() != 1 {
				t.Errorf("attempts %d, business rows %d, inbox rows %d; want 2, 1, 1",
					attempts.Load(), f.businessRows(), f.inboxRows())
			}
		})
	})

	t.Run("Retry inside (wrong order, documented)", func(t *testing.T) {
		t.Parallel()
		forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
			f := newFixture(t, db)
			ib := f.newInbox(inbox.Config{})
			var attempts atomic.Int32
			in := newFeed()
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(ib.Middleware, retry)
				r.AddConsumerHandler("billing", "orders", in, failOnce(f, &attempts))
			})
			if !in.deliver(t, message.NewMessage(watermill.NewUUID(), []byte("x"))) {
				t.Fatal("nacked")
			}
			if attempts.Load() != 2 || f.businessRows() != 2 || f.inboxRows() != 1 {
				t.Errorf("attempts %d, business rows %d, inbox rows %d; the documented outcome is 2, 2, 1 "+
					"(the failed attempt's write commits with the successful one)", attempts.Load(), f.businessRows(), f.inboxRows())
			}
		})
	})

	t.Run("Retry inside, attempt fails on SQL (wrong order, documented)", func(t *testing.T) {
		t.Parallel()
		forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
			f := newFixture(t, db)
			ib := f.newInbox(inbox.Config{})
			var attempts atomic.Int32
			var errs []error
			var mu sync.Mutex
			in := newFeed()
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(ib.Middleware, retry)
				r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
					n := attempts.Add(1)
					id := msg.UUID // exists: the first attempt fails on SQL
					if n > 1 {
						id = fmt.Sprintf("%s:%d", msg.UUID, n)
					}
					err := f.insertRow(msg, id)
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
					return err
				})
			})
			msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
			exec(t, db, "INSERT INTO "+f.business+" (id, consumer) VALUES (?, ?)", msg.UUID, "other")
			acked := in.deliver(t, msg)
			mu.Lock()
			defer mu.Unlock()
			if isPostgres(tdb.Dialect) {
				// The transaction is aborted: every later attempt fails with
				// 25P02 and the message is nacked after the last retry.
				if acked || attempts.Load() != 3 || f.inboxRows() != 0 || f.businessRows() != 1 {
					t.Errorf("acked %v, attempts %d, inbox rows %d, business rows %d; want false, 3, 0, 1 (the pre-existing row)",
						acked, attempts.Load(), f.inboxRows(), f.businessRows())
				}
				for i, err := range errs[1:] {
					if sqlState(err) != "25P02" {
						t.Errorf("attempt %d: err %v, want SQLSTATE 25P02 (in failed SQL transaction)", i+2, err)
					}
				}
				return
			}
			// MySQL and SQLite roll back only the failed statement: the second
			// attempt commits.
			if !acked || attempts.Load() != 2 || f.inboxRows() != 1 || f.businessRows() != 2 {
				t.Errorf("acked %v, attempts %d, inbox rows %d, business rows %d; want true, 2, 1, 2",
					acked, attempts.Load(), f.inboxRows(), f.businessRows())
			}
		})
	})

	t.Run("PoisonQueue inside (wrong order, documented)", func(t *testing.T) {
		t.Parallel()
		forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
			f := newFixture(t, db)
			ib := f.newInbox(inbox.Config{})
			sink := &poisonSink{}
			poison, err := middleware.PoisonQueue(sink, "poison")
			if err != nil {
				t.Fatal(err)
			}
			var attempts atomic.Int32
			in := newFeed()
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(ib.Middleware, poison)
				r.AddConsumerHandler("billing", "orders", in, failOnce(f, &attempts))
			})
			msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
			if !in.deliver(t, msg) {
				t.Fatal("nacked")
			}
			poisoned := sink.poisoned()
			if len(poisoned) != 1 {
				t.Fatalf("poison topic holds %d messages, want 1", len(poisoned))
			}
			if !in.deliver(t, poisoned[0]) {
				t.Fatal("replay nacked")
			}
			if attempts.Load() != 1 || f.inboxRows() != 1 || f.businessRows() != 1 {
				t.Errorf("handler calls %d, inbox rows %d, business rows %d; the documented outcome is 1, 1, 1 "+
					"(the poisoned message and its failed write are committed, the replay is skipped)",
					attempts.Load(), f.inboxRows(), f.businessRows())
			}
		})
	})
}

// Case "panics and the pool": a pool of 2 connections, Recoverer outside,
// five handlers that write and then panic, all at once, then one normal
// message. No connection stays in use, no session of the pool is left in a
// transaction, nothing of the panicking handlers is written, every panic is
// reported to OnFailed, and the normal message is processed before a 2 s
// deadline (a bound on the wait, not a measurement). The same for the other
// user code the inbox calls inside the transaction: the Outbox factory and
// the outbox publisher of the handler's returned messages.
func TestCasePanicsAndThePool(t *testing.T) {
	t.Parallel()
	t.Run("handlers", func(t *testing.T) {
		t.Parallel()
		forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
			panicsAndThePool(t, tdb, db)
		})
	})
	t.Run("outbox publisher", func(t *testing.T) {
		t.Parallel()
		forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
			outboxPanicsAndThePool(t, tdb, db)
		})
	})
}

func panicsAndThePool(t *testing.T, tdb testDB, db *sqlx.DB) {
	f := newFixture(t, db)
	var hooks hookCounts
	ib := f.newInbox(hooks.config(inbox.Config{}))
	db.SetMaxOpenConns(2)
	probe := tdb.Open(t) // inspects the sessions from outside the pool
	if tdb.Dialect == inbox.SQLite {
		probe = db
	}
	var mu sync.Mutex
	var pids []int64
	var keys []inboxKey
	const panickers = 5
	feeds := make([]*feed, panickers)
	normal := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(middleware.Recoverer, ib.Middleware)
		for i := range feeds {
			feeds[i] = newFeed()
			r.AddConsumerHandler(fmt.Sprintf("panicker%d", i), "orders", feeds[i], func(msg *message.Message) error {
				var pid int64
				if isPostgres(tdb.Dialect) {
					tx, _ := inbox.TxFromContext(msg.Context())
					if err := tx.GetContext(msg.Context(), &pid, "SELECT pg_backend_pid()"); err != nil {
						return err
					}
				}
				mu.Lock()
				pids = append(pids, pid)
				keys = append(keys, inboxKey{message.HandlerNameFromCtx(msg.Context()), msg.UUID})
				mu.Unlock()
				if err := f.writeBusinessRow(msg); err != nil {
					return err
				}
				panic("handler bug")
			})
		}
		r.AddConsumerHandler("normal", "orders", normal, f.writeBusinessRow)
	})

	ctx, cancel := context.WithTimeout(context.Background(), caseTimeout)
	defer cancel()
	var wg sync.WaitGroup
	for i, in := range feeds {
		wg.Go(func() {
			acked, err := in.send(ctx, delivery(message.NewMessage(watermill.NewUUID(), nil), fmt.Sprint(i)))
			if err != nil || acked {
				t.Errorf("panicking handler %d: acked %v (%v), want a nack", i, acked, err)
			}
		})
	}
	wg.Wait()
	if inUse := db.Stats().InUse; inUse != 0 {
		t.Errorf("connections in use after the panics = %d, want 0", inUse)
	}
	if n := leftInTransaction(t, tdb.Dialect, probe, f.inbox, pids, keys); n != 0 {
		t.Errorf("%d sessions of the pool still in a transaction after the panics", n)
	}
	if f.businessRows() != 0 || f.inboxRows() != 0 || hooks.failed.Load() != panickers {
		t.Errorf("after the panics: business rows %d, inbox rows %d, OnFailed %d; want 0, 0, %d",
			f.businessRows(), f.inboxRows(), hooks.failed.Load(), panickers)
	}

	bound, cancelBound := context.WithTimeout(ctx, 2*time.Second)
	defer cancelBound()
	msg := message.NewMessage(watermill.NewUUID(), nil)
	if acked, err := normal.send(bound, msg); err != nil || !acked {
		t.Fatalf("normal message: acked %v (%v); want it processed within 2 s", acked, err)
	}
	if count(t, db, f.business, "consumer = ?", "normal") != 1 || hooks.processed.Load() != 1 {
		t.Errorf("normal message: business rows %d, commits %d; want 1 and 1",
			count(t, db, f.business, "consumer = ?", "normal"), hooks.processed.Load())
	}
	if inUse := db.Stats().InUse; inUse != 0 {
		t.Errorf("connections in use at the end = %d, want 0", inUse)
	}
}

func outboxPanicsAndThePool(t *testing.T, tdb testDB, db *sqlx.DB) {
	f := newFixture(t, db)
	var hooks hookCounts
	var panicAt atomic.Value // "factory", "publish" or ""
	panicAt.Store("factory")
	ib := f.newInbox(hooks.config(inbox.Config{Outbox: func(tx *sqlx.Tx) (message.Publisher, error) {
		switch panicAt.Load() {
		case "factory":
			panic("outbox factory bug")
		case "publish":
			return panicPublisher{}, nil
		}
		return &poisonSink{}, nil
	}}))
	db.SetMaxOpenConns(2)
	probe := tdb.Open(t)
	if tdb.Dialect == inbox.SQLite {
		probe = db
	}
	var mu sync.Mutex
	var pids []int64
	var keys []inboxKey
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(middleware.Recoverer, ib.Middleware)
		r.AddHandler("billing", "orders", in, "invoices", &poisonSink{}, func(msg *message.Message) ([]*message.Message, error) {
			var pid int64
			if isPostgres(tdb.Dialect) {
				tx, _ := inbox.TxFromContext(msg.Context())
				if err := tx.GetContext(msg.Context(), &pid, "SELECT pg_backend_pid()"); err != nil {
					return nil, err
				}
			}
			mu.Lock()
			pids = append(pids, pid)
			keys = append(keys, inboxKey{"billing", msg.UUID})
			mu.Unlock()
			if err := f.writeBusinessRow(msg); err != nil {
				return nil, err
			}
			return []*message.Message{message.NewMessage(watermill.NewUUID(), nil)}, nil
		})
	})
	ctx, cancel := context.WithTimeout(context.Background(), caseTimeout)
	defer cancel()
	for i, where := range []string{"factory", "publish"} {
		panicAt.Store(where)
		if acked, err := in.send(ctx, message.NewMessage(watermill.NewUUID(), nil)); err != nil || acked {
			t.Fatalf("panic in the outbox %s: acked %v (%v), want a nack", where, acked, err)
		}
		if inUse := db.Stats().InUse; inUse != 0 {
			t.Errorf("panic in the outbox %s: connections in use = %d, want 0", where, inUse)
		}
		if got := hooks.failed.Load(); got != int32(i+1) {
			t.Errorf("panic in the outbox %s: OnFailed calls = %d, want %d", where, got, i+1)
		}
	}
	if n := leftInTransaction(t, tdb.Dialect, probe, f.inbox, pids, keys); n != 0 {
		t.Errorf("%d sessions of the pool still in a transaction after the panics", n)
	}
	if f.businessRows() != 0 || f.inboxRows() != 0 {
		t.Errorf("after the panics: business rows %d, inbox rows %d; want 0 and 0", f.businessRows(), f.inboxRows())
	}
	panicAt.Store("")
	bound, cancelBound := context.WithTimeout(ctx, 2*time.Second)
	defer cancelBound()
	if acked, err := in.send(bound, message.NewMessage(watermill.NewUUID(), nil)); err != nil || !acked {
		t.Fatalf("normal message: acked %v (%v); want it processed within 2 s", acked, err)
	}
	if f.businessRows() != 1 || f.inboxRows() != 1 || hooks.processed.Load() != 1 {
		t.Errorf("normal message: business rows %d, inbox rows %d, commits %d; want 1, 1, 1",
			f.businessRows(), f.inboxRows(), hooks.processed.Load())
	}
}

// Case "three deliveries, first rolls back": three concurrent deliveries of
// M; the first claims and its handler fails once both others wait on the
// key. Exactly one of the others commits. On MySQL/MariaDB the two waiters
// deadlock (1213) when the first rolls back: the victim is nacked, not
// poisoned, and its redelivery is skipped. On PostgreSQL there is no
// deadlock: one waiter claims, the other sees the commit and skips. On
// SQLite the waiters wait in BEGIN IMMEDIATE for the write lock.
func TestCaseThreeDeliveriesFirstRollsBack(t *testing.T) {
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

// Case "SQLite under concurrent writers": WAL, a pool of 4 connections, 8
// messages in flight at all times, 200 distinct ids, handlers that read and
// then write through the transaction. With the settings the README
// recommends (testdb.SQLiteParams: busy_timeout and _txlock=immediate) not
// one "database is locked" error. With plain defaults (WAL only) such
// errors happen; each is a transient nack, never poisoned, and redelivery
// (up to a bound) gets all 200 processed. busy_timeout alone is enough to
// avoid them in the inbox, because the claim is the transaction's first
// statement: it waits for the write lock before it has read anything.
// SQLite only: the servers lock rows, not the database.
func TestCaseSQLiteConcurrentWriters(t *testing.T) {
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

// Case "handler writes through the pool instead of the transaction": a pool
// of 4 connections, 4 messages in flight (as from 4 partitions), a handler
// that writes with the *sqlx.DB. Each inbox transaction holds one of the 4
// connections while its handler waits for a fifth: a deadlock that nothing
// inside the process breaks. (On SQLite, with the recommended
// _txlock=immediate, one transaction holds the write lock and its handler
// waits for a connection that the 3 others hold while they wait, in BEGIN,
// for that lock: only busy_timeout ends it, and the pool write would then
// wait for its own transaction's lock.)
//
// The way out is a deadline on the message context: Watermill's
// middleware.Timeout outside the inbox. When it fires, database/sql rolls the
// inbox transaction back (its context ended) and the handler's pool call
// fails: the message is nacked with a transient error, and its redelivery
// is processed. The inbox cannot see what the handler does with the pool, so
// the library documents it (use the transaction; size the pool above the
// messages in flight; put Timeout outside the inbox) instead of guessing.
func TestCaseHandlerWritesThroughThePool(t *testing.T) {
	t.Parallel()
	const inFlight = 4

	// setup starts a router whose handler, while pool is true, writes
	// through db (and through its transaction); otherwise only through its
	// transaction.
	type setup struct {
		f     *fixture
		hooks *hookCounts
		in    *feed
		out   *outcomes
		sink  *poisonSink
		pool  *atomic.Bool
		// entered counts handler calls that reached the pool write.
		entered *atomic.Int32
	}
	start := func(t *testing.T, db *sqlx.DB, outer ...message.HandlerMiddleware) setup {
		db.SetMaxOpenConns(inFlight)
		s := setup{f: newFixture(t, db), hooks: &hookCounts{}, in: newFeed(), out: &outcomes{}, pool: &atomic.Bool{}, entered: &atomic.Int32{}}
		s.pool.Store(true)
		ib := s.f.newInbox(s.hooks.config(inbox.Config{}))
		var poison message.HandlerMiddleware
		poison, s.sink = poisonUnlessTransient(t)
		runRouter(t, func(r *message.Router) {
			r.AddMiddleware(poison, s.out.Middleware)
			r.AddMiddleware(outer...)
			r.AddMiddleware(ib.Middleware)
			r.AddConsumerHandler("billing", "orders", s.in, func(msg *message.Message) error {
				if s.pool.Load() {
					s.entered.Add(1)
					// In flight together: the pool write starts once all 4
					// connections are taken by the deliveries (their
					// transactions, or on SQLite BEGIN waiting for the lock).
					for db.Stats().InUse < inFlight {
						select {
						case <-msg.Context().Done():
							return msg.Context().Err()
						case <-time.After(time.Millisecond):
						}
					}
					if _, err := db.ExecContext(msg.Context(), db.Rebind("INSERT INTO "+s.f.business+" (id, consumer) VALUES (?, ?)"),
						msg.UUID+":pool", "billing"); err != nil {
						return err
					}
				}
				return s.f.insertRow(msg, msg.UUID+":tx")
			})
		})
		return s
	}
	// sendAll delivers msgs at once and returns whether each was acked.
	sendAll := func(t *testing.T, ctx context.Context, in *feed, msgs []*message.Message) []bool {
		acked := make([]bool, len(msgs))
		var wg sync.WaitGroup
		for i, m := range msgs {
			wg.Go(func() {
				var err error
				if acked[i], err = in.send(ctx, m); err != nil {
					t.Error(err)
				}
			})
		}
		wg.Wait()
		return acked
	}
	newMessages := func() []*message.Message {
		msgs := make([]*message.Message, inFlight)
		for i := range msgs {
			msgs[i] = message.NewMessage(watermill.NewUUID(), nil)
		}
		return msgs
	}

	t.Run("no deadline: deadlock", func(t *testing.T) {
		t.Parallel()
		forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
			s := start(t, db)
			ctx, cancel := context.WithTimeout(context.Background(), caseTimeout)
			defer cancel()
			// The messages' own contexts, which the test cancels once the
			// deadlock is proven: the only way out, as nothing else ends.
			stuck, unstick := context.WithCancel(context.Background())
			defer unstick()
			baseWaits := db.Stats().WaitCount
			msgs := newMessages()
			for i, m := range msgs {
				m.SetContext(stuck)
				msgs[i] = m
			}
			done := make(chan []bool, 1)
			go func() { done <- sendAll(t, ctx, s.in, msgs) }()

			// Deadlocked: every connection is in use by an inbox transaction
			// and handlers wait for a connection. On the servers all 4
			// handlers wait; on SQLite the one holding the write lock waits
			// while the other 3 wait for that lock in BEGIN.
			wantEntered := int32(inFlight)
			if tdb.Dialect == inbox.SQLite {
				wantEntered = 1
			}
			for {
				st := db.Stats()
				if s.entered.Load() == wantEntered && st.InUse == inFlight && st.WaitCount-baseWaits >= int64(wantEntered) {
					break
				}
				select {
				case acked := <-done:
					t.Fatalf("deliveries finished without a deadlock: acked %v, errors %v", acked, s.out.failures())
				case <-ctx.Done():
					t.Fatalf("never deadlocked: entered %d, stats %+v", s.entered.Load(), db.Stats())
				case <-time.After(5 * time.Millisecond):
				}
			}
			if s.hooks.processed.Load()+s.hooks.failed.Load() != 0 {
				t.Fatalf("a message finished while deadlocked")
			}
			unstick()
			acked := <-done
			for i, a := range acked {
				if err := s.out.failures(); a || len(err) != inFlight {
					t.Fatalf("message %d: acked %v; errors %v; want every message nacked", i, a, err)
				}
			}
			for _, err := range s.out.failures() {
				if !errors.Is(err, context.Canceled) || !inbox.IsTransient(err) {
					t.Errorf("err %v, want context.Canceled (transient)", err)
				}
			}
			if s.f.businessRows() != 0 || s.f.inboxRows() != 0 || len(s.sink.poisoned()) != 0 {
				t.Errorf("business rows %d, inbox rows %d, poisoned %d; want 0, 0, 0",
					s.f.businessRows(), s.f.inboxRows(), len(s.sink.poisoned()))
			}
		})
	})

	t.Run("Timeout outside the inbox", func(t *testing.T) {
		t.Parallel()
		forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
			s := start(t, db, middleware.Timeout(500*time.Millisecond))
			ctx, cancel := context.WithTimeout(context.Background(), caseTimeout)
			defer cancel()
			msgs := newMessages()
			acked := sendAll(t, ctx, s.in, msgs) // bounded: the deadline ends the deadlock
			if t.Failed() {
				return
			}
			nacked := 0
			for _, a := range acked {
				if !a {
					nacked++
				}
			}
			if nacked == 0 {
				t.Fatalf("every message acked; the first deadline to fire must nack its message")
			}
			// Every nack is transient, and the deadline is what broke the
			// deadlock. On MariaDB a handler's own pool call may instead
			// fail with driver.ErrBadConn (seen once in CI under load; the
			// exact path through database/sql and go-sql-driver, as other
			// deliveries' deadlines close their connections, is not known):
			// accepted there, from the handler only (not the inbox's own
			// statements, whose errors start with "inbox:").
			deadline := false
			for _, err := range s.out.failures() {
				deadline = deadline || errors.Is(err, context.DeadlineExceeded)
				badConn := tdb.Dialect == inbox.MySQL && errors.Is(err, driver.ErrBadConn) && !strings.HasPrefix(err.Error(), "inbox:")
				if !inbox.IsTransient(err) || !(errors.Is(err, context.DeadlineExceeded) || badConn) {
					t.Errorf("err %v, want context.DeadlineExceeded (or, on MariaDB, the handler's driver.ErrBadConn), transient", err)
				}
			}
			if !deadline {
				t.Errorf("no nack by the deadline: %v", s.out.failures())
			}
			// The handler is fixed to write through its transaction; the
			// redeliveries are processed.
			s.pool.Store(false)
			for i, m := range msgs {
				if acked[i] {
					continue
				}
				if a, err := s.in.send(ctx, m.Copy()); err != nil || !a {
					t.Fatalf("redelivery of message %d: acked %v (%v), last errors %v", i, a, err, s.out.failures())
				}
			}
			if s.f.inboxRows() != inFlight || count(t, db, s.f.business, "id LIKE ?", "%:tx") != inFlight || len(s.sink.poisoned()) != 0 {
				t.Errorf("inbox rows %d, transactional business rows %d, poisoned %d; want %d, %d, 0",
					s.f.inboxRows(), count(t, db, s.f.business, "id LIKE ?", "%:tx"), len(s.sink.poisoned()), inFlight, inFlight)
			}
			t.Logf("%d of %d nacked by the deadline; pool rows kept: %d", nacked, inFlight, count(t, db, s.f.business, "id LIKE ?", "%:pool"))
		})
	})

	t.Run("pool writes are not rolled back", func(t *testing.T) {
		t.Parallel()
		forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
			if tdb.Dialect == inbox.SQLite {
				t.Skip("on SQLite a pool write cannot happen while the inbox transaction holds the write lock (see the other subtests)")
			}
			f := newFixture(t, db)
			ib := f.newInbox(inbox.Config{})
			var fail atomic.Bool
			fail.Store(true)
			in := newFeed()
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(ib.Middleware)
				r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
					if _, err := db.ExecContext(msg.Context(), db.Rebind("INSERT INTO "+f.business+" (id, consumer) VALUES (?, ?)"),
						watermill.NewUUID(), msg.UUID); err != nil {
						return err
					}
					if fail.Load() {
						return errors.New("card declined")
					}
					return nil
				})
			})
			msg := message.NewMessage(watermill.NewUUID(), nil)
			if in.deliver(t, msg) {
				t.Fatal("failed delivery acked")
			}
			if f.inboxRows() != 0 || f.businessRows() != 1 {
				t.Errorf("after the failure: inbox rows %d, business rows %d; the pool write is kept (1), the inbox row is not (0)",
					f.inboxRows(), f.businessRows())
			}
			fail.Store(false)
			if !in.deliver(t, msg) {
				t.Fatal("redelivery nacked")
			}
			if got := count(t, db, f.business, "consumer = ?", msg.UUID); got != 2 {
				t.Errorf("business rows for the message = %d; the documented outcome is 2 (one per handler run)", got)
			}
		})
	})
}
