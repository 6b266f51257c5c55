package inbox_test

// Errors of conflicting transactions (isolation errors, serialization
// failures, deadlocks) are transient nacks, and every message ends processed
// exactly once.

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// An isolation error in the handler at REPEATABLE READ is a transient nack:
// two workers process two messages at once, and both handlers read a shared
// row and then update it. The second update fails with the database's
// isolation error (PostgreSQL 40001; MariaDB with
// innodb_snapshot_isolation=ON, the default since 11.6, 1020 "Record has
// changed since last read"). It must be a nack, kept from the poison queue by
// IsTransient, and its redelivery is processed: the counter ends at 2.
// Databases that report no such error at REPEATABLE READ (SQLite, MySQL
// without snapshot isolation) and the partitioned dialect (READ COMMITTED
// only) do not apply.
func TestIsolationError_InTheHandlerIsATransientNack(t *testing.T) {
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
		acked := sendToEach(ctx, t, workers, func(label string) *message.Message { return msgs[label] })
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

// TestIsolationError_SerializationFailuresAreRedeliveredUntilProcessed runs
// handlers that read-modify-write a counter per account (read the balance,
// write balance+1) at REPEATABLE READ and SERIALIZABLE (Config.TxOptions),
// four messages at a time on two accounts. The first two messages are forced
// to collide: both read the same account before either writes. What the loser
// gets:
//
//   - PostgreSQL, both levels: SQLSTATE 40001 (could not serialize access
//     due to concurrent update).
//   - MariaDB SERIALIZABLE: InnoDB turns the plain SELECT into a shared
//     lock, both then want the exclusive lock: deadlock, error 1213.
//   - MariaDB REPEATABLE READ: with innodb_snapshot_isolation=ON (the
//     default from MariaDB 11.6; set per session here) the second writer
//     gets error 1020 (ER_CHECKREAD, "Record has changed since last read").
//     With it OFF (the default before 11.6, and MySQL) InnoDB raises no
//     error at all: the second UPDATE overwrites the first, a lost update the
//     inbox cannot see; such handlers must read with SELECT ... FOR UPDATE.
//
// Every loser is nacked and redelivered until processed; at the end each
// counter equals the number of messages for its account.
//
// The claim itself: two deliveries of one message at once; the second waits
// on the first's key. On PostgreSQL at REPEATABLE READ or SERIALIZABLE it
// then fails with 40001 (the committed row is not in its snapshot): a nack,
// and the redelivery is skipped as a duplicate. MariaDB does not fail there
// at either level: the claim's ON DUPLICATE KEY UPDATE is a locking read of
// the latest row, so the second delivery is acked as a duplicate at once.
func TestIsolationError_SerializationFailuresAreRedeliveredUntilProcessed(t *testing.T) {
	t.Parallel()
	for _, kind := range []string{"postgres", "mysql"} {
		for _, level := range []sql.IsolationLevel{sql.LevelRepeatableRead, sql.LevelSerializable} {
			name := kind + "/" + strings.ReplaceAll(strings.ToUpper(level.String()), " ", "_")
			t.Run(name+"/counter", func(t *testing.T) {
				t.Parallel()
				serializationCounter(t, kind, level)
			})
			t.Run(name+"/claim", func(t *testing.T) {
				t.Parallel()
				serializationClaim(t, kind, level)
			})
		}
	}
}

// snapshotIsolationParam returns the DSN parameter that turns on MariaDB's
// innodb_snapshot_isolation for kind at level, or skips when the server has
// no such variable.
func snapshotIsolationParam(t *testing.T, kind string, level sql.IsolationLevel) string {
	if kind != "mysql" || level != sql.LevelRepeatableRead {
		return ""
	}
	probe := testdb.OpenMySQL(t, "")
	var n int
	if err := probe.Get(&n, "SELECT COUNT(*) FROM information_schema.SYSTEM_VARIABLES WHERE VARIABLE_NAME = 'INNODB_SNAPSHOT_ISOLATION'"); err != nil || n == 0 {
		t.Skipf("no innodb_snapshot_isolation on this server (%v): at REPEATABLE READ InnoDB loses the update silently, there is no fault to test", err)
	}
	return "innodb_snapshot_isolation=ON"
}

func serializationCounter(t *testing.T, kind string, level sql.IsolationLevel) {
	d := openFaultDB(t, kind, snapshotIsolationParam(t, kind, level))
	ctx, cancel := context.WithTimeout(context.Background(), faultTimeout)
	defer cancel()
	accounts := "accounts_" + randomSuffix()
	exec(t, d.ctl, "CREATE TABLE "+accounts+" (id INT NOT NULL PRIMARY KEY, balance INT NOT NULL)")
	dropLater(t, d.ctl, accounts)
	exec(t, d.ctl, "INSERT INTO "+accounts+" (id, balance) VALUES (1, 0), (2, 0)")

	msgs := newMessages(60)
	perAccount := map[string]int{}
	for i, msg := range msgs {
		acct := strconv.Itoa(i%2 + 1)
		if i < 2 {
			acct = "1" // the forced pair
		}
		msg.Metadata.Set("account", acct)
		perAccount[acct]++
	}
	a, b := msgs[0], msgs[1]
	pair := newPair(a, b)

	var e *faultEnv
	e = newFaultEnv(t, d, inbox.Config{TxOptions: &sql.TxOptions{Isolation: level}},
		func(msg *message.Message, tx *sqlx.Tx, attempt int) error {
			mctx := msg.Context()
			member := attempt == 1 && pair.member(msg)
			if member {
				defer pair.done(msg) // also when the read fails
			} else if err := pair.wait(ctx, "the forced pair to read"); err != nil {
				return err
			}
			acct := msg.Metadata.Get("account")
			var balance int
			if err := tx.GetContext(mctx, &balance, tx.Rebind("SELECT balance FROM "+accounts+" WHERE id = ?"), acct); err != nil {
				return fmt.Errorf("read balance: %w", err)
			}
			if member {
				pair.done(msg)
				if err := pair.wait(ctx, "the other message of the pair to read"); err != nil {
					return err
				}
			}
			if _, err := tx.ExecContext(mctx, tx.Rebind("UPDATE "+accounts+" SET balance = ? WHERE id = ?"), balance+1, acct); err != nil {
				return fmt.Errorf("write balance: %w", err)
			}
			return e.ledgerRow(msg, tx, attempt, false)
		})
	e.stream(ctx, msgs, 4)

	// The forced pair: at least one lost with the level's error. (At
	// SERIALIZABLE on PostgreSQL both may.)
	wantCode := map[string]string{"postgres": "SQLSTATE 40001", "mysql": "MySQL 1020"}[kind]
	if level == sql.LevelSerializable && kind == "mysql" {
		wantCode = "MySQL 1213"
	}
	losers := 0
	for _, msg := range []*message.Message{a, b} {
		ds := e.deliveries(msg.UUID)
		if len(ds) > 0 && !ds[0].acked {
			losers++
			if !strings.Contains(describeErr(ds[0].err), wantCode) {
				t.Errorf("forced pair: the loser got %s, want %s", describeErr(ds[0].err), wantCode)
			}
			e.wantFaultNacked(msg, 1, "forced pair")
		}
	}
	if losers == 0 {
		t.Errorf("forced pair: both committed, want a %s", wantCode)
	}
	t.Logf("%d nacks: %s", len(e.nacks()), e.nackSummary())

	var balances []struct {
		ID      string `db:"id"`
		Balance int    `db:"balance"`
	}
	if err := d.ctl.Select(&balances, "SELECT id, balance FROM "+accounts+" ORDER BY id"); err != nil {
		t.Fatal(err)
	}
	for _, bal := range balances {
		if bal.Balance != perAccount[bal.ID] {
			t.Errorf("account %s: balance %d, want %d (one per message)", bal.ID, bal.Balance, perAccount[bal.ID])
		}
	}
	e.checkExactlyOnce(ids(msgs))
}

func serializationClaim(t *testing.T, kind string, level sql.IsolationLevel) {
	d := openFaultDB(t, kind, snapshotIsolationParam(t, kind, level))
	ctx, cancel := context.WithTimeout(context.Background(), faultTimeout)
	defer cancel()
	var calls atomic.Int32
	entered := make(chan struct{})
	var e *faultEnv
	e = newFaultEnv(t, d, inbox.Config{TxOptions: &sql.TxOptions{Isolation: level}},
		func(msg *message.Message, tx *sqlx.Tx, attempt int) error {
			if calls.Add(1) == 1 {
				// First delivery: holds the key until the second one waits on it.
				close(entered)
				if err := poll(ctx, d.every(), func() (bool, error) {
					n, err := d.lockWaiters(ctx, e.inbox)
					return n == 1, err
				}); err != nil {
					return fmt.Errorf("waiting for the second delivery to wait on the key: %w", err)
				}
			}
			return e.ledgerRow(msg, tx, attempt, false)
		})
	msg := message.NewMessage(watermill.NewUUID(), nil)
	first := make(chan error, 1)
	go func() {
		d, err := e.deliver(ctx, msg, 1)
		if err == nil && !d.acked {
			err = fmt.Errorf("first delivery nacked: %v", d.err)
		}
		first <- err
	}()
	if err := waitCh(ctx, entered, "the first delivery's handler"); err != nil {
		t.Fatal(err)
	}
	second, err := e.deliver(ctx, msg, 1)
	if err != nil {
		t.Fatal(err)
	}
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	if d.postgres() {
		if second.acked || pgCode(second.err) != "40001" {
			t.Errorf("concurrent claim: acked %v, err %s; want a nack with SQLSTATE 40001", second.acked, describeErr(second.err))
		} else {
			t.Logf("concurrent claim: nacked with %s", describeErr(second.err))
		}
		if err := e.deliverUntilAcked(ctx, msg, 2); err != nil {
			t.Fatal(err)
		}
		if ds := e.deliveries(msg.UUID); len(ds) != 3 || ds[2].outcome != "duplicate" {
			t.Errorf("redelivery after the serialization failure: %+v, want one, skipped as a duplicate", ds[2:])
		}
	} else if !second.acked || second.outcome != "duplicate" {
		t.Errorf("concurrent claim on MariaDB: acked %v (%s), err %s; want acked as a duplicate", second.acked, second.outcome, describeErr(second.err))
	}
	if calls.Load() != 1 {
		t.Errorf("handler calls = %d, want 1", calls.Load())
	}
	e.checkExactlyOnce([]string{msg.UUID})
}

// TestDeadlock_MySQLVictimIsNackedAndRedelivered makes InnoDB report
// deadlocks (error 1213), with and without clientFoundRows:
//
//   - "opposite lock order": handlers lock two business rows, even messages
//     row 1 then row 2, odd ones row 2 then row 1, four at a time. The first
//     two messages are forced into the deadlock (each holds its first row
//     before either asks for its second); the others deadlock when they
//     happen to. InnoDB rolls back the victim's whole transaction; it is
//     nacked and redelivered until processed, and both counters end equal
//     to the number of messages.
//   - "three deliveries": three deliveries of one message at once; the
//     first claims the key, and fails once the two others wait on it. When
//     it rolls back, the two waiters' claims deadlock on the freed key:
//     InnoDB lets one claim (its handler runs and commits) and makes the
//     other the victim (1213: a nack); the victim's redelivery is skipped
//     as a duplicate.
func TestDeadlock_MySQLVictimIsNackedAndRedelivered(t *testing.T) {
	t.Parallel()
	for _, kind := range []string{"mysql", "mysql-clientFoundRows"} {
		t.Run(kind+"/opposite_lock_order", func(t *testing.T) {
			t.Parallel()
			d := openFaultDB(t, kind, "")
			ctx, cancel := context.WithTimeout(context.Background(), faultTimeout)
			defer cancel()
			rows := "locks_" + randomSuffix()
			exec(t, d.ctl, "CREATE TABLE "+rows+" (id INT NOT NULL PRIMARY KEY, n INT NOT NULL) ENGINE=InnoDB")
			dropLater(t, d.ctl, rows)
			exec(t, d.ctl, "INSERT INTO "+rows+" (id, n) VALUES (1, 0), (2, 0)")

			msgs := newMessages(60)
			a, b := msgs[0], msgs[1]
			pair := newPair(a, b)
			var e *faultEnv
			e = newFaultEnv(t, d, inbox.Config{}, func(msg *message.Message, tx *sqlx.Tx, attempt int) error {
				member := attempt == 1 && pair.member(msg)
				if member {
					defer pair.done(msg) // also when the first lock fails
				} else if err := pair.wait(ctx, "the forced pair to lock its first rows"); err != nil {
					return err
				}
				order := []int{1, 2}
				if n, _ := strconv.Atoi(msg.Metadata.Get("n")); n%2 == 1 {
					order = []int{2, 1}
				}
				for i, id := range order {
					if _, err := tx.ExecContext(msg.Context(), "UPDATE "+rows+" SET n = n + 1 WHERE id = ?", id); err != nil {
						return fmt.Errorf("lock row %d: %w", id, err)
					}
					if i == 0 && member {
						pair.done(msg)
						if err := pair.wait(ctx, "the other message of the pair to lock its first row"); err != nil {
							return err
						}
					}
				}
				return e.ledgerRow(msg, tx, attempt, false)
			})
			e.stream(ctx, msgs, 4)

			losers := 0
			for _, msg := range []*message.Message{a, b} {
				if ds := e.deliveries(msg.UUID); len(ds) > 0 && !ds[0].acked {
					losers++
					if err := e.wantFaultNacked(msg, 1, "forced deadlock"); mysqlNumber(err) != 1213 {
						t.Errorf("forced deadlock: got %s, want MySQL 1213", describeErr(err))
					}
				}
			}
			if losers != 1 {
				t.Errorf("forced deadlock: %d of the pair lost, want exactly 1", losers)
			}
			for _, n := range e.nacks() {
				if mysqlNumber(n.err) != 1213 {
					t.Errorf("nack with %s, want only deadlocks (1213)", describeErr(n.err))
				}
			}
			t.Logf("deadlocks: %d (1 forced)", len(e.nacks()))
			var counts []int
			if err := d.ctl.Select(&counts, "SELECT n FROM "+rows+" ORDER BY id"); err != nil {
				t.Fatal(err)
			}
			if len(counts) != 2 || counts[0] != len(msgs) || counts[1] != len(msgs) {
				t.Errorf("row counters %v, want [%d %d]", counts, len(msgs), len(msgs))
			}
			e.checkExactlyOnce(ids(msgs))
		})

		t.Run(kind+"/three_deliveries", func(t *testing.T) {
			t.Parallel()
			d := openFaultDB(t, kind, "")
			ctx, cancel := context.WithTimeout(context.Background(), faultTimeout)
			defer cancel()
			var calls atomic.Int32
			entered := make(chan struct{})
			var e *faultEnv
			e = newFaultEnv(t, d, inbox.Config{}, func(msg *message.Message, tx *sqlx.Tx, attempt int) error {
				if err := e.ledgerRow(msg, tx, attempt, false); err != nil {
					return err
				}
				if calls.Add(1) == 1 {
					close(entered)
					if err := poll(ctx, d.every(), func() (bool, error) {
						n, err := d.lockWaiters(ctx, e.inbox)
						return n == 2, err
					}); err != nil {
						return fmt.Errorf("waiting for two deliveries to wait on the key: %w", err)
					}
					return errors.New("the first delivery fails")
				}
				return nil
			})
			msg := message.NewMessage(watermill.NewUUID(), nil)
			type result struct {
				d   faultDelivery
				err error
			}
			results := make(chan result, 3)
			deliver := func() {
				d, err := e.deliver(ctx, msg, 1)
				results <- result{d, err}
			}
			go deliver()
			if err := waitCh(ctx, entered, "the first delivery's handler"); err != nil {
				t.Fatal(err)
			}
			go deliver()
			go deliver()
			var processed, deadlocked, failedFirst int
			for range 3 {
				r := <-results
				if r.err != nil {
					t.Fatal(r.err)
				}
				switch {
				case r.d.acked && r.d.outcome == "processed":
					processed++
				case !r.d.acked && mysqlNumber(r.d.err) == 1213:
					deadlocked++
					if !inbox.IsTransient(r.d.err) {
						t.Errorf("deadlock loser: IsTransient(%s) = false", describeErr(r.d.err))
					}
					t.Logf("deadlock loser nacked with %s", describeErr(r.d.err))
				case !r.d.acked && r.d.outcome == "failed" && strings.Contains(errText(r.d.err), "the first delivery fails"):
					failedFirst++
				default:
					t.Errorf("unexpected delivery: acked %v, hook %q, err %s", r.d.acked, r.d.outcome, describeErr(r.d.err))
				}
			}
			if failedFirst != 1 || processed != 1 || deadlocked != 1 {
				t.Errorf("first failed %d, processed %d, deadlocked %d; want 1, 1, 1", failedFirst, processed, deadlocked)
			}
			// The deadlock loser's redelivery: skipped as a duplicate.
			r, err := e.deliver(ctx, msg, 2)
			if err != nil {
				t.Fatal(err)
			}
			if !r.acked || r.outcome != "duplicate" {
				t.Errorf("redelivery: acked %v, hook %q, err %s; want skipped as a duplicate", r.acked, r.outcome, describeErr(r.err))
			}
			if calls.Load() != 2 {
				t.Errorf("handler calls = %d, want 2 (the failed first, and the one that claimed after it)", calls.Load())
			}
			// The handler's own failure is not transient; only check rows and leaks.
			e.checkRows([]string{msg.UUID})
			d.checkNoLeaks(t)
		})
	}
}
