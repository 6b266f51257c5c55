package inbox_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"sync"
	"testing"

	"github.com/XSAM/otelsql"
	"github.com/jackc/pgx/v5/stdlib"
)

// otelsqlDrivers registers, once, pgx's and go-sql-driver/mysql's drivers
// wrapped by XSAM/otelsql, the instrumentation services add to trace their
// SQL, and returns their names.
var otelsqlDrivers = sync.OnceValues(func() ([2]string, error) {
	var names [2]string
	for i, name := range []string{"pgx", "mysql"} {
		wrapped, err := otelsql.Register(name)
		if err != nil {
			return names, err
		}
		names[i] = wrapped
	}
	return names, nil
})

// otelsqlPgx returns the name of pgx's driver wrapped by otelsql.
func otelsqlPgx(tb testing.TB) string { return otelsqlDriver(tb, 0) }

// otelsqlMySQL returns the name of go-sql-driver/mysql's driver wrapped by
// otelsql.
func otelsqlMySQL(tb testing.TB) string { return otelsqlDriver(tb, 1) }

func otelsqlDriver(tb testing.TB, i int) string {
	tb.Helper()
	names, err := otelsqlDrivers()
	if err != nil {
		tb.Fatal(err)
	}
	return names[i]
}

// hiddenConnPgx registers, once, pgx's driver wrapped as ngrok/sqlmw and
// luna-duclos/instrumentedsql wrap drivers (the wrapped connection in an
// unexported field), and returns its name.
var hiddenConnPgx = sync.OnceValue(func() string {
	sql.Register("pgx-hidden-conn", hiddenConnDriver{stdlib.GetDefaultDriver()})
	return "pgx-hidden-conn"
})

// hiddenConnDriver opens hiddenConns.
type hiddenConnDriver struct{ parent driver.Driver }

func (d hiddenConnDriver) Open(name string) (driver.Conn, error) {
	c, err := d.parent.Open(name)
	if err != nil {
		return nil, err
	}
	return &hiddenConn{parent: c}, nil
}

// hiddenConn passes everything to its parent, which nothing outside can
// reach.
type hiddenConn struct{ parent driver.Conn }

func (c *hiddenConn) Prepare(query string) (driver.Stmt, error) { return c.parent.Prepare(query) }
func (c *hiddenConn) Close() error                              { return c.parent.Close() }

//lint:ignore SA1019 driver.Conn requires Begin
func (c *hiddenConn) Begin() (driver.Tx, error) { return c.parent.Begin() }

func (c *hiddenConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	return c.parent.(driver.ConnBeginTx).BeginTx(ctx, opts)
}

func (c *hiddenConn) PrepareContext(ctx context.Context, query string) (driver.Stmt, error) {
	return c.parent.(driver.ConnPrepareContext).PrepareContext(ctx, query)
}

func (c *hiddenConn) ExecContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Result, error) {
	return c.parent.(driver.ExecerContext).ExecContext(ctx, query, args)
}

func (c *hiddenConn) QueryContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Rows, error) {
	return c.parent.(driver.QueryerContext).QueryContext(ctx, query, args)
}

func (c *hiddenConn) ResetSession(ctx context.Context) error {
	return c.parent.(driver.SessionResetter).ResetSession(ctx)
}

func (c *hiddenConn) Ping(ctx context.Context) error { return c.parent.(driver.Pinger).Ping(ctx) }
