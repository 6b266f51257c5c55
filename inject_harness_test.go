package inbox_test

// Fault injectors: connections dropped after a given statement, a COMMIT
// that fails, a handler statement that loses a deadlock, and a connector
// that runs a function right after the purge lock query.

import (
	"bytes"
	"context"
	"database/sql/driver"
	"fmt"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// dropMarker, in a query, arms the dropAfterConn it is sent on.
const dropMarker = "inbox-fault: drop the connection after the next statement"

// dropAfterConn is a MySQL client connection that, once armed, passes the
// next COM_QUERY whose text is stmt to the server and closes the socket
// right after it, before the server's reply can be read: the server runs
// the statement (it reads it before it sees the connection close), and the
// client cannot know that it did. armed is the connection's own flag, set
// by a query that contains dropMarker, or one shared by every connection
// of a pool (then the first of them to send stmt drops).
//
// It sees go-sql-driver's packets as they are written, one Write per packet:
// openWrappedMySQL refuses a DSN with TLS or compression, under which it
// would see ciphertext or compressed frames.
type dropAfterConn struct {
	net.Conn
	stmt    []byte // 0x03 (COM_QUERY) and the statement's text, as go-sql-driver sends it after the 4-byte header
	armed   *atomic.Bool
	dropped *atomic.Int32
	take    func() bool // nil, or whether this drop may happen (a budget shared by the pool's connections)
}

// newDropAfterConn wraps c. armed nil gives the connection its own flag;
// take, if not nil, is asked before each drop (and a drop it refuses
// disarms nothing).
func newDropAfterConn(c net.Conn, stmt string, armed *atomic.Bool, dropped *atomic.Int32, take func() bool) *dropAfterConn {
	if armed == nil {
		armed = new(atomic.Bool)
	}
	return &dropAfterConn{Conn: c, stmt: append([]byte{0x03}, stmt...), armed: armed, dropped: dropped, take: take}
}

func (c *dropAfterConn) Write(p []byte) (int, error) {
	if bytes.Contains(p, []byte(dropMarker)) {
		c.armed.Store(true)
	}
	n, err := c.Conn.Write(p)
	if err != nil || len(p) != 4+len(c.stmt) || !bytes.Equal(p[4:], c.stmt) || !c.armed.Load() {
		return n, err
	}
	if c.take != nil {
		if !c.take() {
			return n, err
		}
	} else if !c.armed.CompareAndSwap(true, false) {
		return n, err
	}
	c.dropped.Add(1)
	c.Conn.Close()
	return n, err
}

// openDroppingMySQL opens a faultDB on MySQL whose pool's connections are
// dropAfterConn on stmt (armed and take as in newDropAfterConn); dropped
// counts the connections dropped.
func openDroppingMySQL(t *testing.T, stmt string, armed *atomic.Bool, take func() bool) (d *faultDB, dropped *atomic.Int32) {
	t.Helper()
	d = &faultDB{dialect: inbox.MySQL, ports: &portsSeen{}}
	d.ctl = testdb.OpenMySQL(t, "")
	dropped = new(atomic.Int32)
	d.pool = openWrappedMySQL(t, testdb.MySQLDSN(), "inbox_faults_"+randomSuffix(), d.ports, func(c net.Conn) net.Conn {
		return newDropAfterConn(c, stmt, armed, dropped, take)
	})
	return d, dropped
}

// commitBreaker returns a function that the handler calls last, through its
// transaction, so that the COMMIT that follows fails: PostgreSQL and MySQL
// lose the connection (the session is terminated from another connection,
// as a failover or an operator would), SQLite fails a deferred foreign key.
// TestCommitFailureNacks covers PostgreSQL's other failure, COMMIT turned
// into ROLLBACK after a failed statement.
func commitBreaker(t *testing.T, d inbox.Dialect, db *sqlx.DB) func(msg *message.Message, tx *sqlx.Tx) error {
	switch {
	case isPostgres(d):
		return func(msg *message.Message, tx *sqlx.Tx) error {
			var pid int
			if err := tx.GetContext(msg.Context(), &pid, "SELECT pg_backend_pid()"); err != nil {
				return err
			}
			var done bool // waits up to 5 s for the session to end
			return db.GetContext(msg.Context(), &done, "SELECT pg_terminate_backend($1, 5000)", pid)
		}
	case d == inbox.MySQL:
		return func(msg *message.Message, tx *sqlx.Tx) error {
			var id int64
			if err := tx.GetContext(msg.Context(), &id, "SELECT CONNECTION_ID()"); err != nil {
				return err
			}
			_, err := db.ExecContext(msg.Context(), fmt.Sprintf("KILL %d", id))
			return err
		}
	default:
		parent, child := "parent_"+randomSuffix(), "child_"+randomSuffix()
		exec(t, db, "CREATE TABLE "+parent+" (id INTEGER PRIMARY KEY)")
		exec(t, db, "CREATE TABLE "+child+" (parent_id INTEGER REFERENCES "+parent+"(id) DEFERRABLE INITIALLY DEFERRED)")
		dropLater(t, db, child)
		dropLater(t, db, parent)
		return func(msg *message.Message, tx *sqlx.Tx) error {
			_, err := tx.ExecContext(msg.Context(), "INSERT INTO "+child+" (parent_id) VALUES (42)")
			return err
		}
	}
}

// deadlockVictim returns a function that the handler calls with its
// transaction: it makes the handler's next statement the victim of a real
// deadlock with another connection, and returns that statement's error.
// MySQL/MariaDB pick the lighter transaction as the victim, so the other
// one first writes 50 rows; PostgreSQL aborts the transaction whose
// deadlock_timeout runs out first, so the handler's is 100 ms and the other
// one's 10 s (both superuser settings, for this test only).
func deadlockVictim(t *testing.T, d inbox.Dialect, db *sqlx.DB) func(msg *message.Message, tx *sqlx.Tx) error {
	locks, weight := "locks_"+randomSuffix(), "weight_"+randomSuffix()
	exec(t, db, "CREATE TABLE "+locks+" (id INT NOT NULL PRIMARY KEY, v INT NOT NULL)")
	exec(t, db, "CREATE TABLE "+weight+" (id INT NOT NULL PRIMARY KEY)")
	dropLater(t, db, locks)
	dropLater(t, db, weight)
	exec(t, db, "INSERT INTO "+locks+" (id, v) VALUES (1, 0), (2, 0)")
	lock := func(id int) string { return fmt.Sprintf("UPDATE %s SET v = v + 1 WHERE id = %d", locks, id) }
	return func(msg *message.Message, tx *sqlx.Tx) error {
		ctx := msg.Context()
		other, err := db.BeginTxx(ctx, nil)
		if err != nil {
			return err
		}
		defer other.Rollback()
		if isPostgres(d) {
			if _, err := tx.ExecContext(ctx, "SET LOCAL deadlock_timeout = '100ms'"); err != nil {
				return err
			}
			if _, err := other.ExecContext(ctx, "SET LOCAL deadlock_timeout = '10s'"); err != nil {
				return err
			}
		}
		rows := make([]string, 50)
		for i := range rows {
			rows[i] = fmt.Sprintf("(%d)", i)
		}
		if _, err := other.ExecContext(ctx, "INSERT INTO "+weight+" (id) VALUES "+strings.Join(rows, ", ")); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, lock(1)); err != nil {
			return err
		}
		if _, err := other.ExecContext(ctx, lock(2)); err != nil {
			return err
		}
		otherDone := make(chan error, 1)
		go func() {
			_, err := other.ExecContext(ctx, lock(1))
			otherDone <- err
		}()
		_, err = tx.ExecContext(ctx, lock(2))
		if otherErr := <-otherDone; otherErr != nil {
			return fmt.Errorf("the other transaction failed instead: %w", otherErr)
		}
		return err
	}
}

// afterLock, when set, runs right after the server answered the purge lock
// query: the moment a context ending "now" hits. It models a cancellation
// that arrives after the server granted the lock but before the client read
// the row, which real timing produces (a router closing, a deadline).
var afterLock atomic.Pointer[func()]

type hookConnector struct {
	drv driver.Driver
	dsn string
}

func (c hookConnector) Connect(context.Context) (driver.Conn, error) {
	conn, err := c.drv.Open(c.dsn)
	if err != nil {
		return nil, err
	}
	return hookConn{conn}, nil
}

func (c hookConnector) Driver() driver.Driver { return c.drv }

type hookConn struct{ driver.Conn }

func (c hookConn) QueryContext(ctx context.Context, q string, args []driver.NamedValue) (driver.Rows, error) {
	rows, err := c.Conn.(driver.QueryerContext).QueryContext(ctx, q, args)
	if f := afterLock.Load(); f != nil && (strings.Contains(q, "pg_try_advisory_xact_lock") || strings.Contains(q, "GET_LOCK")) {
		(*f)()
		if err == nil {
			return slowRows{rows}, nil
		}
	}
	return rows, err
}

// slowRows delays reading the row, so that database/sql's watcher sees the
// ended context while the row is in flight, as a real slow network would.
type slowRows struct{ driver.Rows }

func (r slowRows) Next(dest []driver.Value) error {
	time.Sleep(20 * time.Millisecond)
	return r.Rows.Next(dest)
}

func (c hookConn) ExecContext(ctx context.Context, q string, args []driver.NamedValue) (driver.Result, error) {
	return c.Conn.(driver.ExecerContext).ExecContext(ctx, q, args)
}

func (c hookConn) BeginTx(ctx context.Context, o driver.TxOptions) (driver.Tx, error) {
	return c.Conn.(driver.ConnBeginTx).BeginTx(ctx, o)
}

func (c hookConn) ResetSession(ctx context.Context) error {
	if r, ok := c.Conn.(driver.SessionResetter); ok {
		return r.ResetSession(ctx)
	}
	return nil
}

func (c hookConn) IsValid() bool {
	if v, ok := c.Conn.(driver.Validator); ok {
		return v.IsValid()
	}
	return true
}
