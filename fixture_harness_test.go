package inbox_test

// The test databases and each test's tables on them.

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	_ "github.com/go-sql-driver/mysql"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/jmoiron/sqlx"
	_ "modernc.org/sqlite"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

type testDB = testdb.DB

var testDBs = testdb.All

var (
	randomSuffix = testdb.RandomSuffix
	dropLater    = testdb.DropLater
	openSQLite   = testdb.OpenSQLite
)

// dialectOf maps a test's *sqlx.DB to the dialect its inbox must use, for
// the dialects that are not inferred from the driver (PostgreSQLPartitioned).
var dialectOf sync.Map

// forEachDB runs f as a parallel subtest on every test database.
func forEachDB(t *testing.T, f func(t *testing.T, tdb testDB, db *sqlx.DB)) {
	t.Helper()
	for _, tdb := range testDBs {
		t.Run(tdb.Name, func(t *testing.T) {
			t.Parallel()
			db := tdb.Open(t)
			dialectOf.Store(db, tdb.Dialect)
			f(t, tdb, db)
		})
	}
}

func exec(t testing.TB, db *sqlx.DB, query string, args ...any) {
	t.Helper()
	if _, err := db.ExecContext(context.Background(), db.Rebind(query), args...); err != nil {
		t.Fatalf("%s: %v", query, err)
	}
}

func count(t testing.TB, db *sqlx.DB, table, where string, args ...any) int {
	t.Helper()
	q := "SELECT COUNT(*) FROM " + table
	if where != "" {
		q += " WHERE " + where
	}
	var n int
	if err := db.GetContext(context.Background(), &n, db.Rebind(q), args...); err != nil {
		t.Fatalf("%s: %v", q, err)
	}
	return n
}

// fixture is one test's inbox table and business table on one database.
type fixture struct {
	t        *testing.T
	db       *sqlx.DB
	inbox    string // inbox table name
	business string // business table: one row per processed (consumer, message)
}

func newFixture(t *testing.T, db *sqlx.DB) *fixture {
	t.Helper()
	s := randomSuffix()
	f := &fixture{t: t, db: db, inbox: "inbox_" + s, business: "business_" + s}
	exec(t, db, "CREATE TABLE "+f.business+" (id VARCHAR(255) NOT NULL PRIMARY KEY, consumer VARCHAR(255) NOT NULL)")
	dropLater(t, db, f.business)
	dropLater(t, db, f.inbox)
	return f
}

// newInbox creates an inbox on the fixture's table (schema included).
func (f *fixture) newInbox(cfg inbox.Config) *inbox.Inbox {
	f.t.Helper()
	cfg.DB = f.db
	cfg.Table = f.inbox
	if d, ok := dialectOf.Load(f.db); ok && cfg.Dialect == nil {
		cfg.Dialect = d.(inbox.Dialect)
	}
	ib, err := inbox.New(cfg)
	if err != nil {
		f.t.Fatal(err)
	}
	if err := ib.InitializeSchema(context.Background()); err != nil {
		f.t.Fatal(err)
	}
	return ib
}

// writeBusinessRow is what a real handler does: a write through the inbox
// transaction, keyed by consumer and message UUID.
func (f *fixture) writeBusinessRow(msg *message.Message) error {
	tx, ok := inbox.TxFromContext(msg.Context())
	if !ok {
		return fmt.Errorf("no inbox transaction in the message context")
	}
	consumer := message.HandlerNameFromCtx(msg.Context())
	_, err := tx.ExecContext(msg.Context(), tx.Rebind("INSERT INTO "+f.business+" (id, consumer) VALUES (?, ?)"),
		consumer+":"+msg.UUID, consumer)
	return err
}

func (f *fixture) businessRows() int { return count(f.t, f.db, f.business, "") }

func (f *fixture) inboxRows() int { return count(f.t, f.db, f.inbox, "") }

// isPostgres reports whether d is one of the PostgreSQL dialects.
func isPostgres(d inbox.Dialect) bool {
	return d == inbox.PostgreSQL || d == inbox.PostgreSQLPartitioned
}

// insertRow writes one business row with the given id through the inbox
// transaction; unlike writeBusinessRow, two handler runs for one message
// write two rows instead of failing on the primary key.
func (f *fixture) insertRow(msg *message.Message, id string) error {
	tx, ok := inbox.TxFromContext(msg.Context())
	if !ok {
		return errors.New("no inbox transaction in the message context")
	}
	_, err := tx.ExecContext(msg.Context(), tx.Rebind("INSERT INTO "+f.business+" (id, consumer) VALUES (?, ?)"),
		id, message.HandlerNameFromCtx(msg.Context()))
	return err
}

// openSQLiteWith opens a new SQLite file with exactly the DSN parameters
// params, where a case needs settings other than the recommended ones.
func openSQLiteWith(t *testing.T, params string) *sqlx.DB {
	t.Helper()
	db, err := sqlx.Open("sqlite", "file:"+filepath.Join(t.TempDir(), "inbox.db")+"?"+params)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return db
}

func sqliteDB(t *testing.T) *sqlx.DB {
	return openSQLite(t, t.TempDir()+"/x.db")
}
