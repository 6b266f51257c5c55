package harness

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/datalayers/internal/invoices"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// Kind is a database the bindings are tested on.
type Kind string

// The databases, named as the subtests are.
const (
	PostgreSQL Kind = "postgres"
	MariaDB    Kind = "mariadb"
	SQLite     Kind = "sqlite"
)

// InboxTable is the inbox table of every test database: the default name,
// in the test's own schema or database.
const InboxTable = "watermill_inbox"

// Database is one case's own database holding the invoices table: on
// PostgreSQL a schema that the connections' search_path names, on MariaDB a
// database that the DSN names, on SQLite a file. The sqlc queries name the
// table without a schema, so cases running in parallel (and the two test
// packages, which go test runs at once) each need their own namespace.
// It is dropped when the test ends.
type Database struct {
	Kind Kind
	// DB is a pool of at most 8 connections on the database, through pgx's
	// database/sql driver ("pgx"), go-sql-driver/mysql ("mysql") or
	// modernc.org/sqlite ("sqlite").
	DB *sqlx.DB
	// Name is the schema (PostgreSQL) or database (MariaDB); "" on SQLite.
	Name string
}

// Open creates a database of kind k with the invoices table for t. A
// PostgreSQL or MariaDB server that cannot be reached skips t, or fails it
// when CI=true (internal/testdb's rule).
func Open(t testing.TB, k Kind) *Database {
	t.Helper()
	d := &Database{Kind: k}
	var ddl string
	switch k {
	case PostgreSQL:
		admin := testdb.OpenPostgres(t, "")
		d.Name = "datalayers_" + testdb.RandomSuffix()
		mustExec(t, admin, "CREATE SCHEMA "+d.Name)
		dropLater(t, admin, "DROP SCHEMA "+d.Name+" CASCADE")
		d.DB = testdb.OpenPostgres(t, "search_path="+d.Name)
		ddl = invoices.PostgreSQL
	case MariaDB:
		admin := testdb.OpenMySQL(t, "")
		d.Name = "datalayers_" + testdb.RandomSuffix()
		mustExec(t, admin, "CREATE DATABASE "+d.Name)
		dropLater(t, admin, "DROP DATABASE "+d.Name)
		cfg, err := mysql.ParseDSN(testdb.MySQLDSN())
		if err != nil {
			t.Fatal(err)
		}
		cfg.DBName = d.Name
		if d.DB, err = sqlx.Open("mysql", cfg.FormatDSN()); err != nil {
			t.Fatal(err)
		}
		d.DB.SetMaxOpenConns(8)
		t.Cleanup(func() { d.DB.Close() })
		ddl = invoices.MySQL
	case SQLite:
		d.DB = testdb.OpenSQLite(t, filepath.Join(t.TempDir(), "datalayers.db"))
		ddl = invoices.SQLite
	default:
		t.Fatalf("unknown database kind %q", k)
	}
	mustExec(t, d.DB, ddl)
	return d
}

// PgxPool opens a pgx pool of at most 8 connections on d, a PostgreSQL
// database, closed when t ends.
func (d *Database) PgxPool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	if d.Kind != PostgreSQL {
		t.Fatalf("a pgx pool needs PostgreSQL, not %s", d.Kind)
	}
	return testdb.OpenPgxPool(t, "search_path="+d.Name)
}

// Count returns the number of rows in table.
func (d *Database) Count(t testing.TB, table string) int {
	t.Helper()
	var n int
	if err := d.DB.GetContext(context.Background(), &n, "SELECT COUNT(*) FROM "+table); err != nil {
		t.Fatalf("count %s: %v", table, err)
	}
	return n
}

// Inbox returns the middleware of a new inbox (database/sql) on d, whose
// table it creates.
func (d *Database) Inbox(t testing.TB) message.HandlerMiddleware {
	t.Helper()
	ib, err := inbox.New(inbox.Config{DB: d.DB})
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	return ib.Middleware
}

// PgxInbox returns the middleware of a new pgxinbox.Inbox on pool, whose
// table it creates; the inbox is closed when t ends.
func PgxInbox(t testing.TB, pool *pgxpool.Pool) message.HandlerMiddleware {
	t.Helper()
	ib, err := pgxinbox.New(pgxinbox.Config{Pool: pool})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := ib.Close(); err != nil {
			t.Errorf("close pgx inbox: %v", err)
		}
	})
	if err := ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	return ib.Middleware
}

func mustExec(t testing.TB, db *sqlx.DB, query string) {
	t.Helper()
	if _, err := db.ExecContext(context.Background(), query); err != nil {
		t.Fatalf("%s: %v", query, err)
	}
}

// dropLater runs the DROP statement when t ends, with a context of its own
// (the test's is already cancelled by then).
func dropLater(t testing.TB, db *sqlx.DB, drop string) {
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := db.ExecContext(ctx, drop); err != nil {
			t.Logf("%s: %v", drop, err)
		}
	})
}
