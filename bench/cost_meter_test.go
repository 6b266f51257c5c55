package bench

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"encoding/binary"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/jmoiron/sqlx"
	"modernc.org/sqlite"

	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// This file holds BenchmarkClaimCost's meters: what counts the round trips
// and statements of a pool on its connections' bytes (PostgreSQL, MariaDB),
// or at the driver (SQLite), and the pools they are wired into.

// protocol is the wire protocol a meter reads.
type protocol int

const (
	protoPostgres protocol = iota
	protoMySQL
)

// meter counts what a pool's connections exchange with the server: round
// trips (turns from the client writing to the client reading, as wire
// counts them) and, by reading the protocol's message framing, statements
// and prepares.
//
//   - PostgreSQL: the server's messages. A statement is a CommandComplete
//     ('C'), one per SQL statement the server ran to completion, in the
//     simple and the extended protocol alike (BEGIN, COMMIT and ROLLBACK
//     included); a prepare is a ParseComplete ('1').
//   - MySQL/MariaDB: the client's command packets (sequence id 0). A
//     statement is a COM_QUERY or a COM_STMT_EXECUTE; a prepare is a
//     COM_STMT_PREPARE.
//
// Both count the connections' start-up and whatever the benchmark asks the
// server itself: take the difference over a span of messages.
type meter struct {
	proto                            protocol
	roundTrips, statements, prepares atomic.Int64
}

// dial wraps a dial function so that its connections are counted by m.
func (m *meter) dial(dial func(ctx context.Context, network, addr string) (net.Conn, error)) func(ctx context.Context, network, addr string) (net.Conn, error) {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return &meteredConn{Conn: c, m: m}, nil
	}
}

// meteredConn is one connection counted by its pool's meter. A connection
// is used by one goroutine at a time, so its framing state needs no lock.
type meteredConn struct {
	net.Conn
	m    *meter
	sent atomic.Bool // written since the last read

	// The message being read: its header so far, and how many bytes of
	// its body are left to skip.
	header  [5]byte
	have    int
	skip    int
	wantCmd bool // MySQL: the next byte is a command packet's command
}

func (c *meteredConn) Write(p []byte) (int, error) {
	c.sent.Store(true)
	if c.m.proto == protoMySQL {
		c.mysqlClient(p)
	}
	return c.Conn.Write(p)
}

func (c *meteredConn) Read(p []byte) (int, error) {
	if c.sent.Swap(false) {
		c.m.roundTrips.Add(1)
	}
	n, err := c.Conn.Read(p)
	if c.m.proto == protoPostgres {
		c.postgresServer(p[:n])
	}
	return n, err
}

// postgresServer follows the framing of the server's messages (a type
// byte, a length that counts itself, the body). Every message the server
// sends, start-up included, has a type byte (sslmode=disable: no SSL
// response byte comes first).
func (c *meteredConn) postgresServer(p []byte) {
	for len(p) > 0 {
		if c.skip > 0 {
			k := min(c.skip, len(p))
			c.skip -= k
			p = p[k:]
			continue
		}
		k := copy(c.header[c.have:5], p)
		c.have += k
		p = p[k:]
		if c.have < 5 {
			return
		}
		switch c.header[0] {
		case 'C':
			c.m.statements.Add(1)
		case '1':
			c.m.prepares.Add(1)
		}
		c.skip = int(binary.BigEndian.Uint32(c.header[1:5])) - 4
		c.have = 0
	}
}

// mysqlClient follows the framing of the client's packets (a 3-byte
// little-endian length, a sequence id, the payload); a command starts a
// new sequence (id 0) and its payload's first byte is the command.
func (c *meteredConn) mysqlClient(p []byte) {
	const comQuery, comStmtPrepare, comStmtExecute = 0x03, 0x16, 0x17
	for len(p) > 0 {
		if c.wantCmd {
			switch p[0] {
			case comQuery, comStmtExecute:
				c.m.statements.Add(1)
			case comStmtPrepare:
				c.m.prepares.Add(1)
			}
			c.wantCmd = false
			c.skip--
			p = p[1:]
			continue
		}
		if c.skip > 0 {
			k := min(c.skip, len(p))
			c.skip -= k
			p = p[k:]
			continue
		}
		k := copy(c.header[c.have:4], p)
		c.have += k
		p = p[k:]
		if c.have < 4 {
			return
		}
		c.skip = int(c.header[0]) | int(c.header[1])<<8 | int(c.header[2])<<16
		c.wantCmd = c.header[3] == 0 && c.skip > 0
		c.have = 0
	}
}

// openMeteredPostgres opens a database/sql pool of conns connections on the
// test PostgreSQL through pgx's stdlib driver, counted by a meter, with
// tracer (may be nil) on its connections. An unreachable server skips the
// benchmark, or fails it under CI=true.
func openMeteredPostgres(b *testing.B, tracer pgx.QueryTracer, conns int) (*sqlx.DB, *meter) {
	testdb.OpenPostgres(b, "") // skips or fails when unreachable
	cfg, err := pgx.ParseConfig(testdb.PostgresDSN())
	if err != nil {
		b.Fatal(err)
	}
	m := &meter{proto: protoPostgres}
	cfg.DialFunc = m.dial(cfg.DialFunc)
	cfg.Tracer = tracer
	db := sqlx.NewDb(stdlib.OpenDB(*cfg), "pgx")
	b.Cleanup(func() { db.Close() })
	db.SetMaxOpenConns(conns)
	db.SetMaxIdleConns(conns)
	if err := db.Ping(); err != nil {
		b.Fatal(err)
	}
	return db, m
}

// openMeteredPgxPool is openPgxPool with one connection counted by a
// meter.
func openMeteredPgxPool(b *testing.B) (pgxPool, *meter) {
	probe := testdb.OpenPgxPool(b, "") // skips or fails when unreachable
	cfg := probe.Config()
	probe.Close()
	m := &meter{proto: protoPostgres}
	cfg.ConnConfig.DialFunc = m.dial(cfg.ConnConfig.DialFunc)
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(pool.Close)
	if err := pool.Ping(context.Background()); err != nil {
		b.Fatal(err)
	}
	db := pgxinbox.DB(pool)
	b.Cleanup(func() { db.Close() })
	return pgxPool{pool: pool, db: db, wire: &wire{}}, m
}

// openMeteredMySQL opens a pool of one connection on the test MariaDB,
// counted by a meter.
func openMeteredMySQL(b *testing.B) (*sqlx.DB, *meter) {
	testdb.OpenMySQL(b, "") // skips or fails when unreachable
	cfg, err := mysql.ParseDSN(testdb.MySQLDSN())
	if err != nil {
		b.Fatal(err)
	}
	m := &meter{proto: protoMySQL}
	var d net.Dialer
	cfg.DialFunc = m.dial(d.DialContext)
	conn, err := mysql.NewConnector(cfg)
	if err != nil {
		b.Fatal(err)
	}
	db := sqlx.NewDb(sql.OpenDB(conn), "mysql")
	b.Cleanup(func() { db.Close() })
	db.SetMaxOpenConns(1)
	db.SetMaxIdleConns(1)
	if err := db.Ping(); err != nil {
		b.Fatal(err)
	}
	return db, m
}

// sqliteMeter counts what a SQLite pool runs, at the driver: statements
// (each Exec and Query, prepared or not, and each BEGIN, COMMIT and
// ROLLBACK: what database/sql hands the driver to run), prepares, and the
// rows written per table, from SQLite's pre-update hook (one call per row
// inserted, updated or deleted, rolled back or not).
type sqliteMeter struct {
	statements, prepares atomic.Int64
	mu                   sync.Mutex
	rows                 map[string]int64 // by table
}

// rowsOf returns the rows written to each of tables so far.
func (m *sqliteMeter) rowsOf(tables []string) map[string]int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make(map[string]int64, len(tables))
	for _, t := range tables {
		out[t] = m.rows[t]
	}
	return out
}

// openMeteredSQLite opens the SQLite file at path with testdb.SQLiteParams
// and automatic checkpoints off (so that its WAL file only grows, and its
// growth is what the commits wrote), as a pool of one connection counted
// by a sqliteMeter.
func openMeteredSQLite(b *testing.B, path string) (*sqlx.DB, *sqliteMeter) {
	base, err := sqlite.NewConnector("file:" + path + "?" + testdb.SQLiteParams + "&_pragma=wal_autocheckpoint(0)")
	if err != nil {
		b.Fatal(err)
	}
	m := &sqliteMeter{rows: map[string]int64{}}
	db := sqlx.NewDb(sql.OpenDB(sqliteConnector{base, m}), "sqlite")
	b.Cleanup(func() { db.Close() })
	db.SetMaxOpenConns(1)
	db.SetMaxIdleConns(1)
	if err := db.Ping(); err != nil {
		b.Fatal(err)
	}
	return db, m
}

// sqliteConnector opens modernc.org/sqlite connections counted by m.
type sqliteConnector struct {
	driver.Connector
	m *sqliteMeter
}

func (c sqliteConnector) Connect(ctx context.Context) (driver.Conn, error) {
	conn, err := c.Connector.Connect(ctx)
	if err != nil {
		return nil, err
	}
	if hr, ok := conn.(sqlite.HookRegisterer); ok {
		hr.RegisterPreUpdateHook(func(d sqlite.SQLitePreUpdateData) {
			c.m.mu.Lock()
			c.m.rows[d.TableName]++
			c.m.mu.Unlock()
		})
	}
	return &sqliteConn{conn: conn, m: c.m}, nil
}

// sqliteConn forwards every interface modernc.org/sqlite's connections
// implement (its NewConnector documents them), counting statements.
type sqliteConn struct {
	conn driver.Conn
	m    *sqliteMeter
}

var (
	_ driver.ConnBeginTx        = (*sqliteConn)(nil)
	_ driver.ConnPrepareContext = (*sqliteConn)(nil)
	_ driver.ExecerContext      = (*sqliteConn)(nil)
	_ driver.QueryerContext     = (*sqliteConn)(nil)
	_ driver.Pinger             = (*sqliteConn)(nil)
	_ driver.SessionResetter    = (*sqliteConn)(nil)
	_ driver.Validator          = (*sqliteConn)(nil)
)

func (c *sqliteConn) Unwrap() driver.Conn { return c.conn }

func (c *sqliteConn) Prepare(query string) (driver.Stmt, error) {
	return c.PrepareContext(context.Background(), query)
}

func (c *sqliteConn) PrepareContext(ctx context.Context, query string) (driver.Stmt, error) {
	s, err := c.conn.(driver.ConnPrepareContext).PrepareContext(ctx, query)
	if err != nil {
		return nil, err
	}
	c.m.prepares.Add(1)
	return &sqliteStmt{stmt: s, m: c.m}, nil
}

func (c *sqliteConn) Close() error { return c.conn.Close() }

func (c *sqliteConn) Begin() (driver.Tx, error) {
	return c.BeginTx(context.Background(), driver.TxOptions{})
}

func (c *sqliteConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	c.m.statements.Add(1)
	tx, err := c.conn.(driver.ConnBeginTx).BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	return sqliteTx{tx, c.m}, nil
}

func (c *sqliteConn) ExecContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Result, error) {
	c.m.statements.Add(1)
	return c.conn.(driver.ExecerContext).ExecContext(ctx, query, args)
}

func (c *sqliteConn) QueryContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Rows, error) {
	c.m.statements.Add(1)
	return c.conn.(driver.QueryerContext).QueryContext(ctx, query, args)
}

func (c *sqliteConn) Ping(ctx context.Context) error { return c.conn.(driver.Pinger).Ping(ctx) }

func (c *sqliteConn) ResetSession(ctx context.Context) error {
	return c.conn.(driver.SessionResetter).ResetSession(ctx)
}

func (c *sqliteConn) IsValid() bool { return c.conn.(driver.Validator).IsValid() }

// sqliteTx counts COMMIT and ROLLBACK.
type sqliteTx struct {
	tx driver.Tx
	m  *sqliteMeter
}

func (t sqliteTx) Commit() error   { t.m.statements.Add(1); return t.tx.Commit() }
func (t sqliteTx) Rollback() error { t.m.statements.Add(1); return t.tx.Rollback() }

// sqliteStmt counts the executions of a prepared statement.
type sqliteStmt struct {
	stmt driver.Stmt
	m    *sqliteMeter
}

var (
	_ driver.StmtExecContext  = (*sqliteStmt)(nil)
	_ driver.StmtQueryContext = (*sqliteStmt)(nil)
)

func (s *sqliteStmt) Close() error  { return s.stmt.Close() }
func (s *sqliteStmt) NumInput() int { return s.stmt.NumInput() }

// Exec and Query complete driver.Stmt; database/sql calls ExecContext and
// QueryContext, which the modernc driver implements, so they are never used.
func (s *sqliteStmt) Exec([]driver.Value) (driver.Result, error) {
	return nil, errors.New("bench: sqliteStmt.Exec: database/sql calls ExecContext")
}

func (s *sqliteStmt) Query([]driver.Value) (driver.Rows, error) {
	return nil, errors.New("bench: sqliteStmt.Query: database/sql calls QueryContext")
}

func (s *sqliteStmt) ExecContext(ctx context.Context, args []driver.NamedValue) (driver.Result, error) {
	s.m.statements.Add(1)
	return s.stmt.(driver.StmtExecContext).ExecContext(ctx, args)
}

func (s *sqliteStmt) QueryContext(ctx context.Context, args []driver.NamedValue) (driver.Rows, error) {
	s.m.statements.Add(1)
	return s.stmt.(driver.StmtQueryContext).QueryContext(ctx, args)
}
