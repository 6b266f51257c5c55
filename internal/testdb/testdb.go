// Package testdb opens the databases that the inbox's tests and benchmarks
// run against. SQLite always works (a file in a temporary folder);
// PostgreSQL and MySQL/MariaDB are found through INBOX_TEST_POSTGRES_DSN and
// INBOX_TEST_MYSQL_DSN, defaulting to the local servers. A server that cannot
// be reached skips the test locally and fails it when CI=true; a server that
// is reached but refuses the connection always fails it.
package testdb

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	_ "github.com/go-sql-driver/mysql" // registers "mysql"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib" // registers "pgx"
	"github.com/jmoiron/sqlx"
	_ "github.com/lib/pq"  // registers "postgres"
	_ "modernc.org/sqlite" // registers "sqlite"

	"github.com/watermill-inbox/inbox"
)

// Environment variables and their defaults.
const (
	PostgresDSNEnv     = "INBOX_TEST_POSTGRES_DSN"
	PgBouncerDSNEnv    = "INBOX_TEST_PGBOUNCER_DSN"
	MySQLDSNEnv        = "INBOX_TEST_MYSQL_DSN"
	DefaultPostgresDSN = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	DefaultMySQLDSN    = "root@tcp(127.0.0.1:3306)/test?parseTime=true"
	// DefaultPgBouncerDSN is the PgBouncer that .ci/pgbouncer starts: transaction
	// pooling mode, 4 server connections, in front of the PostgreSQL above.
	DefaultPgBouncerDSN = "postgres://postgres@127.0.0.1:6439/test?sslmode=disable"

	// SQLiteParams are the DSN settings the README recommends for SQLite.
	SQLiteParams = "_journal_mode=WAL&_busy_timeout=10000&_synchronous=NORMAL&_txlock=immediate&_foreign_keys=1"

	startPostgres  = "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start"
	startMariaDB   = "start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd"
	startPgBouncer = ".ci/pgbouncer start /var/tmp/inbox-pgbouncer 6439"
)

// DB is one database kind the tests run against.
type DB struct {
	Name    string // sqlite, postgres, mysql, mysql-clientFoundRows
	Dialect inbox.Dialect
	// Open returns a new pool of at most 8 connections, closed when tb ends.
	Open func(tb testing.TB) *sqlx.DB
}

// All is every database kind: PostgreSQL twice (plain, and with the
// partitioned dialect, which Config.Dialect must name), MySQL twice (with
// and without clientFoundRows=true, which changes what rows affected means).
var All = []DB{
	{Name: "sqlite", Dialect: inbox.SQLite, Open: func(tb testing.TB) *sqlx.DB {
		return OpenSQLite(tb, filepath.Join(tb.TempDir(), "inbox.db"))
	}},
	{Name: "postgres", Dialect: inbox.PostgreSQL, Open: func(tb testing.TB) *sqlx.DB { return OpenPostgres(tb, "") }},
	{Name: "postgres-partitioned", Dialect: inbox.PostgreSQLPartitioned, Open: func(tb testing.TB) *sqlx.DB { return OpenPostgres(tb, "") }},
	{Name: "mysql", Dialect: inbox.MySQL, Open: func(tb testing.TB) *sqlx.DB { return OpenMySQL(tb, "") }},
	{Name: "mysql-clientFoundRows", Dialect: inbox.MySQL, Open: func(tb testing.TB) *sqlx.DB {
		return OpenMySQL(tb, "clientFoundRows=true")
	}},
}

// Env returns the environment variable name, or def when it is empty.
func Env(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// WithParam appends a query parameter to a DSN.
func WithParam(dsn, param string) string {
	if param == "" {
		return dsn
	}
	if strings.Contains(dsn, "?") {
		return dsn + "&" + param
	}
	return dsn + "?" + param
}

// PostgresDSN and MySQLDSN return the configured DSNs.
func PostgresDSN() string { return Env(PostgresDSNEnv, DefaultPostgresDSN) }
func MySQLDSN() string    { return Env(MySQLDSNEnv, DefaultMySQLDSN) }

// OpenSQLite opens the SQLite file at path with SQLiteParams, and pings it
// once, as the README tells applications to: the first connection to a new
// file switches it to WAL, and connections opening at that same moment fail
// with SQLITE_BUSY, busy_timeout or not.
func OpenSQLite(tb testing.TB, path string) *sqlx.DB {
	tb.Helper()
	db, err := sqlx.Open("sqlite", "file:"+path+"?"+SQLiteParams)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { db.Close() })
	if err := db.Ping(); err != nil {
		tb.Fatal(err)
	}
	return db
}

// OpenPostgres opens PostgreSQL through pgx with the extra DSN parameter
// param (may be empty).
func OpenPostgres(tb testing.TB, param string) *sqlx.DB { return OpenPostgresWith(tb, "pgx", param) }

// OpenPostgresWith opens PostgreSQL through the database/sql driver named
// driver ("pgx" or lib/pq's "postgres") with the extra DSN parameter param.
func OpenPostgresWith(tb testing.TB, driver, param string) *sqlx.DB {
	return open(tb, driver, WithParam(PostgresDSN(), param), "PostgreSQL", PostgresDSNEnv, startPostgres)
}

// PgBouncerDriver is one way of reaching PostgreSQL through PgBouncer in
// transaction pooling mode, as a user configures it.
type PgBouncerDriver struct {
	Name   string // lib/pq, pgx-exec, pgx-simple
	Driver string // the database/sql driver name
	Param  string // the DSN parameter that makes the driver work behind the pooler
}

// PgBouncerDrivers are the drivers and settings the README names for a
// transaction-mode pooler: lib/pq with its defaults, and pgx with
// default_query_exec_mode exec or simple_protocol (pgx's default statement
// cache cannot work there, by pgx's documentation).
var PgBouncerDrivers = []PgBouncerDriver{
	{Name: "lib/pq", Driver: "postgres"},
	{Name: "pgx-exec", Driver: "pgx", Param: "default_query_exec_mode=exec"},
	{Name: "pgx-simple", Driver: "pgx", Param: "default_query_exec_mode=simple_protocol"},
}

// PgBouncerDSN returns the configured DSN of the test PgBouncer.
func PgBouncerDSN() string { return Env(PgBouncerDSNEnv, DefaultPgBouncerDSN) }

// OpenPgBouncer opens a pool of at most 8 connections through the test
// PgBouncer with driver d.
func OpenPgBouncer(tb testing.TB, d PgBouncerDriver) *sqlx.DB {
	return open(tb, d.Driver, WithParam(PgBouncerDSN(), d.Param), "PgBouncer", PgBouncerDSNEnv, startPgBouncer)
}

// OpenPgxPool opens a pgx pool of at most 8 connections to the test
// PostgreSQL with the extra DSN parameter param (may be empty), closed when
// tb ends; a server that cannot be reached skips or fails as open does.
func OpenPgxPool(tb testing.TB, param string) *pgxpool.Pool {
	return openPool(tb, WithParam(PostgresDSN(), param), "PostgreSQL", PostgresDSNEnv, startPostgres)
}

// OpenPgxPoolBouncer opens a pgx pool of at most 8 connections through the
// test PgBouncer with the extra DSN parameter param (a
// default_query_exec_mode that works behind it).
func OpenPgxPoolBouncer(tb testing.TB, param string) *pgxpool.Pool {
	return openPool(tb, WithParam(PgBouncerDSN(), param), "PgBouncer", PgBouncerDSNEnv, startPgBouncer)
}

func openPool(tb testing.TB, dsn, what, envName, start string) *pgxpool.Pool {
	tb.Helper()
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		tb.Fatal(err)
	}
	cfg.MaxConns = 8
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(pool.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := pool.Ping(ctx); err != nil {
		var netErr *net.OpError
		if !errors.As(err, &netErr) {
			tb.Fatalf("%s: %v", what, err)
		}
		msg := fmt.Sprintf("%s not reachable (%v): start it with `%s`, or point %s at a server", what, err, start, envName)
		if os.Getenv("CI") == "true" {
			tb.Fatal(msg)
		}
		tb.Skip(msg)
	}
	return pool
}

// OpenMySQL opens MySQL/MariaDB with the extra DSN parameter param (may be empty).
func OpenMySQL(tb testing.TB, param string) *sqlx.DB { return OpenMySQLWith(tb, "mysql", param) }

// OpenMySQLWith opens MySQL/MariaDB through the database/sql driver named
// driver with the extra DSN parameter param.
func OpenMySQLWith(tb testing.TB, driver, param string) *sqlx.DB {
	return open(tb, driver, WithParam(MySQLDSN(), param), "MySQL/MariaDB", MySQLDSNEnv, startMariaDB)
}

func open(tb testing.TB, driver, dsn, what, envName, start string) *sqlx.DB {
	tb.Helper()
	db, err := sqlx.Open(driver, dsn)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { db.Close() })
	db.SetMaxOpenConns(8)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := db.PingContext(ctx); err != nil {
		var netErr *net.OpError
		if !errors.As(err, &netErr) {
			tb.Fatalf("%s: %v", what, err) // reachable, but refused us: a real failure
		}
		msg := fmt.Sprintf("%s not reachable (%v): start it with `%s`, or point %s at a server", what, err, start, envName)
		if os.Getenv("CI") == "true" {
			tb.Fatal(msg)
		}
		tb.Skip(msg)
	}
	return db
}

// RandomSuffix returns 12 random lowercase hex digits, for table names.
func RandomSuffix() string {
	b := make([]byte, 6)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}

// DropLater drops table when tb ends, with a context of its own (the test's
// is already cancelled by then).
func DropLater(tb testing.TB, db *sqlx.DB, table string) {
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := db.ExecContext(ctx, "DROP TABLE IF EXISTS "+table); err != nil {
			tb.Logf("drop %s: %v", table, err)
		}
	})
}

// DropOrphanClaimFunctions drops, in the PostgreSQL test database, the claim
// functions of partitioned inbox tables ("<table>_claim", made with the
// table) whose table no longer exists: dropping a table, CASCADE or not,
// leaves its function behind, since PL/pgSQL bodies record no dependency.
// Tests drop their tables; a package's TestMain calls this first, so
// leftovers of earlier runs do not pile up. A database that cannot be
// reached is left alone (the tests that need it say so).
func DropOrphanClaimFunctions() {
	db, err := sqlx.Open("pgx", PostgresDSN())
	if err != nil {
		return
	}
	defer db.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	db.ExecContext(ctx, `DO $$DECLARE f regprocedure; BEGIN
		FOR f IN SELECT p.oid::regprocedure FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
			WHERE p.proname LIKE '%\_claim' AND p.prosrc LIKE 'BEGIN PERFORM pg_advisory_xact_lock($3); %'
			AND to_regclass(quote_ident(n.nspname) || '.' || quote_ident(left(p.proname, -6))) IS NULL
		LOOP EXECUTE 'DROP FUNCTION IF EXISTS ' || f::text; END LOOP; END$$`) //nolint:errcheck // best effort
}
