package inbox_test

import (
	"context"
	"database/sql"
	"errors"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// Hostile and malformed table names fail in New with ErrInvalidTableName,
// before any SQL is built.
func TestNewRejectsBadTableNames(t *testing.T) {
	db := sqliteDB(t)
	bad := []string{
		"x; DROP TABLE y", `"inbox"`, "`inbox`", "inbox--", "in box", "a.b.c", ".inbox", "inbox.", "1inbox",
		"inbox\x00", "ïnbox", "inbox'", strings.Repeat("a", 64), "public." + strings.Repeat("a", 64),
	}
	for _, name := range bad {
		_, err := inbox.New(inbox.Config{DB: db, Table: name})
		if !errors.Is(err, inbox.ErrInvalidTableName) || !errors.Is(err, inbox.ErrInvalidConfig) {
			t.Errorf("Table %q: err = %v, want ErrInvalidTableName and ErrInvalidConfig", name, err)
		}
		if _, err := inbox.SchemaSQL(inbox.PostgreSQL, name); !errors.Is(err, inbox.ErrInvalidTableName) {
			t.Errorf("SchemaSQL %q: err = %v, want ErrInvalidTableName", name, err)
		}
	}
	for _, name := range []string{"inbox", "billing.inbox", "_x", "A_1", strings.Repeat("a", 63), "s." + strings.Repeat("a", 63)} {
		if _, err := inbox.New(inbox.Config{DB: db, Table: name}); err != nil {
			t.Errorf("Table %q: %v", name, err)
		}
	}
	// The hostile table the name would have dropped is still there.
	exec(t, db, "CREATE TABLE y (id INTEGER)")
	_, _ = inbox.New(inbox.Config{DB: db, Table: "x; DROP TABLE y"})
	count(t, db, "y", "")
}

var identifierOnly = regexp.MustCompile(`^[A-Za-z0-9_.]+$`)

// Whatever New accepts as a table name is a plain identifier: no quote,
// space, semicolon or comment can reach the SQL.
func FuzzTableName(f *testing.F) {
	for _, s := range []string{"inbox", "billing.inbox", "x; DROP TABLE y", `a"b`, "a`b", "a.b.c", "--", ""} {
		f.Add(s)
	}
	db, err := sqlx.Open("sqlite", ":memory:")
	if err != nil {
		f.Fatal(err)
	}
	defer db.Close()
	f.Fuzz(func(t *testing.T, name string) {
		_, err := inbox.New(inbox.Config{DB: db, Table: name})
		if err != nil {
			if name != "" && !errors.Is(err, inbox.ErrInvalidTableName) {
				t.Fatalf("Table %q: unexpected error %v", name, err)
			}
			return
		}
		if name != "" && (!identifierOnly.MatchString(name) || strings.Count(name, ".") > 1) {
			t.Fatalf("Table %q accepted", name)
		}
		for _, d := range []inbox.Dialect{inbox.PostgreSQL, inbox.MySQL, inbox.SQLite} {
			ddl, err := inbox.SchemaSQL(d, name)
			if err != nil {
				t.Fatalf("SchemaSQL(%s, %q): %v", d, name, err)
			}
			if strings.Count(ddl, ";") != strings.Count(ddl, ";\n") {
				t.Fatalf("SchemaSQL(%s, %q) has a stray semicolon:\n%s", d, name, ddl)
			}
		}
	})
}

func TestDialectInference(t *testing.T) {
	cases := map[string]inbox.Dialect{
		"postgres": inbox.PostgreSQL, "pgx": inbox.PostgreSQL, "pgx/v5": inbox.PostgreSQL,
		"mysql": inbox.MySQL, "sqlite": inbox.SQLite, "sqlite3": inbox.SQLite,
	}
	raw := sqliteDB(t).DB
	for driver, want := range cases {
		// sqlx.NewDb only records the name; the dialect comes from it.
		_, err := inbox.New(inbox.Config{DB: sqlx.NewDb(raw, driver)})
		if err != nil {
			t.Errorf("driver %q: %v", driver, err)
		}
		if got := want.String(); got == "" {
			t.Errorf("dialect %v has no name", want)
		}
	}
	_, err := inbox.New(inbox.Config{DB: sqlx.NewDb(raw, "oracle")})
	if !errors.Is(err, inbox.ErrUnknownDialect) || !errors.Is(err, inbox.ErrInvalidConfig) {
		t.Errorf("unknown driver: err = %v, want ErrUnknownDialect", err)
	}
	if _, err := inbox.New(inbox.Config{DB: sqlx.NewDb(raw, "oracle"), Dialect: inbox.SQLite}); err != nil {
		t.Errorf("explicit dialect with an unknown driver name: %v", err)
	}
}

// Validate reports every problem at once.
func TestValidateReportsAllProblems(t *testing.T) {
	err := inbox.Config{
		Table:     "bad name",
		Consumer:  strings.Repeat("c", 256),
		TxOptions: &sql.TxOptions{ReadOnly: true},
	}.Validate()
	for _, want := range []string{"Config.DB is required", "invalid table name", "invalid consumer", "ReadOnly"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Validate() = %v, want it to mention %q", err, want)
		}
	}
	if !errors.Is(err, inbox.ErrInvalidTableName) || !errors.Is(err, inbox.ErrInvalidConsumer) {
		t.Errorf("Validate() = %v, want it to wrap ErrInvalidTableName and ErrInvalidConsumer", err)
	}
	if _, err := inbox.New(inbox.Config{}); !errors.Is(err, inbox.ErrInvalidConfig) {
		t.Errorf("New(Config{}) = %v, want ErrInvalidConfig", err)
	}
	if err := (inbox.Config{DB: sqliteDB(t)}).Validate(); err != nil {
		t.Errorf("minimal config: %v", err)
	}
}

// The errors of New, Purge and NewPurger for an invalid configuration name
// the package once ("inbox: invalid config: ..."), one problem per line,
// and still match ErrInvalidConfig and each problem's sentinel.
func TestInvalidConfigErrorNamesThePackageOnce(t *testing.T) {
	t.Parallel()
	db := sqliteDB(t)
	_, newErr := inbox.New(inbox.Config{DB: db, Table: "bad name", Consumer: "\xff"})
	_, purgeErr := inbox.Purge(context.Background(), inbox.PurgeConfig{})
	_, purgerErr := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, OlderThan: time.Hour}, Interval: -1})
	for _, tc := range []struct {
		err  error
		want string
		is   []error
	}{
		{newErr, "inbox: invalid config: invalid table name: \"bad name\" must match ^[A-Za-z_][A-Za-z0-9_]{0,62}(\\.[A-Za-z_][A-Za-z0-9_]{0,62})?$\n" +
			"Config.Consumer: invalid consumer: \"\\xff\" is not valid UTF-8",
			[]error{inbox.ErrInvalidConfig, inbox.ErrInvalidTableName, inbox.ErrInvalidConsumer}},
		{purgeErr, "inbox: invalid config: PurgeConfig.DB is required\n" +
			"PurgeConfig.OlderThan must be at least 1µs (or 0 with a Window), got 0s",
			[]error{inbox.ErrInvalidConfig}},
		{purgerErr, "inbox: invalid config: PurgerConfig.Interval must be positive, got -1ns",
			[]error{inbox.ErrInvalidConfig}},
	} {
		if tc.err == nil || tc.err.Error() != tc.want {
			t.Errorf("error text\n%v\nwant\n%s", tc.err, tc.want)
		}
		for _, target := range tc.is {
			if !errors.Is(tc.err, target) {
				t.Errorf("%v does not match %v", tc.err, target)
			}
		}
	}
}

// A pgx pool wrapped with stdlib.OpenDBFromPool, as the docs tell pgx users.
func TestPgxPool(t *testing.T) {
	probe := testdb.OpenPostgres(t, "")
	pool, err := pgxpool.New(context.Background(), testdb.PostgresDSN())
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	db := sqlx.NewDb(stdlib.OpenDBFromPool(pool), "pgx")
	defer db.Close()
	f := newFixture(t, probe)
	ib, err := inbox.New(inbox.Config{DB: db, Table: f.inbox, Consumer: "billing"})
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	runTwice(t, ib)
	if got := f.inboxRows(); got != 1 {
		t.Errorf("inbox rows = %d, want 1", got)
	}
}

// A duplicate is logged once at Debug with Watermill's field names and
// reported to OnDuplicate; nothing is logged at Error for it.
func TestDuplicateLoggingAndHooks(t *testing.T) {
	db := sqliteDB(t)
	f := newFixture(t, db)
	logger := newCaptureLogger()
	var events []inbox.Event
	var mu sync.Mutex
	record := func(e inbox.Event) { mu.Lock(); events = append(events, e); mu.Unlock() }
	ib := f.newInbox(inbox.Config{Logger: logger, OnProcessed: record, OnDuplicate: record})
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(ib.Middleware)
		r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error { return nil })
	})
	msg := message.NewMessage(watermill.NewUUID(), nil)
	in.deliver(t, msg)
	in.deliver(t, msg)

	var debug []logLine
	for _, l := range *logger.lines {
		if l.level == "debug" {
			debug = append(debug, l)
		}
		if l.level == "error" {
			t.Errorf("error logged: %v", l)
		}
	}
	if len(debug) != 1 {
		t.Fatalf("debug lines = %v, want one for the duplicate", debug)
	}
	for k, want := range map[string]string{"message_uuid": msg.UUID, "handler_name": "billing", "consumer": "billing", "message_id": msg.UUID} {
		if got := debug[0].fields[k]; got != want {
			t.Errorf("field %s = %v, want %v", k, got, want)
		}
	}
	if len(events) != 2 || events[0].Consumer != "billing" || events[1].MessageID != msg.UUID ||
		events[0].Duration <= 0 || events[1].Duration <= 0 {
		t.Errorf("hook events = %+v", events)
	}
}

// New refuses the isolation levels a database's driver refuses at every
// BEGIN (with an error that carries no server code, which IsTransient would
// take for a lost connection), and accepts those the driver runs: checked
// against the real drivers, so the rule follows them.
func TestIsolationLevelsMatchTheDrivers(t *testing.T) {
	t.Parallel()
	levels := []sql.IsolationLevel{
		sql.LevelDefault, sql.LevelReadUncommitted, sql.LevelReadCommitted, sql.LevelWriteCommitted,
		sql.LevelRepeatableRead, sql.LevelSnapshot, sql.LevelSerializable, sql.LevelLinearizable,
	}
	for _, tdb := range testdb.All {
		if tdb.Dialect == inbox.PostgreSQLPartitioned {
			continue // READ COMMITTED only, a rule of its own (TestConcurrentClaim_TwoWorkersWithOpenTransactionsProcessOnce)
		}
		t.Run(tdb.Name, func(t *testing.T) {
			t.Parallel()
			db := tdb.Open(t)
			for _, level := range levels {
				opts := &sql.TxOptions{Isolation: level}
				_, newErr := inbox.New(inbox.Config{DB: db, Dialect: tdb.Dialect, TxOptions: opts})
				tx, beginErr := db.BeginTx(context.Background(), opts)
				if beginErr == nil {
					tx.Rollback()
				}
				want := beginErr == nil
				if level == sql.LevelSnapshot && tdb.Dialect == inbox.PostgreSQL {
					want = false // pgx runs it as REPEATABLE READ, lib/pq refuses it
				}
				if (newErr == nil) != want {
					t.Errorf("%v: New: %v; the driver's BEGIN: %v", level, newErr, beginErr)
				}
				if newErr != nil {
					// Validate alone, with the dialect left to inference, agrees.
					if err := (inbox.Config{DB: db, TxOptions: opts}).Validate(); err == nil && tdb.Dialect != inbox.SQLite {
						t.Errorf("%v: Validate with an inferred dialect accepted it", level)
					}
				}
				if newErr != nil && !errors.Is(newErr, inbox.ErrInvalidConfig) {
					t.Errorf("%v: New: %v, want ErrInvalidConfig", level, newErr)
				}
			}
		})
	}
}

// New keeps a copy of Config.TxOptions: a caller that changes its
// *sql.TxOptions afterwards changes neither what Validate checked nor what
// runs (and races with nothing).
func TestTxOptionsCopied(t *testing.T) {
	t.Parallel()
	db := testdb.OpenMySQL(t, "")
	f := newFixture(t, db)
	opts := &sql.TxOptions{Isolation: sql.LevelReadCommitted}
	ib := f.newInbox(inbox.Config{Consumer: "billing", TxOptions: opts})
	opts.Isolation = sql.LevelSnapshot // go-sql-driver refuses it at BEGIN
	runTwice(t, ib)
	if got := f.inboxRows(); got != 1 {
		t.Errorf("inbox rows = %d, want 1", got)
	}
}
