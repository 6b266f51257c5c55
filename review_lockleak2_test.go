package inbox_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

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

func TestReviewPurgerLockLeaksOnUnluckyCancel(t *testing.T) {
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

// lockFree reports whether another instance could take the purge lock of
// table now (taking and releasing it on a probe connection).
// eventuallyLockFree polls lockFree for up to 10 s.
func eventuallyLockFree(t *testing.T, probe *sqlx.DB, d inbox.Dialect, table string) bool {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if lockFree(t, probe, d, table) {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func lockFree(t *testing.T, probe *sqlx.DB, d inbox.Dialect, table string) bool {
	t.Helper()
	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: probe, Dialect: d, Table: table, OlderThan: time.Hour}})
	if err != nil {
		t.Fatal(err)
	}
	release, got, err := inbox.PurgeLock(context.Background(), probe, p)
	if err != nil {
		t.Fatal(err)
	}
	if got {
		if err := release(); err != nil {
			t.Fatal(err)
		}
	}
	return got
}
