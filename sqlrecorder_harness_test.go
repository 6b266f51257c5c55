package inbox_test

// A pool on a real driver that reports what it runs.

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"fmt"
	"io"
	"sync"
	"testing"

	"github.com/jmoiron/sqlx"
)

// sqlObserver sees what goes through a recording pool (openRecording): every
// statement text before it runs, the rows every successful Exec affected
// (for a query, the integer its first row starts with, if it does: the
// count that PostgreSQL's purge batch returns), every failed Exec, query or
// COMMIT (query "COMMIT"), and where transactions begin and end. conn identifies the connection; one connection is used by one
// goroutine at a time.
type sqlObserver interface {
	statement(conn any, query string)
	executed(conn any, query string, rowsAffected int64)
	failed(conn any, query string, err error)
	began(conn any)
	ended(conn any, committed bool)
}

// openRecording opens a pool on the real driver drv (the real database, not
// a mock) through a connector that reports to obs what the pool runs. It is
// closed when t ends.
func openRecording(t testing.TB, drv driver.Driver, dsn, driverName string, obs sqlObserver) *sqlx.DB {
	t.Helper()
	db := sqlx.NewDb(sql.OpenDB(recordingConnector{drv: drv, dsn: dsn, obs: obs}), driverName)
	t.Cleanup(func() { db.Close() })
	return db
}

type recordingConnector struct {
	drv driver.Driver
	dsn string
	obs sqlObserver
}

func (c recordingConnector) Connect(context.Context) (driver.Conn, error) {
	conn, err := c.drv.Open(c.dsn)
	if err != nil {
		return nil, err
	}
	return &recConn{Conn: conn, obs: c.obs}, nil
}

func (c recordingConnector) Driver() driver.Driver { return c.drv }

type recConn struct {
	driver.Conn
	obs sqlObserver
}

func (c *recConn) Prepare(query string) (driver.Stmt, error) {
	return c.PrepareContext(context.Background(), query)
}

func (c *recConn) PrepareContext(ctx context.Context, query string) (driver.Stmt, error) {
	c.obs.statement(c, query)
	var s driver.Stmt
	var err error
	if p, ok := c.Conn.(driver.ConnPrepareContext); ok {
		s, err = p.PrepareContext(ctx, query)
	} else {
		s, err = c.Conn.Prepare(query)
	}
	if err != nil {
		return nil, err
	}
	return &recStmt{Stmt: s, conn: c, query: query}, nil
}

// Begin is there for driver.Conn; database/sql calls BeginTx.
func (c *recConn) Begin() (driver.Tx, error) {
	return c.BeginTx(context.Background(), driver.TxOptions{})
}

// BeginTx needs the wrapped driver's BeginTx, as every driver these tests
// record has (pgx, go-sql-driver/mysql, modernc sqlite).
func (c *recConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	b, ok := c.Conn.(driver.ConnBeginTx)
	if !ok {
		return nil, fmt.Errorf("recording pool: %T does not implement driver.ConnBeginTx", c.Conn)
	}
	tx, err := b.BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	c.obs.began(c)
	return recTx{Tx: tx, conn: c}, nil
}

func (c *recConn) ExecContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Result, error) {
	e, ok := c.Conn.(driver.ExecerContext)
	if !ok {
		return nil, driver.ErrSkip
	}
	res, err := e.ExecContext(ctx, query, args)
	if err == driver.ErrSkip { //nolint:errorlint // the driver returns it as is
		return nil, err // database/sql prepares the statement instead: seen there
	}
	c.obs.statement(c, query)
	return c.observeResult(query, res, err)
}

func (c *recConn) observeResult(query string, res driver.Result, err error) (driver.Result, error) {
	if err != nil {
		c.obs.failed(c, query, err)
		return res, err
	}
	n, nerr := res.RowsAffected()
	if nerr == nil {
		c.obs.executed(c, query, n)
	}
	return res, nil
}

func (c *recConn) QueryContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Rows, error) {
	q, ok := c.Conn.(driver.QueryerContext)
	if !ok {
		return nil, driver.ErrSkip
	}
	rows, err := q.QueryContext(ctx, query, args)
	if err == driver.ErrSkip { //nolint:errorlint // the driver returns it as is
		return nil, err
	}
	c.obs.statement(c, query)
	if err != nil {
		c.obs.failed(c, query, err)
		return rows, err
	}
	return &recRows{Rows: rows, conn: c, query: query}, nil
}

// recRows reports a query's first row's leading integer as executed, and an
// error of reading its rows as failed.
type recRows struct {
	driver.Rows
	conn  *recConn
	query string
	read  bool
}

func (r *recRows) Next(dest []driver.Value) error {
	err := r.Rows.Next(dest)
	switch {
	case err == nil && !r.read:
		r.read = true
		if len(dest) > 0 {
			if n, ok := dest[0].(int64); ok {
				r.conn.obs.executed(r.conn, r.query, n)
			}
		}
	case err != nil && err != io.EOF: //nolint:errorlint // io.EOF is returned as is (driver.Rows)
		r.conn.obs.failed(r.conn, r.query, err)
	}
	return err
}

func (c *recConn) CheckNamedValue(nv *driver.NamedValue) error {
	if ch, ok := c.Conn.(driver.NamedValueChecker); ok {
		return ch.CheckNamedValue(nv)
	}
	return driver.ErrSkip
}

func (c *recConn) ResetSession(ctx context.Context) error {
	if r, ok := c.Conn.(driver.SessionResetter); ok {
		return r.ResetSession(ctx)
	}
	return nil
}

func (c *recConn) IsValid() bool {
	if v, ok := c.Conn.(driver.Validator); ok {
		return v.IsValid()
	}
	return true
}

func (c *recConn) Ping(ctx context.Context) error {
	if p, ok := c.Conn.(driver.Pinger); ok {
		return p.Ping(ctx)
	}
	return nil
}

type recTx struct {
	driver.Tx
	conn *recConn
}

func (t recTx) Commit() error {
	err := t.Tx.Commit()
	if err != nil {
		t.conn.obs.failed(t.conn, "COMMIT", err)
	}
	t.conn.obs.ended(t.conn, err == nil)
	return err
}

func (t recTx) Rollback() error {
	err := t.Tx.Rollback()
	t.conn.obs.ended(t.conn, false)
	return err
}

type recStmt struct {
	driver.Stmt
	conn  *recConn
	query string
}

// ExecContext needs the wrapped statement's ExecContext, as every driver
// these tests record has.
func (s *recStmt) ExecContext(ctx context.Context, args []driver.NamedValue) (driver.Result, error) {
	e, ok := s.Stmt.(driver.StmtExecContext)
	if !ok {
		return nil, fmt.Errorf("recording pool: %T does not implement driver.StmtExecContext", s.Stmt)
	}
	res, err := e.ExecContext(ctx, args)
	return s.conn.observeResult(s.query, res, err)
}

// QueryContext needs the wrapped statement's QueryContext, as every driver
// these tests record has.
func (s *recStmt) QueryContext(ctx context.Context, args []driver.NamedValue) (driver.Rows, error) {
	q, ok := s.Stmt.(driver.StmtQueryContext)
	if !ok {
		return nil, fmt.Errorf("recording pool: %T does not implement driver.StmtQueryContext", s.Stmt)
	}
	return q.QueryContext(ctx, args)
}

// statementLog is an sqlObserver that keeps every statement text a pool
// runs, in order.
type statementLog struct {
	mu  sync.Mutex
	all []string
}

// take returns, and forgets, the statements run so far.
func (l *statementLog) take() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	all := l.all
	l.all = nil
	return all
}

func (l *statementLog) statement(_ any, query string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.all = append(l.all, query)
}

func (l *statementLog) executed(any, string, int64) {}
func (l *statementLog) failed(any, string, error)   {}
func (l *statementLog) began(any)                   {}
func (l *statementLog) ended(any, bool)             {}

var _ sqlObserver = (*statementLog)(nil)
