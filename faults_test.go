package inbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	osexec "os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jmoiron/sqlx"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// Environment of the opt-in server restart test.
const (
	restartClusterEnv = "INBOX_TEST_RESTART_PG_CLUSTER" // "15/inboxfaults": VERSION/NAME for pg_ctlcluster
	restartDSNEnv     = "INBOX_TEST_RESTART_PG_DSN"     // a DSN of that cluster

	restartMySQLCmdEnv = "INBOX_TEST_RESTART_MYSQL_CMD" // a command that restarts a throwaway MariaDB server
	restartMySQLDSNEnv = "INBOX_TEST_RESTART_MYSQL_DSN" // a DSN of that server
)

// TestFaultBackendTerminated kills the server session of a message's
// transaction from another connection (PostgreSQL: pg_terminate_backend;
// MySQL/MariaDB: KILL CONNECTION), each way after the handler wrote its row:
//
//   - "before a statement": the handler's next statement fails, and the
//     handler returns that error;
//   - "statement error swallowed": the same, but the handler ignores the
//     error (a best-effort write) and returns nil, so the middleware commits
//     on a connection the driver already knows is closed;
//   - "before COMMIT": the handler returns nil, the middleware's COMMIT (on
//     MySQL, its pre-commit check of the claim) meets the dead session;
//   - "during COMMIT", PostgreSQL only: a deferred constraint trigger makes
//     the COMMIT wait on an advisory lock the test holds; the test kills the
//     backend once it waits there (pg_stat_activity: query "commit",
//     wait_event "advisory"). MySQL has no deferred trigger to hold a COMMIT
//     at a known point.
//
// Each is a nack that IsTransient accepts (PostgreSQL: SQLSTATE 57P01,
// admin_shutdown, or pgx's "conn closed"; MySQL: go-sql-driver's "invalid
// connection" with the failed ROLLBACK, or driver.ErrBadConn), never an
// ack; the server rolls the transaction back; database/sql drops the dead
// connection (no other delivery of the stream fails), and the redelivery
// processes the message once.
func TestFaultBackendTerminated(t *testing.T) {
	t.Parallel()
	for _, kind := range []string{"postgres", "postgres-partitioned", "mysql", "mysql-clientFoundRows"} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			d := openFaultDB(t, kind, "")
			ctx, cancel := context.WithTimeout(context.Background(), faultTimeout)
			var killers sync.WaitGroup
			defer func() { cancel(); killers.Wait() }()

			const (
				beforeStatement = "before a statement"
				swallowed       = "statement error swallowed"
				beforeCommit    = "before COMMIT"
				duringCommit    = "during COMMIT"
			)
			msgs := newMessages(100)
			victims := map[string]string{ // message UUID -> how its session dies
				msgs[10].UUID: beforeStatement,
				msgs[30].UUID: swallowed,
				msgs[50].UUID: beforeCommit,
			}
			if d.postgres() {
				victims[msgs[70].UUID] = duringCommit
			}
			k1, k2 := rand.Int32(), rand.Int32() // the advisory lock the COMMIT waits on
			var e *faultEnv
			e = newFaultEnv(t, d, inbox.Config{}, func(msg *message.Message, tx *sqlx.Tx, attempt int) error {
				mctx := msg.Context()
				how := victims[msg.UUID]
				if attempt != 1 {
					how = ""
				}
				if err := e.ledgerRow(msg, tx, attempt, how == duringCommit); err != nil {
					return err
				}
				if how == "" {
					return nil
				}
				id, err := d.sessionID(mctx, tx)
				if err != nil {
					return err
				}
				if how == duringCommit {
					killers.Add(1)
					go func() {
						defer killers.Done()
						err := poll(ctx, d.every(), func() (bool, error) {
							var n int
							err := d.ctl.GetContext(ctx, &n, `SELECT count(*) FROM pg_stat_activity
								WHERE pid = $1 AND wait_event = 'advisory' AND lower(query) = 'commit'`, id)
							return n == 1, err
						})
						if err == nil {
							err = d.kill(ctx, id)
						}
						if err != nil {
							t.Errorf("kill during COMMIT: %v", err)
						}
					}()
					return nil // the middleware's COMMIT waits in the trigger, and is killed there
				}
				if err := d.kill(ctx, id); err != nil {
					t.Errorf("kill: %v", err)
				}
				switch how {
				case beforeStatement, swallowed:
					_, err := tx.ExecContext(mctx, "SELECT 1")
					if err == nil {
						return errors.New("a statement succeeded on a killed session")
					}
					if how == swallowed {
						return nil
					}
					return fmt.Errorf("after the session was killed: %w", err)
				}
				return nil // beforeCommit: the middleware commits on the dead session
			})

			if d.postgres() {
				// The deferred trigger: at COMMIT, a row with block_commit
				// waits for the advisory lock (k1, k2), which the test holds.
				fn := "inbox_faults_block_" + randomSuffix()
				exec(t, d.ctl, `CREATE FUNCTION `+fn+`() RETURNS trigger LANGUAGE plpgsql AS $$
					BEGIN PERFORM pg_advisory_xact_lock(`+fmt.Sprint(k1)+`, `+fmt.Sprint(k2)+`); RETURN NULL; END $$`)
				t.Cleanup(func() { _, _ = d.ctl.Exec(`DROP FUNCTION IF EXISTS ` + fn + `() CASCADE`) })
				exec(t, d.ctl, `CREATE CONSTRAINT TRIGGER `+fn+` AFTER INSERT ON `+e.ledger+`
					DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (NEW.block_commit) EXECUTE FUNCTION `+fn+`()`)
				lock, err := d.ctl.Connx(ctx)
				if err != nil {
					t.Fatal(err)
				}
				defer lock.Close()
				if _, err := lock.ExecContext(ctx, "SELECT pg_advisory_lock($1, $2)", k1, k2); err != nil {
					t.Fatal(err)
				}
				defer lock.ExecContext(context.Background(), "SELECT pg_advisory_unlock($1, $2)", k1, k2)
			}

			e.stream(ctx, msgs, 4)
			killers.Wait()

			for _, msg := range msgs {
				how, ok := victims[msg.UUID]
				if !ok {
					continue
				}
				err := e.wantFaultNacked(msg, 1, "killed "+how)
				if d.postgres() && how == swallowed && !errors.Is(err, pgconn.ErrConnClosed) {
					t.Errorf("killed %s: got %s, want pgx's conn closed", how, describeErr(err))
				}
				if d.postgres() && how != swallowed && pgCode(err) != "57P01" {
					t.Errorf("killed %s: got %s, want SQLSTATE 57P01", how, describeErr(err))
				}
				if how != beforeStatement && !strings.Contains(errText(err), "inbox: commit") {
					t.Errorf("killed %s: got %s, want the COMMIT's error", how, describeErr(err))
				}
				if n := len(e.deliveries(msg.UUID)); n != 2 {
					t.Errorf("killed %s: %d deliveries, want 2", how, n)
				}
			}
			if n := len(e.nacks()); n != len(victims) {
				t.Errorf("%d nacks, want exactly the %d faulted attempts: a dead connection was reused%s", n, len(victims), e.nackSummary())
			}
			e.checkExactlyOnce(ids(msgs))
		})
	}
}

// TestFaultMySQLCommitInDoubt loses the connection of a few messages'
// transactions right after their COMMIT was sent (dropAfterConn): the
// server commits, and go-sql-driver reports only "invalid connection", an
// error with no MySQL error number. The middleware must nack it (never ack
// what it cannot know committed) with an error IsTransient accepts, and the
// redelivery must find the message processed and skip it as a duplicate.
// Every message ends with exactly one business row.
func TestFaultMySQLCommitInDoubt(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), faultTimeout)
	defer cancel()
	d, dropped := openDroppingMySQL(t, "COMMIT", nil, nil)

	msgs := newMessages(60)
	victims := map[string]bool{msgs[5].UUID: true, msgs[25].UUID: true, msgs[45].UUID: true}
	var e *faultEnv
	e = newFaultEnv(t, d, inbox.Config{}, func(msg *message.Message, tx *sqlx.Tx, attempt int) error {
		if err := e.ledgerRow(msg, tx, attempt, false); err != nil {
			return err
		}
		if victims[msg.UUID] && attempt == 1 {
			var s string
			return tx.GetContext(msg.Context(), &s, "SELECT '"+dropMarker+"'")
		}
		return nil
	})
	e.stream(ctx, msgs, 4)

	if n := int(dropped.Load()); n != len(victims) {
		t.Errorf("%d connections dropped after COMMIT, want %d", n, len(victims))
	}
	perMessage := e.checkDeliveries()
	for _, msg := range msgs {
		if !victims[msg.UUID] {
			if perMessage[msg.UUID] != 1 {
				t.Errorf("message %s: %d deliveries committed, want 1", msg.UUID, perMessage[msg.UUID])
			}
			continue
		}
		err := e.wantFaultNacked(msg, 1, "COMMIT in doubt")
		if !strings.Contains(errText(err), "inbox: commit") || mysqlNumber(err) != 0 {
			t.Errorf("COMMIT in doubt: got %s, want the COMMIT's error without a MySQL error number", describeErr(err))
		}
		ds := e.deliveries(msg.UUID)
		// The server committed the first attempt: the redelivery is a
		// duplicate. (Had it rolled back, the redelivery would process it:
		// also exactly once, and checkRows would hold; but then this test
		// would not have tested a COMMIT in doubt.)
		if len(ds) != 2 || ds[1].outcome != "duplicate" || perMessage[msg.UUID] != 0 {
			t.Errorf("COMMIT in doubt, message %s: deliveries %+v; want a nack, then a duplicate", msg.UUID, ds)
		}
	}
	if n := len(e.nacks()); n != len(victims) {
		t.Errorf("%d nacks, want exactly the %d in doubt%s", n, len(victims), e.nackSummary())
	}
	e.checkRows(ids(msgs))
	d.checkNoLeaks(t)
}

// TestFaultMySQLBeginConnectionLost loses the connection of the stream's
// first BEGIN right after START TRANSACTION was sent (dropAfterConn):
// go-sql-driver reports a plain "invalid connection", which database/sql
// does not retry. The middleware retries such a BEGIN once, on another
// connection, so every message is processed at its first delivery: no
// nack, one business row each.
func TestFaultMySQLBeginConnectionLost(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), faultTimeout)
	defer cancel()
	var armed atomic.Bool
	d, dropped := openDroppingMySQL(t, "START TRANSACTION", &armed, nil)
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	var e *faultEnv
	e = newFaultEnv(t, d, inbox.Config{TracerProvider: tp}, func(msg *message.Message, tx *sqlx.Tx, attempt int) error {
		return e.ledgerRow(msg, tx, attempt, false)
	})
	armed.Store(true)
	msgs := newMessages(20)
	e.stream(ctx, msgs, 2)

	if n := dropped.Load(); n != 1 {
		t.Errorf("%d connections dropped after START TRANSACTION, want 1", n)
	}
	retried := 0
	for _, span := range rec.Ended() {
		for _, ev := range span.Events() {
			if ev.Name == "inbox.begin_retried" {
				retried++
			}
		}
	}
	if retried != 1 {
		t.Errorf("%d spans record a retried BEGIN, want 1 (the retry must be visible)", retried)
	}
	if n := len(e.nacks()); n != 0 {
		t.Errorf("%d nacks, want 0: the lost BEGIN was not retried%s", n, e.nackSummary())
	}
	e.checkExactlyOnce(ids(msgs))
}

// TestFaultMySQLBeginConnectionLostTwice loses the connections of a BEGIN
// and of its retry, both right after START TRANSACTION was sent, as a
// server going down can: the message is nacked with an error IsTransient
// accepts (a ping, which succeeds, tells it from a misconfiguration), and
// the redelivery processes it.
func TestFaultMySQLBeginConnectionLostTwice(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), faultTimeout)
	defer cancel()
	var left atomic.Int32 // BEGINs still to drop
	var armed atomic.Bool
	d, dropped := openDroppingMySQL(t, "START TRANSACTION", &armed, func() bool { return left.Add(-1) >= 0 })
	var e *faultEnv
	e = newFaultEnv(t, d, inbox.Config{}, func(msg *message.Message, tx *sqlx.Tx, attempt int) error {
		return e.ledgerRow(msg, tx, attempt, false)
	})
	left.Store(2)
	armed.Store(true)
	msgs := newMessages(1)
	e.stream(ctx, msgs, 1)

	if n := dropped.Load(); n != 2 {
		t.Errorf("%d connections dropped after START TRANSACTION, want 2", n)
	}
	err := e.wantFaultNacked(msgs[0], 1, "BEGIN lost twice")
	if !strings.Contains(errText(err), "inbox: begin transaction") {
		t.Errorf("got %s, want the BEGIN's error", describeErr(err))
	}
	e.checkExactlyOnce(ids(msgs))
}

// TestFaultStatementTimeout makes one handler statement of a few messages
// exceed a statement timeout on their first attempt: PostgreSQL with SET
// LOCAL statement_timeout (SQLSTATE 57014, query_canceled), MariaDB with SET
// STATEMENT max_statement_time (error 1969). Each is a nack; the redelivery
// processes the message once.
func TestFaultStatementTimeout(t *testing.T) {
	t.Parallel()
	for _, kind := range []string{"postgres", "postgres-partitioned", "mysql", "mysql-clientFoundRows", "sqlite"} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			if kind == "sqlite" {
				t.Skip("SQLite has no statement timeout (only busy_timeout, which the lock tests cover)")
			}
			d := openFaultDB(t, kind, "")
			ctx, cancel := context.WithTimeout(context.Background(), faultTimeout)
			defer cancel()
			msgs := newMessages(60)
			victims := map[string]bool{msgs[5].UUID: true, msgs[25].UUID: true, msgs[45].UUID: true}
			var e *faultEnv
			e = newFaultEnv(t, d, inbox.Config{}, func(msg *message.Message, tx *sqlx.Tx, attempt int) error {
				if err := e.ledgerRow(msg, tx, attempt, false); err != nil {
					return err
				}
				if attempt != 1 || !victims[msg.UUID] {
					return nil
				}
				// A statement that cannot finish within the timeout: it
				// sleeps 30 s, the timeout is 100 ms.
				var err error
				if d.postgres() {
					if _, err = tx.ExecContext(msg.Context(), "SET LOCAL statement_timeout = '100ms'"); err != nil {
						return err
					}
					_, err = tx.ExecContext(msg.Context(), "SELECT pg_sleep(30)")
				} else {
					_, err = tx.ExecContext(msg.Context(), "SET STATEMENT max_statement_time = 0.1 FOR SELECT SLEEP(30)")
				}
				if err == nil {
					return errors.New("the slow statement finished despite the timeout")
				}
				return fmt.Errorf("slow statement: %w", err)
			})
			e.stream(ctx, msgs, 4)
			for _, msg := range msgs {
				if !victims[msg.UUID] {
					continue
				}
				err := e.wantFaultNacked(msg, 1, "statement timeout")
				if d.postgres() && pgCode(err) != "57014" || !d.postgres() && mysqlNumber(err) != 1969 {
					t.Errorf("statement timeout: got %s, want SQLSTATE 57014 / MySQL 1969", describeErr(err))
				}
			}
			if n := len(e.nacks()); n != len(victims) {
				t.Errorf("%d nacks, want %d", n, len(victims))
			}
			e.checkExactlyOnce(ids(msgs))
		})
	}
}

// TestFaultSerializationFailure runs handlers that read-modify-write a
// counter per account (read the balance, write balance+1) at REPEATABLE
// READ and SERIALIZABLE (Config.TxOptions), four messages at a time on two
// accounts. The first two messages are forced to collide: both read the
// same account before either writes. What the loser gets:
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
// The claim itself: two deliveries of one message at once; the second
// waits on the first's key. On PostgreSQL at REPEATABLE READ or SERIALIZABLE
// it then fails with 40001 (the committed row is not in its snapshot): a
// nack, and the redelivery is skipped as a duplicate. MariaDB does not fail
// there at either level: the claim's ON DUPLICATE KEY UPDATE is a locking
// read of the latest row, so the second delivery is acked as a duplicate at
// once.
func TestFaultSerializationFailure(t *testing.T) {
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

// TestFaultMySQLDeadlock makes InnoDB report deadlocks (error 1213), with and
// without clientFoundRows:
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
func TestFaultMySQLDeadlock(t *testing.T) {
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

// TestFaultServerRestart restarts a database server while 200 messages
// flow, six at a time: PostgreSQL (pg_ctlcluster restart -m fast) and
// MariaDB (mysqladmin shutdown, then start). When 60 have committed, the
// next four handlers hold their open transactions until the restart has
// finished, so four messages are certainly in flight when the server goes
// down; the other two workers keep delivering into the outage (connection
// refused, the server shutting down or starting up). Every failed attempt
// must be a nack with a transient error, no message may be acked unless its
// transaction committed (or found it already committed), and all end
// processed exactly once.
//
// It restarts a real server, so it needs one of its own, and each variant
// runs only when its environment names one: INBOX_TEST_RESTART_PG_CLUSTER
// (VERSION/NAME, for pg_ctlcluster) and INBOX_TEST_RESTART_PG_DSN, which
// .ci/restart-cluster creates and starts; INBOX_TEST_RESTART_MYSQL_CMD (a
// command that restarts the server) and INBOX_TEST_RESTART_MYSQL_DSN, which
// .ci/restart-mariadb provides. Never point them at a shared server.
func TestFaultServerRestart(t *testing.T) {
	t.Run("postgres", func(t *testing.T) {
		cluster, dsn := os.Getenv(restartClusterEnv), os.Getenv(restartDSNEnv)
		if cluster == "" || dsn == "" {
			t.Skipf("restarts a PostgreSQL server: run .ci/restart-cluster, then set %s=15/inboxfaults and %s=postgres://postgres@127.0.0.1:5439/test?sslmode=disable",
				restartClusterEnv, restartDSNEnv)
		}
		version, name, ok := strings.Cut(cluster, "/")
		if !ok {
			t.Fatalf("%s=%q, want VERSION/NAME", restartClusterEnv, cluster)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		sfx := randomSuffix()
		d := &faultDB{dialect: inbox.PostgreSQL, app: "inbox_faults_" + sfx}
		d.ctl = openThrowaway(ctx, t, "pgx", testdb.WithParam(dsn, "application_name=inbox_faults_ctl_"+sfx), ".ci/restart-cluster starts it")
		d.pool = openThrowaway(ctx, t, "pgx", testdb.WithParam(dsn, "application_name="+d.app), ".ci/restart-cluster starts it")
		serverRestart(ctx, t, d, osexec.CommandContext(ctx, "pg_ctlcluster", "--skip-systemctl-redirect", version, name, "restart", "-m", "fast"))
	})
	t.Run("mysql", func(t *testing.T) {
		command, dsn := os.Getenv(restartMySQLCmdEnv), os.Getenv(restartMySQLDSNEnv)
		if command == "" || dsn == "" {
			t.Skipf(`restarts a MariaDB server: run .ci/restart-mariadb start, then set %s="'$PWD/.ci/restart-mariadb' restart" and %s="root@tcp(127.0.0.1:3309)/test?parseTime=true"`,
				restartMySQLCmdEnv, restartMySQLDSNEnv)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		d := &faultDB{dialect: inbox.MySQL, ports: &portsSeen{}}
		d.ctl = openThrowaway(ctx, t, "mysql", dsn, ".ci/restart-mariadb start starts it")
		refuseSharedMySQL(ctx, t, d.ctl)
		d.pool = openTrackedMySQL(t, dsn, "inbox_faults_restart_"+randomSuffix(), d.ports)
		serverRestart(ctx, t, d, osexec.CommandContext(ctx, "sh", "-c", command))
	})
}

// serverRestart is TestFaultServerRestart on d, whose server restart runs.
func serverRestart(ctx context.Context, t *testing.T, d *faultDB, restart *osexec.Cmd) {
	const inFlight = 4
	msgs := newMessages(200)
	var processed atomic.Int32
	var held atomic.Int32
	heldIDs := make(chan string, inFlight) // the messages whose transactions are open across the restart
	restarted := make(chan struct{})
	var e *faultEnv
	e = newFaultEnv(t, d, inbox.Config{OnProcessed: func(inbox.Event) { processed.Add(1) }},
		func(msg *message.Message, tx *sqlx.Tx, attempt int) error {
			if err := e.ledgerRow(msg, tx, attempt, false); err != nil {
				return err
			}
			if attempt == 1 && processed.Load() >= 60 && held.Load() < inFlight {
				if held.Add(1) <= inFlight {
					heldIDs <- msg.UUID
					return waitCh(ctx, restarted, "the restart") // then commit on a connection the restart closed
				}
			}
			return nil
		})

	restartErr := make(chan error, 1)
	go func() {
		defer close(restarted)
		if err := poll(ctx, time.Millisecond, func() (bool, error) { return len(heldIDs) == inFlight, nil }); err != nil {
			restartErr <- fmt.Errorf("waiting for %d messages in flight: %w", inFlight, err)
			return
		}
		out, err := restart.CombinedOutput()
		if err != nil {
			err = fmt.Errorf("%s: %v: %s", restart, err, out)
		}
		restartErr <- err
	}()

	e.stream(ctx, msgs, inFlight+2)
	if err := <-restartErr; err != nil {
		t.Fatal(err)
	}
	close(heldIDs)
	var inFlightIDs []string
	for id := range heldIDs {
		inFlightIDs = append(inFlightIDs, id)
	}

	perMessage := e.checkDeliveries()
	want := ids(msgs)
	e.checkRows(want)
	d.checkNoLeaks(t)

	// Never acked unless committed: a message with no committed delivery
	// must have been acked as a duplicate after a COMMIT whose outcome the
	// client never learned (the server committed, the connection died before
	// the reply). The in-flight ones had not sent COMMIT before the restart,
	// so their transactions were rolled back and a later delivery committed.
	inDoubt := 0
	for _, id := range want {
		switch perMessage[id] {
		case 1:
		case 0:
			inDoubt++
			ds := e.deliveries(id)
			sawCommitErr := false
			for _, d := range ds {
				if !d.acked && strings.Contains(errText(d.err), "inbox: commit") {
					sawCommitErr = true
				}
			}
			if !sawCommitErr || ds[len(ds)-1].outcome != "duplicate" {
				t.Errorf("message %s: no committed delivery, and not a commit in doubt: %+v", id, ds)
			}
		default:
			t.Errorf("message %s: %d committed deliveries", id, perMessage[id])
		}
	}
	if got := int(processed.Load()) + inDoubt; got != len(want) {
		t.Errorf("commits seen by OnProcessed %d + in doubt %d = %d, want %d business rows", processed.Load(), inDoubt, got, len(want))
	}
	for _, id := range inFlightIDs {
		ds := e.deliveries(id)
		if len(ds) < 2 || ds[0].acked || !strings.Contains(errText(ds[0].err), "inbox: commit") || perMessage[id] != 1 {
			t.Errorf("in-flight message %s: deliveries %+v; want the first nacked by its failed COMMIT, a later one committed", id, ds)
		}
	}
	t.Logf("%d messages, %d in flight at the restart, %d commits in doubt, %d nacks: %s",
		len(want), len(inFlightIDs), inDoubt, len(e.nacks()), e.nackSummary())
	if len(inFlightIDs) != inFlight {
		t.Errorf("%d messages in flight at the restart, want %d", len(inFlightIDs), inFlight)
	}
}

// refuseSharedMySQL fails the test if db is the shared MariaDB server of the
// other tests (same data directory), which the restart test must never
// restart. Without a reachable shared server there is nothing to protect.
func refuseSharedMySQL(ctx context.Context, t *testing.T, db *sqlx.DB) {
	t.Helper()
	shared, err := sqlx.Open("mysql", testdb.MySQLDSN())
	if err != nil {
		t.Fatal(err)
	}
	defer shared.Close()
	var theirs, mine string
	if err := shared.GetContext(ctx, &theirs, "SELECT @@datadir"); err != nil {
		return
	}
	if err := db.GetContext(ctx, &mine, "SELECT @@datadir"); err != nil {
		t.Fatal(err)
	}
	if mine == theirs {
		t.Fatalf("%s names the shared MariaDB server (datadir %s), which this test would restart: give it a throwaway one (.ci/restart-mariadb)", restartMySQLDSNEnv, mine)
	}
}

// openThrowaway opens a pool of at most 8 connections on the throwaway
// server at dsn (driver "pgx" or "mysql"), which must be reachable; hint
// says what starts it.
func openThrowaway(ctx context.Context, t *testing.T, driver, dsn, hint string) *sqlx.DB {
	t.Helper()
	db, err := sqlx.Open(driver, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	db.SetMaxOpenConns(8)
	if err := db.PingContext(ctx); err != nil {
		t.Fatalf("%s: %v (is the throwaway server running? %s)", dsn, err, hint)
	}
	return db
}
