package inbox_test

import (
	"context"
	"database/sql/driver"
	"embed"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

var update = flag.Bool("update", false, "rewrite schema/*.sql from SchemaSQL")

//go:embed schema/*.sql
var schemaFiles embed.FS

var schemaFileOf = map[inbox.Dialect]string{
	inbox.PostgreSQL: "schema/postgres.sql",
	inbox.MySQL:      "schema/mysql.sql",
	inbox.SQLite:     "schema/sqlite.sql",

	inbox.PostgreSQLPartitioned: "schema/postgres_partitioned.sql",
}

// The canonical DDL files are exactly what the code generates for the
// default table name. Run `go test -run TestSchemaFiles -update` after
// changing the DDL.
func TestSchemaFilesMatchCode(t *testing.T) {
	for d, file := range schemaFileOf {
		want, err := inbox.SchemaSQL(d, "")
		if err != nil {
			t.Fatal(err)
		}
		if *update {
			if err := os.WriteFile(file, []byte(want), 0o644); err != nil {
				t.Fatal(err)
			}
			continue
		}
		got, err := schemaFiles.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		if string(got) != want {
			t.Errorf("%s differs from SchemaSQL(%s, %q); run go test -run TestSchemaFiles -update\n--- file\n%s\n--- code\n%s",
				file, d, inbox.DefaultTable, got, want)
		}
	}
}

// statements splits a schema file into its statements.
func statements(script string) []string {
	var kept []string
	for _, line := range strings.Split(script, "\n") {
		if !strings.HasPrefix(line, "--") {
			kept = append(kept, line)
		}
	}
	var stmts []string
	for _, s := range strings.Split(strings.Join(kept, "\n"), ";\n") {
		if s = strings.TrimSpace(s); s != "" {
			stmts = append(stmts, s)
		}
	}
	return stmts
}

// What InitializeSchema creates for the default name is the same table,
// column for column and index for index, as what the schema file creates,
// read back from each database's catalog.
func TestInitializeSchemaMatchesSchemaFile(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if tdb.Dialect == inbox.PostgreSQLPartitioned {
			t.Skip("partitioned: InitializeSchema also creates partitions; see TestPartitioned*")
		}
		ctx := context.Background()
		file, _ := schemaFiles.ReadFile(schemaFileOf[tdb.Dialect])
		fromFile, fromCode := "f_"+randomSuffix(), "c_"+randomSuffix()

		switch tdb.Dialect {
		case inbox.PostgreSQL, inbox.MySQL:
			kind := "SCHEMA"
			if tdb.Dialect == inbox.MySQL {
				kind = "DATABASE"
			}
			for _, ns := range []string{fromFile, fromCode} {
				exec(t, db, "CREATE "+kind+" "+ns)
				t.Cleanup(func() { db.Exec("DROP " + kind + " " + ns + cascade(tdb.Dialect)) })
			}
			// The file, unchanged, run with fromFile as the current schema.
			conn, err := db.Connx(ctx)
			if err != nil {
				t.Fatal(err)
			}
			use := "SET search_path TO " + fromFile
			if tdb.Dialect == inbox.MySQL {
				use = "USE " + fromFile
			}
			if _, err := conn.ExecContext(ctx, use); err != nil {
				t.Fatal(err)
			}
			for _, stmt := range statements(string(file)) {
				if _, err := conn.ExecContext(ctx, stmt); err != nil {
					t.Fatalf("%s: %v", stmt, err)
				}
			}
			conn.Raw(func(any) error { return driver.ErrBadConn }) // discard the session with its search_path
			conn.Close()
			initialize(t, db, fromCode+"."+inbox.DefaultTable)
			if a, b := describe(t, db, tdb.Dialect, fromFile), describe(t, db, tdb.Dialect, fromCode); a != b {
				t.Errorf("schema file creates\n%s\nInitializeSchema creates\n%s", a, b)
			}
		case inbox.SQLite:
			dir := t.TempDir()
			a, b := openSQLite(t, filepath.Join(dir, "file.db")), openSQLite(t, filepath.Join(dir, "code.db"))
			for _, stmt := range statements(string(file)) {
				exec(t, a, stmt)
			}
			initialize(t, b, "")
			if da, db := describe(t, a, inbox.SQLite, ""), describe(t, b, inbox.SQLite, ""); da != db {
				t.Errorf("schema file creates\n%s\nInitializeSchema creates\n%s", da, db)
			}
		}
	})
}

func cascade(d inbox.Dialect) string {
	if d == inbox.PostgreSQL {
		return " CASCADE"
	}
	return ""
}

func initialize(t *testing.T, db *sqlx.DB, table string) {
	t.Helper()
	ib, err := inbox.New(inbox.Config{DB: db, Table: table})
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// describe reads the inbox table's definition back from the catalog.
func describe(t *testing.T, db *sqlx.DB, d inbox.Dialect, ns string) string {
	t.Helper()
	var rows []string
	var err error
	switch d {
	case inbox.PostgreSQL, inbox.PostgreSQLPartitioned:
		err = db.Select(&rows, `
			SELECT column_name || ' ' || data_type || ' ' || is_nullable || ' ' || coalesce(column_default, '')
			FROM information_schema.columns WHERE table_schema = $1 AND table_name = $2
			UNION ALL
			SELECT replace(indexdef, $1 || '.', '') FROM pg_indexes WHERE schemaname = $1 AND tablename = $2
			ORDER BY 1`, ns, inbox.DefaultTable)
	case inbox.MySQL:
		var name, ddl string
		err = db.QueryRowx("SHOW CREATE TABLE "+ns+"."+inbox.DefaultTable).Scan(&name, &ddl)
		rows = []string{ddl}
	case inbox.SQLite:
		err = db.Select(&rows, "SELECT type || ' ' || name || ': ' || sql FROM sqlite_master ORDER BY name")
	}
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) == 0 {
		t.Fatalf("no table %s.%s", ns, inbox.DefaultTable)
	}
	return strings.Join(rows, "\n")
}

// InitializeSchema is idempotent and safe when several processes start at
// once: here eight starters race on a new table, then run again.
func TestInitializeSchemaConcurrent(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		table := "inbox_" + randomSuffix()
		dropLater(t, db, table)
		ib, err := inbox.New(inbox.Config{DB: db, Table: table})
		if err != nil {
			t.Fatal(err)
		}
		for round := range 2 {
			var wg sync.WaitGroup
			errs := make(chan error, 8)
			for range 8 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					errs <- ib.InitializeSchema(context.Background())
				}()
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				if err != nil {
					t.Errorf("round %d: %v", round, err)
				}
			}
		}
		if got := count(t, db, table, ""); got != 0 {
			t.Errorf("rows = %d, want 0", got)
		}
	})
}

// A schema-qualified table works end to end (PostgreSQL schema, MySQL
// database, SQLite main database).
func TestQualifiedTableName(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		ns := "main"
		switch tdb.Dialect {
		case inbox.PostgreSQL, inbox.PostgreSQLPartitioned:
			ns = "billing_" + randomSuffix()
			exec(t, db, "CREATE SCHEMA "+ns)
			t.Cleanup(func() { db.Exec("DROP SCHEMA " + ns + " CASCADE") })
		case inbox.MySQL:
			ns = "billing_" + randomSuffix()
			exec(t, db, "CREATE DATABASE "+ns)
			t.Cleanup(func() { db.Exec("DROP DATABASE " + ns) })
		}
		table := ns + ".inbox_" + randomSuffix()
		dropLater(t, db, table)
		ib, err := inbox.New(inbox.Config{DB: db, Table: table, Consumer: "billing"})
		if err != nil {
			t.Fatal(err)
		}
		if err := ib.InitializeSchema(context.Background()); err != nil {
			t.Fatal(err)
		}
		runTwice(t, ib)
		if got := count(t, db, table, ""); got != 1 {
			t.Errorf("rows in %s = %d, want 1", table, got)
		}
	})
}

// runTwice passes one message through the middleware twice, outside a
// router, and checks that the handler ran once.
func runTwice(t *testing.T, ib *inbox.Inbox) {
	t.Helper()
	msg := message.NewMessage(watermill.NewUUID(), nil)
	calls := 0
	h := ib.Middleware(func(*message.Message) ([]*message.Message, error) { calls++; return nil, nil })
	for range 2 {
		if _, err := h(msg.Copy()); err != nil {
			t.Fatal(err)
		}
	}
	if calls != 1 {
		t.Errorf("handler calls = %d, want 1", calls)
	}
}

// On a table that exists, InitializeSchema runs no DDL: a rolling deploy
// calling it while handlers hold rows neither waits for them nor makes new
// claims queue behind it (on PostgreSQL, CREATE INDEX IF NOT EXISTS takes a
// SHARE lock on the table even when the index exists).
func TestInitializeSchemaOnLiveTable(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if tdb.Dialect == inbox.SQLite {
			// One writer at a time is SQLite's model; a reader never waits.
			t.Skip("SQLite: a held write transaction blocks every writer by design")
		}
		f := newFixture(t, db)
		ib := f.newInbox(inbox.Config{})
		ctx := context.Background()
		tx, err := db.BeginTxx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		if _, err := tx.Exec(tx.Rebind("INSERT INTO "+f.inbox+" (consumer, message_id, processed_at) VALUES (?, ?, "+agoSQL(tdb.Dialect, 0)+")"), "billing", "in-flight"); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		defer cancel()
		if err := ib.InitializeSchema(ctx); err != nil {
			t.Fatalf("InitializeSchema while a handler holds a row: %v", err)
		}
	})
}

// The catalog check behind InitializeSchema's "no DDL when it exists" sees
// a missing table, a table without its purge index, and both.
func TestSchemaExistsCheck(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if tdb.Dialect == inbox.PostgreSQLPartitioned {
			t.Skip("partitioned: the table has no purge index to check")
		}
		ctx := context.Background()
		table := "inbox_" + randomSuffix()
		dropLater(t, db, table)
		check := func(want bool) {
			t.Helper()
			got, err := inbox.SchemaExists(ctx, db, tdb.Dialect, table)
			if err != nil || got != want {
				t.Fatalf("SchemaExists = %v, %v; want %v", got, err, want)
			}
		}
		check(false)
		if err := inbox.CreateTableOnly(ctx, db, tdb.Dialect, table); err != nil {
			t.Fatal(err)
		}
		check(false)
		initialize(t, db, table)
		check(true)
	})
}

// Several starters at once on a table that lacks its purge index all
// succeed: on MySQL/MariaDB, which has no CREATE INDEX IF NOT EXISTS, the
// starters that lose the race to create the index get error 1061 (the name
// exists), which means the index is there.
func TestInitializeSchema_ConcurrentStartersAddTheMissingIndex(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		table := "inbox_" + randomSuffix()
		dropLater(t, db, table)
		ctx := context.Background()
		if err := inbox.CreateTableOnly(ctx, db, tdb.Dialect, table); err != nil {
			t.Fatal(err)
		}
		ib, err := inbox.New(inbox.Config{DB: db, Dialect: tdb.Dialect, Table: table})
		if err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		for range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := ib.InitializeSchema(ctx); err != nil {
					t.Errorf("InitializeSchema: %v", err)
				}
			}()
		}
		wg.Wait()
		if ok, err := inbox.SchemaExists(ctx, db, tdb.Dialect, table); !ok || err != nil {
			t.Errorf("table and purge index after the starters: %v, %v", ok, err)
		}
	})
}
