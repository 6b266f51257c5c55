package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	osexec "os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jmoiron/sqlx"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A message's connection is lost (its session killed, its socket closed
// after BEGIN or COMMIT was sent, its server restarted): the delivery is a
// transient nack, never an ack of what did not commit, and every message
// ends processed exactly once.

// TestLostConnection_KilledSessionIsNackedAndRedelivered kills the server
// session of a message's transaction from another connection (PostgreSQL:
// pg_terminate_backend; MySQL/MariaDB: KILL CONNECTION), each way after the
// handler wrote its row:
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
// connection" with the failed ROLLBACK, or driver.ErrBadConn), never an ack;
// the server rolls the transaction back; database/sql drops the dead
// connection (no other delivery of the stream fails), and the redelivery
// processes the message once.
func TestLostConnection_KilledSessionIsNackedAndRedelivered(t *testing.T) {
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

// TestLostConnection_MySQLCommitInDoubtIsNackedThenSkipped loses the
// connection of a few messages' transactions right after their COMMIT was
// sent (dropAfterConn): the server commits, and go-sql-driver reports only
// "invalid connection", an error with no MySQL error number. The middleware
// must nack it (never ack what it cannot know committed) with an error
// IsTransient accepts, and the redelivery must find the message processed and
// skip it as a duplicate. Every message ends with exactly one business row.
func TestLostConnection_MySQLCommitInDoubtIsNackedThenSkipped(t *testing.T) {
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

// TestLostConnection_MySQLBeginIsRetriedOnce loses the connection of the
// stream's first BEGIN right after START TRANSACTION was sent
// (dropAfterConn): go-sql-driver reports a plain "invalid connection", which
// database/sql does not retry. The middleware retries such a BEGIN once, on
// another connection, so every message is processed at its first delivery: no
// nack, one business row each.
func TestLostConnection_MySQLBeginIsRetriedOnce(t *testing.T) {
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

// TestLostConnection_MySQLBeginLostTwiceIsATransientNack loses the
// connections of a BEGIN and of its retry, both right after START TRANSACTION
// was sent, as a server going down can: the message is nacked with an error
// IsTransient accepts (a ping, which succeeds, tells it from a
// misconfiguration), and the redelivery processes it.
func TestLostConnection_MySQLBeginLostTwiceIsATransientNack(t *testing.T) {
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

// Environment of the opt-in server restart test.
const (
	restartClusterEnv = "INBOX_TEST_RESTART_PG_CLUSTER" // "15/inboxfaults": VERSION/NAME for pg_ctlcluster
	restartDSNEnv     = "INBOX_TEST_RESTART_PG_DSN"     // a DSN of that cluster

	restartMySQLCmdEnv = "INBOX_TEST_RESTART_MYSQL_CMD" // a command that restarts a throwaway MariaDB server
	restartMySQLDSNEnv = "INBOX_TEST_RESTART_MYSQL_DSN" // a DSN of that server
)

// TestLostConnection_ServerRestartLosesNoMessage restarts a database server
// while 200 messages flow, six at a time: PostgreSQL (pg_ctlcluster restart
// -m fast) and MariaDB (mysqladmin shutdown, then start). When 60 have
// committed, the next four handlers hold their open transactions until the
// restart has finished, so four messages are certainly in flight when the
// server goes down; the other two workers keep delivering into the outage
// (connection refused, the server shutting down or starting up). Every failed
// attempt must be a nack with a transient error, no message may be acked
// unless its transaction committed (or found it already committed), and all
// end processed exactly once.
//
// It restarts a real server, so it needs one of its own, and each variant
// runs only when its environment names one: INBOX_TEST_RESTART_PG_CLUSTER
// (VERSION/NAME, for pg_ctlcluster) and INBOX_TEST_RESTART_PG_DSN, which
// .ci/restart-cluster creates and starts; INBOX_TEST_RESTART_MYSQL_CMD (a
// command that restarts the server) and INBOX_TEST_RESTART_MYSQL_DSN, which
// .ci/restart-mariadb provides. Never point them at a shared server.
func TestLostConnection_ServerRestartLosesNoMessage(t *testing.T) {
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

// serverRestart is TestLostConnection_ServerRestartLosesNoMessage on d, whose server restart runs.
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
