package inbox_test

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A table made by InitializeSchema or from SchemaSQL passes Verify, under a plain or a qualified name.
func TestVerify_acceptsCanonicalTable(t *testing.T) {
	t.Parallel()
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		for _, tc := range []struct {
			name   string
			create func(t *testing.T, ib *inbox.Inbox, table string)
		}{
			{"InitializeSchema", func(t *testing.T, ib *inbox.Inbox, _ string) {
				if err := ib.InitializeSchema(context.Background()); err != nil {
					t.Fatal(err)
				}
			}},
			{"SchemaSQL", func(t *testing.T, _ *inbox.Inbox, table string) { applySchemaSQL(t, db, tdb.Dialect, table) }},
		} {
			for _, qualified := range []bool{false, true} {
				name := tc.name
				if qualified {
					name += "/qualified"
				}
				t.Run(name, func(t *testing.T) {
					t.Parallel()
					table := "inbox_" + randomSuffix()
					dropLater(t, db, table)
					if qualified {
						table = currentSchema(t, db, tdb.Dialect) + "." + table
					}
					ib := verifyInbox(t, db, tdb.Dialect, table)
					tc.create(t, ib, table)
					if err := ib.Verify(context.Background()); err != nil {
						t.Fatalf("Verify: %v", err)
					}
				})
			}
		}
	})
}

// A MySQL varchar key in utf8mb4 with a binary NO PAD collation passes Verify.
func TestVerify_acceptsBinaryNoPadVarchar(t *testing.T) {
	t.Parallel()
	db := testdb.OpenMySQL(t, "")
	table := "inbox_" + randomSuffix()
	dropLater(t, db, table)
	exec(t, db, expand(`CREATE TABLE {t} (
		consumer     varchar(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin NOT NULL,
		message_id   varchar(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin NOT NULL,
		processed_at datetime(6) NOT NULL,
		note         text NULL,
		PRIMARY KEY (consumer, message_id),
		INDEX by_age (processed_at)
	) ENGINE=InnoDB`, table))
	if err := verifyInbox(t, db, inbox.MySQL, table).Verify(context.Background()); err != nil {
		t.Fatalf("Verify: %v", err)
	}
}

// Verify reads the table in the schema, database or attached database that its name resolves to.
func TestVerify_checksTheTableTheNameResolvesTo(t *testing.T) {
	t.Parallel()
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		ns := "other_" + randomSuffix()
		bad := "CREATE TABLE {t} (consumer text NOT NULL, message_id char(255) NOT NULL, processed_at timestamptz NOT NULL, " + pgRest + ")"
		switch tdb.Dialect {
		case inbox.MySQL:
			exec(t, db, "CREATE DATABASE "+ns)
			t.Cleanup(func() { db.Exec("DROP DATABASE " + ns) })
			bad = myTable("varchar(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_general_ci", myRest)
		case inbox.SQLite:
			db.SetMaxOpenConns(1) // ATTACH holds for one connection
			exec(t, db, "ATTACH DATABASE ? AS "+ns, filepath.Join(t.TempDir(), "other.db"))
			bad = `CREATE TABLE {t} (consumer TEXT NOT NULL, message_id TEXT NOT NULL COLLATE NOCASE,
				processed_at INTEGER NOT NULL, PRIMARY KEY (consumer, message_id))`
		default:
			exec(t, db, "CREATE SCHEMA "+ns)
			t.Cleanup(func() { db.Exec("DROP SCHEMA " + ns + " CASCADE") })
		}
		table := "inbox_" + randomSuffix()
		dropLater(t, db, table)
		exec(t, db, expand(bad, ns+"."+table))
		if err := verifyInbox(t, db, tdb.Dialect, table).InitializeSchema(context.Background()); err != nil {
			t.Fatal(err)
		}
		if err := verifyInbox(t, db, tdb.Dialect, table).Verify(context.Background()); err != nil {
			t.Errorf("Verify(%q): %v, want nil", table, err)
		}
		err := verifyInbox(t, db, tdb.Dialect, ns+"."+table).Verify(context.Background())
		if !errors.Is(err, inbox.ErrIncompatibleTable) || (tdb.Dialect != inbox.PostgreSQLPartitioned && !strings.Contains(err.Error(), `"message_id"`)) {
			t.Errorf("Verify(%q): %v, want ErrIncompatibleTable naming message_id", ns+"."+table, err)
		}
		good := ns + ".inbox_" + randomSuffix()
		applySchemaSQL(t, db, tdb.Dialect, good)
		if err := verifyInbox(t, db, tdb.Dialect, good).Verify(context.Background()); err != nil {
			t.Errorf("Verify(%q): %v, want nil", good, err)
		}
	})
}

// A missing table gives ErrTableNotFound with the DDL that creates it.
func TestVerify_missingTableIsNotFound(t *testing.T) {
	t.Parallel()
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		for _, table := range []string{"inbox_" + randomSuffix(), "nosuchschema_" + randomSuffix() + ".inbox"} {
			t.Run(table, func(t *testing.T) {
				t.Parallel()
				err := verifyInbox(t, db, tdb.Dialect, table).Verify(context.Background())
				if !errors.Is(err, inbox.ErrTableNotFound) || errors.Is(err, inbox.ErrIncompatibleTable) {
					t.Fatalf("Verify: %v, want ErrTableNotFound", err)
				}
				for _, want := range []string{`"` + table + `"`, "InitializeSchema", "CREATE TABLE"} {
					if !strings.Contains(err.Error(), want) {
						t.Errorf("error does not contain %q:\n%v", want, err)
					}
				}
			})
		}
	})
}

// A table that could merge, truncate or reject ids is refused with an error naming the column and the fix.
func TestVerify_refusesIncompatibleTable(t *testing.T) {
	t.Parallel()
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		for _, tc := range badTables[tdb.Name] {
			t.Run(tc.name, func(t *testing.T) {
				t.Parallel()
				table := "inbox_" + randomSuffix()
				if tc.setup != nil {
					tc.setup(t, db, table)
				}
				dropLater(t, db, table)
				for _, stmt := range tc.ddl {
					exec(t, db, expand(stmt, table))
				}
				err := verifyInbox(t, db, tdb.Dialect, table).Verify(context.Background())
				if !errors.Is(err, inbox.ErrIncompatibleTable) {
					t.Fatalf("Verify: %v, want ErrIncompatibleTable", err)
				}
				for _, want := range append(tc.mention, expand(tc.fix, table)) {
					if !strings.Contains(err.Error(), want) {
						t.Errorf("error does not contain %q:\n%v", want, err)
					}
				}
			})
		}
	})
}

// The fixes the error prints, applied in order, make the table pass Verify and keep its rows.
func TestVerify_printedFixesMakeTableCompatible(t *testing.T) {
	t.Parallel()
	type broken struct{ ddl, insert []string }
	pgPartitioned := broken{
		ddl: []string{`CREATE TABLE {t} (
			consumer     varchar(36) NOT NULL,
			message_id   char(255)   NOT NULL,
			processed_at timestamptz NOT NULL,
			PRIMARY KEY (consumer, message_id, processed_at)) PARTITION BY RANGE (processed_at)`,
			"CREATE TABLE {t}_all PARTITION OF {t} DEFAULT"},
		insert: []string{"INSERT INTO {t} (consumer, message_id, processed_at) VALUES ('c', 'a', now()), ('c', 'b', now())"},
	}
	mysql := broken{
		ddl: []string{`CREATE TABLE {t} (
			consumer     varchar(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_general_ci NOT NULL,
			message_id   varchar(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
			processed_at datetime NOT NULL,
			tenant       int NOT NULL,
			UNIQUE KEY uniq (consumer, message_id)) ENGINE=InnoDB`},
		insert: []string{"INSERT INTO {t} (consumer, message_id, processed_at, tenant) VALUES ('c', 'a', UTC_TIMESTAMP(), 1), ('c', 'b', UTC_TIMESTAMP(), 1)"},
	}
	tables := map[string]broken{
		"postgres": {
			ddl: []string{`CREATE TABLE {t} (
				consumer     varchar(36) NOT NULL,
				message_id   char(255)   NOT NULL,
				processed_at timestamp   NOT NULL,
				tenant       text        NOT NULL,
				UNIQUE (consumer, message_id))`},
			insert: []string{"INSERT INTO {t} (consumer, message_id, processed_at, tenant) VALUES ('c', 'a', now(), 't'), ('c', 'b', now(), 't')"},
		},
		"postgres-partitioned":  pgPartitioned,
		"mysql":                 mysql,
		"mysql-clientFoundRows": mysql,
		"sqlite": {
			ddl: []string{`CREATE TABLE {t} (
				consumer     TEXT NOT NULL,
				message_id   TEXT NOT NULL COLLATE NOCASE,
				processed_at INTEGER NOT NULL,
				PRIMARY KEY (consumer, message_id))`},
			insert: []string{"INSERT INTO {t} (consumer, message_id, processed_at) VALUES ('c', 'a', 1765000000), ('c', 'b', 1765000001)"}, // Unix seconds: converted
		},
	}
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		table := "inbox_" + randomSuffix()
		dropLater(t, db, table+"_old")
		dropLater(t, db, table)
		for _, stmt := range append(tables[tdb.Name].ddl, tables[tdb.Name].insert...) {
			exec(t, db, expand(stmt, table))
		}
		ib := verifyInbox(t, db, tdb.Dialect, table)
		err := ib.Verify(context.Background())
		if !errors.Is(err, inbox.ErrIncompatibleTable) {
			t.Fatalf("Verify: %v, want ErrIncompatibleTable", err)
		}
		applyFixes(t, db, err)
		if err := ib.Verify(context.Background()); err != nil {
			t.Fatalf("Verify after the printed fixes: %v", err)
		}
		if got := count(t, db, table, ""); got != 2 {
			t.Errorf("rows after the fixes = %d, want 2", got)
		}
	})
}

// A case-folding MariaDB table is refused; fixed as printed, six distinct ids make six handler calls.
func TestVerify_caseFoldingTableRefusedThenEveryIdProcessed(t *testing.T) {
	t.Parallel()
	db := testdb.OpenMySQL(t, "")
	table := "inbox_" + randomSuffix()
	dropLater(t, db, table)
	exec(t, db, expand(`CREATE TABLE {t} (
		consumer     varchar(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_general_ci NOT NULL,
		message_id   varchar(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_general_ci NOT NULL,
		processed_at datetime(6) NOT NULL,
		PRIMARY KEY (consumer, message_id),
		INDEX {t}_processed_at_idx (processed_at)
	) ENGINE=InnoDB`, table))
	ib := verifyInbox(t, db, inbox.MySQL, table)

	err := ib.Verify(context.Background())
	if !errors.Is(err, inbox.ErrIncompatibleTable) || !strings.Contains(err.Error(), `"utf8mb4_general_ci"`) {
		t.Fatalf("Verify: %v, want ErrIncompatibleTable naming utf8mb4_general_ci", err)
	}
	applyFixes(t, db, err)
	if err := ib.Verify(context.Background()); err != nil {
		t.Fatalf("Verify after the printed fixes: %v", err)
	}

	var c calls
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(ib.Middleware)
		r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
			c.inc(msg.UUID)
			return nil
		})
	})
	ids := []string{"Order-1", "order-1", "ORDER-1", "order-1 ", "ördér-1", "order-1\t"}
	for _, id := range ids {
		if !in.deliver(t, message.NewMessage(id, nil)) {
			t.Fatalf("message %q nacked", id)
		}
	}
	for _, id := range ids {
		if got := c.get(id); got != 1 {
			t.Errorf("handler calls for %q = %d, want 1", id, got)
		}
	}
	if got := count(t, db, table, ""); got != len(ids) {
		t.Errorf("inbox rows = %d, want %d", got, len(ids))
	}
}

// badTable is a hand-made inbox table Verify must refuse.
type badTable struct {
	name    string
	setup   func(t *testing.T, db *sqlx.DB, table string) // optional: objects the DDL needs; may skip
	ddl     []string                                      // {t} is the table name
	mention []string                                      // what the error must name
	fix     string                                        // a fix the error must contain; {t} is the table name
}

const (
	pgKeyFix = `ALTER TABLE "{t}" ALTER COLUMN message_id TYPE text COLLATE "C"`
	myKeyFix = "ALTER TABLE `{t}` MODIFY message_id varbinary(255) NOT NULL"
	sqRename = `ALTER TABLE "{t}" RENAME TO "{t}_old";`
)

// pgTable and myTable are the canonical columns with the key column
// message_id of type keyType, then the rest of the CREATE TABLE (on MySQL
// the server's default engine, InnoDB).
func pgTable(keyType, rest string) string {
	return "CREATE TABLE {t} (consumer text NOT NULL, message_id " + keyType + " NOT NULL, " +
		"processed_at timestamptz NOT NULL, " + rest + ")"
}

func myTable(keyType, rest string) string {
	return "CREATE TABLE {t} (consumer varbinary(255) NOT NULL, message_id " + keyType + " NOT NULL, " +
		"processed_at datetime(6) NOT NULL, " + rest + ")"
}

const (
	pgRest = "PRIMARY KEY (consumer, message_id)"
	myRest = "PRIMARY KEY (consumer, message_id), INDEX (processed_at)"
	pgIdx  = "CREATE INDEX {t}_pidx ON {t} (processed_at)"
)

var badTables = map[string][]badTable{
	"postgres": {
		{name: "char(255) key pads", ddl: []string{pgTable("char(255)", pgRest), pgIdx},
			mention: []string{`"message_id"`, `"character(255)"`}, fix: pgKeyFix},
		{name: "varchar(36) key rejects long ids", ddl: []string{pgTable("varchar(36)", pgRest), pgIdx},
			mention: []string{`"message_id"`, `"character varying(36)"`}, fix: pgKeyFix},
		{name: "citext key folds case", setup: needCitext, ddl: []string{pgTable("citext", pgRest), pgIdx},
			mention: []string{`"message_id"`, `"citext"`}, fix: pgKeyFix},
		{name: "nondeterministic collation", setup: needICUCollation,
			ddl:     []string{pgTable(`text COLLATE "{t}_ci"`, pgRest), pgIdx},
			mention: []string{`"message_id"`, `nondeterministic`}, fix: pgKeyFix},
		{name: "domain key", setup: needDomain, ddl: []string{pgTable(`"{t}_id"`, pgRest), pgIdx},
			mention: []string{`"message_id"`, "domain"}, fix: pgKeyFix},
		{name: "integer key", ddl: []string{pgTable("bigint", pgRest), pgIdx},
			mention: []string{`"message_id"`, `"bigint"`}, fix: pgKeyFix},
		{name: "unique index instead of primary key", ddl: []string{pgTable("text", "UNIQUE (consumer, message_id)"), pgIdx},
			mention: []string{"no primary key"}, fix: `ALTER TABLE "{t}" ADD PRIMARY KEY (consumer, message_id)`},
		{name: "primary key in the wrong order", ddl: []string{pgTable("text", "PRIMARY KEY (message_id, consumer)"), pgIdx},
			mention: []string{`"message_id", "consumer"`},
			fix:     `ALTER TABLE "{t}" DROP CONSTRAINT {t}_pkey, ADD PRIMARY KEY (consumer, message_id)`},
		{name: "deferrable primary key", ddl: []string{pgTable("text", pgRest+" DEFERRABLE"), pgIdx},
			mention: []string{"DEFERRABLE"},
			fix:     `ALTER TABLE "{t}" DROP CONSTRAINT {t}_pkey, ADD PRIMARY KEY (consumer, message_id)`},
		{name: "timestamp without time zone", ddl: []string{
			"CREATE TABLE {t} (consumer text NOT NULL, message_id text NOT NULL, processed_at timestamp NOT NULL, " + pgRest + ")", pgIdx},
			mention: []string{`"processed_at"`, "time zone"}, fix: `ALTER TABLE "{t}" ALTER COLUMN processed_at TYPE timestamptz`},
		{name: "no purge index", ddl: []string{pgTable("text", pgRest)},
			mention: []string{`"processed_at"`}, fix: `CREATE INDEX IF NOT EXISTS "{t}_processed_at_idx" ON "{t}" (processed_at)`},
		{name: "purge index not led by processed_at", ddl: []string{pgTable("text", pgRest), "CREATE INDEX {t}_pidx ON {t} (consumer, processed_at)"},
			mention: []string{`"processed_at"`}, fix: `CREATE INDEX IF NOT EXISTS "{t}_processed_at_idx" ON "{t}" (processed_at)`},
		{name: "NOT NULL extra column", ddl: []string{pgTable("text", "tenant text NOT NULL, "+pgRest), pgIdx},
			mention: []string{`"tenant"`}, fix: `ALTER TABLE "{t}" ALTER COLUMN tenant DROP NOT NULL`},
		{name: "partitioned table", ddl: []string{"CREATE TABLE {t} (consumer text NOT NULL, message_id text NOT NULL, " +
			"processed_at timestamptz NOT NULL, PRIMARY KEY (consumer, message_id, processed_at)) PARTITION BY RANGE (processed_at)"},
			mention: []string{"partitioned"}, fix: "set Config.Dialect to inbox.PostgreSQLPartitioned"},
	},
	"postgres-partitioned": {
		{name: "plain table", ddl: []string{pgTable("text", pgRest), pgIdx},
			mention: []string{"not partitioned"}, fix: `ALTER TABLE "{t}" RENAME TO "{t}_old";`},
		{name: "partitioned by consumer", ddl: []string{pgTable("text", "PRIMARY KEY (consumer, message_id, processed_at)") +
			" PARTITION BY RANGE (consumer)"},
			mention: []string{`"consumer"`, `"processed_at"`}, fix: `ALTER TABLE "{t}" RENAME TO "{t}_old";`},
		{name: "citext key folds case", setup: needCitext,
			ddl:     []string{pgTable("citext", "PRIMARY KEY (consumer, message_id, processed_at)") + " PARTITION BY RANGE (processed_at)"},
			mention: []string{`"message_id"`, `"citext"`}, fix: pgKeyFix},
		{name: "timestamp without time zone", ddl: []string{
			"CREATE TABLE {t} (consumer text NOT NULL, message_id text NOT NULL, processed_at timestamp NOT NULL, " +
				"PRIMARY KEY (consumer, message_id, processed_at)) PARTITION BY RANGE (processed_at)"},
			mention: []string{`"processed_at"`, "time zone"}, fix: `ALTER TABLE "{t}" RENAME TO "{t}_old";`},
		{name: "primary key with another column", ddl: []string{
			"CREATE TABLE {t} (consumer text NOT NULL, message_id text NOT NULL, processed_at timestamptz NOT NULL, tenant int NOT NULL DEFAULT 0, " +
				"PRIMARY KEY (consumer, message_id, processed_at, tenant)) PARTITION BY RANGE (processed_at)"},
			mention: []string{`"tenant"`},
			fix:     `ALTER TABLE "{t}" DROP CONSTRAINT {t}_pkey, ADD PRIMARY KEY (consumer, message_id, processed_at)`},
	},
	"mysql": {
		{name: "utf8mb4_general_ci folds case and accents", ddl: []string{myTable("varchar(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_general_ci", myRest)},
			mention: []string{`"message_id"`, `"utf8mb4_general_ci"`}, fix: myKeyFix},
		{name: "utf8mb4_bin pads spaces", ddl: []string{myTable("varchar(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin", myRest)},
			mention: []string{`"message_id"`, `"utf8mb4_bin"`, "PAD SPACE"}, fix: myKeyFix},
		{name: "utf8mb4_unicode_ci expands letters", ddl: []string{myTable("varchar(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci", myRest)},
			mention: []string{`"message_id"`, `"utf8mb4_unicode_ci"`, "case-insensitively"}, fix: myKeyFix},
		{name: "utf8mb3 cannot hold every id", ddl: []string{myTable("varchar(255) CHARACTER SET utf8mb3 COLLATE utf8mb3_nopad_bin", myRest)},
			mention: []string{`"message_id"`, `"utf8mb3"`}, fix: myKeyFix},
		{name: "latin1 cannot hold every id", ddl: []string{myTable("varchar(255) CHARACTER SET latin1 COLLATE latin1_nopad_bin", myRest)},
			mention: []string{`"message_id"`, `"latin1"`}, fix: myKeyFix},
		{name: "varchar(36) truncates", ddl: []string{myTable("varchar(36) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin", myRest)},
			mention: []string{`"message_id"`, `"varchar(36)"`}, fix: myKeyFix},
		{name: "varbinary(36) truncates", ddl: []string{myTable("varbinary(36)", myRest)},
			mention: []string{`"message_id"`, `"varbinary(36)"`}, fix: myKeyFix},
		{name: "binary(255) pads", ddl: []string{myTable("binary(255)", myRest)},
			mention: []string{`"message_id"`, `"binary(255)"`}, fix: myKeyFix},
		{name: "blob key is a prefix", ddl: []string{myTable("blob", "PRIMARY KEY (consumer, message_id(200)), INDEX (processed_at)")},
			mention: []string{`"message_id"`, `"blob"`, `"message_id"(200)`}, fix: myKeyFix},
		{name: "primary key prefix", ddl: []string{myTable("varbinary(255)", "PRIMARY KEY (consumer, message_id(100)), INDEX (processed_at)")},
			mention: []string{`"message_id"(100)`, "prefix"}, fix: "ALTER TABLE `{t}` DROP PRIMARY KEY, ADD PRIMARY KEY (consumer, message_id)"},
		{name: "MyISAM has no transactions", ddl: []string{myTable("varbinary(255)", myRest) + " ENGINE=MyISAM"},
			mention: []string{`"MyISAM"`}, fix: "ALTER TABLE `{t}` ENGINE=InnoDB"},
		{name: "system-versioned table keeps every deleted row", ddl: []string{myTable("varbinary(255)", myRest) + " WITH SYSTEM VERSIONING"},
			mention: []string{`"SYSTEM VERSIONED"`, "ErrUnexpectedRowsAffected"}, fix: "ALTER TABLE `{t}` DROP SYSTEM VERSIONING"},
		{name: "unique index instead of primary key", ddl: []string{myTable("varbinary(255)", "UNIQUE KEY uniq (consumer, message_id), INDEX (processed_at)")},
			mention: []string{"no primary key", "gap locks"}, fix: "ALTER TABLE `{t}` DROP INDEX `uniq`, ADD PRIMARY KEY (consumer, message_id)"},
		{name: "primary key in the wrong order", ddl: []string{myTable("varbinary(255)", "PRIMARY KEY (message_id, consumer), INDEX (processed_at)")},
			mention: []string{`"message_id", "consumer"`}, fix: "ALTER TABLE `{t}` DROP PRIMARY KEY, ADD PRIMARY KEY (consumer, message_id)"},
		{name: "timestamp processed_at", ddl: []string{
			"CREATE TABLE {t} (consumer varbinary(255) NOT NULL, message_id varbinary(255) NOT NULL, processed_at timestamp(6) NOT NULL, " + myRest + ")"},
			mention: []string{`"processed_at"`, "time zone"}, fix: "ALTER TABLE `{t}` MODIFY processed_at datetime(6) NOT NULL"},
		{name: "datetime(0) processed_at", ddl: []string{
			"CREATE TABLE {t} (consumer varbinary(255) NOT NULL, message_id varbinary(255) NOT NULL, processed_at datetime NOT NULL, " + myRest + ")"},
			mention: []string{`"processed_at"`, "1 microsecond"}, fix: "ALTER TABLE `{t}` MODIFY processed_at datetime(6) NOT NULL"},
		{name: "no purge index", ddl: []string{myTable("varbinary(255)", "PRIMARY KEY (consumer, message_id)")},
			mention: []string{`"processed_at"`}, fix: "CREATE INDEX `{t}_processed_at_idx` ON `{t}` (processed_at)"},
		{name: "NOT NULL extra column", ddl: []string{myTable("varbinary(255)", "tenant int NOT NULL, "+myRest)},
			mention: []string{`"tenant"`}, fix: "ALTER TABLE `{t}` MODIFY `tenant` int"},
	},
	"sqlite": {
		{name: "NOCASE key column", ddl: []string{`CREATE TABLE {t} (consumer TEXT NOT NULL, message_id TEXT NOT NULL COLLATE NOCASE,
			processed_at INTEGER NOT NULL, PRIMARY KEY (consumer, message_id)) WITHOUT ROWID`, sqIdx},
			mention: []string{`"message_id"`, `"NOCASE"`}, fix: sqRename},
		{name: "RTRIM primary key", ddl: []string{`CREATE TABLE {t} (consumer TEXT NOT NULL, message_id TEXT NOT NULL,
			processed_at INTEGER NOT NULL, PRIMARY KEY (consumer, message_id COLLATE RTRIM))`, sqIdx},
			mention: []string{`"message_id"`, `"RTRIM"`}, fix: sqRename},
		{name: "INTEGER key", ddl: []string{`CREATE TABLE {t} (consumer TEXT NOT NULL, message_id INTEGER NOT NULL,
			processed_at INTEGER NOT NULL, PRIMARY KEY (consumer, message_id))`, sqIdx},
			mention: []string{`"message_id"`, `"INTEGER"`}, fix: sqRename},
		{name: "untyped key", ddl: []string{`CREATE TABLE {t} (consumer TEXT NOT NULL, message_id NOT NULL,
			processed_at INTEGER NOT NULL, PRIMARY KEY (consumer, message_id))`, sqIdx},
			mention: []string{`"message_id"`, "BLOB"}, fix: sqRename},
		{name: "nullable key", ddl: []string{`CREATE TABLE {t} (consumer TEXT NOT NULL, message_id TEXT,
			processed_at INTEGER NOT NULL, PRIMARY KEY (consumer, message_id))`, sqIdx},
			mention: []string{`"message_id"`, "nullable"}, fix: sqRename},
		{name: "unique index instead of primary key", ddl: []string{`CREATE TABLE {t} (consumer TEXT NOT NULL, message_id TEXT NOT NULL,
			processed_at INTEGER NOT NULL, UNIQUE (consumer, message_id))`, sqIdx},
			mention: []string{"no primary key"}, fix: sqRename},
		{name: "text processed_at", ddl: []string{`CREATE TABLE {t} (consumer TEXT NOT NULL, message_id TEXT NOT NULL,
			processed_at TEXT NOT NULL, PRIMARY KEY (consumer, message_id))`, sqIdx},
			mention: []string{`"processed_at"`, "INTEGER"}, fix: sqRename},
		{name: "no purge index", ddl: []string{`CREATE TABLE {t} (consumer TEXT NOT NULL, message_id TEXT NOT NULL,
			processed_at INTEGER NOT NULL, PRIMARY KEY (consumer, message_id))`},
			mention: []string{`"processed_at"`}, fix: `CREATE INDEX IF NOT EXISTS "{t}_processed_at_idx" ON "{t}" (processed_at)`},
		{name: "partial purge index", ddl: []string{`CREATE TABLE {t} (consumer TEXT NOT NULL, message_id TEXT NOT NULL,
			processed_at INTEGER NOT NULL, PRIMARY KEY (consumer, message_id))`, sqIdx + " WHERE processed_at > 0"},
			mention: []string{`"processed_at"`}, fix: `CREATE INDEX IF NOT EXISTS "{t}_processed_at_idx" ON "{t}" (processed_at)`},
		{name: "NOT NULL extra column", ddl: []string{`CREATE TABLE {t} (consumer TEXT NOT NULL, message_id TEXT NOT NULL,
			processed_at INTEGER NOT NULL, tenant TEXT NOT NULL, PRIMARY KEY (consumer, message_id))`, sqIdx},
			mention: []string{`"tenant"`}, fix: sqRename},
	},
}

const sqIdx = "CREATE INDEX {t}_pidx ON {t} (processed_at)"

func init() { badTables["mysql-clientFoundRows"] = badTables["mysql"] }

// expand replaces {t} in s with table.
func expand(s, table string) string { return strings.ReplaceAll(s, "{t}", table) }

// verifyInbox returns an inbox on table for dialect d, without touching the database.
func verifyInbox(t *testing.T, db *sqlx.DB, d inbox.Dialect, table string) *inbox.Inbox {
	t.Helper()
	ib, err := inbox.New(inbox.Config{DB: db, Dialect: d, Table: table, Consumer: "billing"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ib.Close() })
	return ib
}

// currentSchema is the schema (PostgreSQL), database (MySQL) or attached
// database (SQLite) an unqualified table name resolves to.
func currentSchema(t *testing.T, db *sqlx.DB, d inbox.Dialect) string {
	t.Helper()
	query := map[inbox.Dialect]string{inbox.PostgreSQL: "SELECT current_schema()", inbox.PostgreSQLPartitioned: "SELECT current_schema()",
		inbox.MySQL: "SELECT DATABASE()", inbox.SQLite: "SELECT 'main'"}[d]
	var s string
	if err := db.Get(&s, query); err != nil {
		t.Fatal(err)
	}
	return s
}

// applySchemaSQL creates table by hand from SchemaSQL, statement by statement.
func applySchemaSQL(t *testing.T, db *sqlx.DB, d inbox.Dialect, table string) {
	t.Helper()
	ddl, err := inbox.SchemaSQL(d, table)
	if err != nil {
		t.Fatal(err)
	}
	for _, stmt := range statements(ddl) {
		exec(t, db, stmt)
	}
}

// applyFixes runs every fix the error of Verify prints: first the scripts,
// each on one connection, then the one-line fixes in order.
func applyFixes(t *testing.T, db *sqlx.DB, verr error) {
	t.Helper()
	text, _, _ := strings.Cut(verr.Error(), "\ncanonical DDL for comparison:\n")
	var oneLine, scripts []string
	for _, line := range strings.Split(text, "\n") {
		switch _, fix, ok := strings.Cut(line, "; fix: "); {
		case strings.HasPrefix(line, "script ") && strings.HasSuffix(line, ":"):
			scripts = append(scripts, "")
		case len(scripts) > 0:
			scripts[len(scripts)-1] += line + "\n"
		case ok && !strings.HasPrefix(fix, "script "):
			oneLine = append(oneLine, fix)
		}
	}
	var fixes [][]string
	for _, script := range scripts {
		fixes = append(fixes, statements(script))
	}
	for _, fix := range oneLine {
		fixes = append(fixes, []string{fix})
	}
	if len(fixes) == 0 {
		t.Fatalf("no fix in the error:\n%v", verr)
	}
	ctx := context.Background()
	for _, stmts := range fixes {
		conn, err := db.Connx(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, stmt := range stmts {
			if _, err := conn.ExecContext(ctx, stmt); err != nil {
				conn.Close()
				t.Fatalf("fix %s: %v\nerror was:\n%v", stmt, err, verr)
			}
		}
		conn.Close()
	}
}

// needCitext creates the citext extension, or skips the test when the
// server cannot.
func needCitext(t *testing.T, db *sqlx.DB, _ string) {
	citextOnce.Do(func() {
		_, citextErr = db.Exec("CREATE EXTENSION IF NOT EXISTS citext")
	})
	if citextErr != nil {
		t.Skipf("citext extension not available: %v", citextErr)
	}
}

var (
	citextOnce sync.Once
	citextErr  error
)

// needDomain creates the domain "<table>_id" over text, dropped after the
// table.
func needDomain(t *testing.T, db *sqlx.DB, table string) {
	name := table + "_id"
	exec(t, db, `CREATE DOMAIN "`+name+`" AS text`)
	t.Cleanup(func() {
		if _, err := db.Exec(`DROP DOMAIN IF EXISTS "` + name + `"`); err != nil {
			t.Logf("drop domain %s: %v", name, err)
		}
	})
}

// needICUCollation creates the nondeterministic, case-insensitive ICU
// collation "<table>_ci", dropped after the table, or skips the test when
// the server has no ICU.
func needICUCollation(t *testing.T, db *sqlx.DB, table string) {
	name := table + "_ci"
	_, err := db.Exec(`CREATE COLLATION "` + name + `" (provider = icu, locale = 'und-u-ks-level2', deterministic = false)`)
	if err != nil {
		t.Skipf("no ICU collation: %v", err)
	}
	t.Cleanup(func() {
		if _, err := db.Exec(`DROP COLLATION IF EXISTS "` + name + `"`); err != nil {
			t.Logf("drop collation %s: %v", name, err)
		}
	})
}

// A router with the inbox's RouterPlugin does not start when the table is
// missing: router.Run returns ErrTableNotFound before any handler consumes,
// instead of a router that nacks every message.
func TestRouterPlugin_MissingTableStopsTheRouter(t *testing.T) {
	db := openSQLite(t, filepath.Join(t.TempDir(), "plugin.db"))
	ib, err := inbox.New(inbox.Config{DB: db, Table: "never_created"})
	if err != nil {
		t.Fatal(err)
	}
	r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	in := newFeed()
	var calls atomic.Int32
	r.AddConsumerHandler("billing", "orders", in, func(*message.Message) error { calls.Add(1); return nil })
	r.AddMiddleware(ib.Middleware)
	r.AddPlugin(ib.RouterPlugin)
	err = r.Run(context.Background())
	if !errors.Is(err, inbox.ErrTableNotFound) {
		t.Errorf("router.Run = %v, want an error wrapping ErrTableNotFound", err)
	}
	if inbox.IsTransient(err) {
		t.Errorf("IsTransient(%v) = true: a missing table is no reason to redeliver", err)
	}
	if calls.Load() != 0 {
		t.Errorf("%d handler calls", calls.Load())
	}

	// With the table, the same setup runs.
	if err := ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	runRouter(t, func(r *message.Router) {
		r.AddConsumerHandler("billing", "orders", in, func(*message.Message) error { calls.Add(1); return nil })
		r.AddMiddleware(ib.Middleware)
		r.AddPlugin(ib.RouterPlugin)
	})
	if !in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) || calls.Load() != 1 {
		t.Errorf("after InitializeSchema: want the message acked after one handler call, got %d calls", calls.Load())
	}
}

// Without the plugin, the middleware refuses to claim in a missing table:
// every message is nacked with an error wrapping ErrTableNotFound, in one
// line, and nothing is written.
func TestMiddleware_MissingTableIsRefusedBeforeTheClaim(t *testing.T) {
	db := openSQLite(t, filepath.Join(t.TempDir(), "missing.db"))
	ib, err := inbox.New(inbox.Config{DB: db, Table: "never_created"})
	if err != nil {
		t.Fatal(err)
	}
	rec := &recorder{}
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(rec.Middleware, ib.Middleware)
		r.AddConsumerHandler("billing", "orders", in, func(*message.Message) error { return nil })
	})
	if in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
		t.Fatal("acked without an inbox table")
	}
	if err := rec.last(); !errors.Is(err, inbox.ErrTableNotFound) || strings.Contains(err.Error(), "\n") {
		t.Errorf("error %q: want one line wrapping ErrTableNotFound", err)
	}
}

// Objects besides the columns and the primary key that make a claim merge,
// drop or reject ids, or a purge fail or reach other rows, are refused on a
// table that is otherwise canonical, and the printed fixes remove them: a
// second unique index (MariaDB's ON DUPLICATE KEY UPDATE fires on it, so a
// unique message_id made a second consumer skip every message; PostgreSQL's
// ON CONFLICT takes a folding one as an arbiter), a trigger (it can drop or
// rewrite the row), a rule, a CHECK constraint, a foreign key to the table,
// an UNLOGGED table, child tables, a BRIN purge index instead of a btree
// (the batches read and sorted every expired row left); on a partitioned
// table, a trigger, a
// CHECK constraint or UNLOGGED on one partition.
func TestVerify_refusesObjectsThatChangeTheClaimOrThePurge(t *testing.T) {
	t.Parallel()
	objects := map[string]map[string][]string{
		"postgres": {
			"unique message_id": {"CREATE UNIQUE INDEX {t}_mid ON {t} (message_id)"},
			"trigger": {"CREATE FUNCTION {t}_lower() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN NEW.message_id := lower(NEW.message_id); RETURN NEW; END $$",
				"CREATE TRIGGER {t}_lower BEFORE INSERT ON {t} FOR EACH ROW EXECUTE FUNCTION {t}_lower()"},
			"rule":        {"CREATE RULE {t}_drop AS ON INSERT TO {t} WHERE NEW.message_id LIKE 'x%' DO INSTEAD NOTHING"},
			"CHECK":       {"ALTER TABLE {t} ADD CONSTRAINT {t}_len CHECK (length(message_id) < 40)"},
			"exclusion":   {"ALTER TABLE {t} ADD CONSTRAINT {t}_ex EXCLUDE USING btree (message_id WITH =)"},
			"foreign key": {"CREATE TABLE {t}_ref (c text, m text, FOREIGN KEY (c, m) REFERENCES {t} (consumer, message_id))"},
			"UNLOGGED":    {"ALTER TABLE {t} SET UNLOGGED"},
			"inherit":     {"CREATE TABLE {t}_archive () INHERITS ({t})"},
			// It cannot give the purge's batches their oldest rows in order.
			"BRIN purge index": {"DROP INDEX {t}_processed_at_idx", "CREATE INDEX {t}_brin ON {t} USING brin (processed_at)"},
		},
		// On one partition only: a trigger there that returns NULL drops
		// the claim's row, and the message was acked unprocessed.
		"postgres-partitioned": {
			"trigger on a partition": {"CREATE TABLE {t}_future PARTITION OF {t} FOR VALUES FROM ('2099-01-01 00:00:00Z') TO ('2099-01-08 00:00:00Z')",
				"CREATE FUNCTION {t}_lower() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END $$",
				"CREATE TRIGGER {t}_drop BEFORE INSERT ON {t}_future FOR EACH ROW EXECUTE FUNCTION {t}_lower()"},
			"CHECK on a partition": {"CREATE TABLE {t}_future PARTITION OF {t} FOR VALUES FROM ('2099-01-01 00:00:00Z') TO ('2099-01-08 00:00:00Z')",
				"ALTER TABLE {t}_future ADD CONSTRAINT {t}_len CHECK (length(message_id) < 40)"},
			"UNLOGGED partition": {"CREATE UNLOGGED TABLE {t}_future PARTITION OF {t} FOR VALUES FROM ('2099-01-01 00:00:00Z') TO ('2099-01-08 00:00:00Z')"},
			"unique index on a partition": {"CREATE TABLE {t}_future PARTITION OF {t} FOR VALUES FROM ('2099-01-01 00:00:00Z') TO ('2099-01-08 00:00:00Z')",
				"CREATE UNIQUE INDEX {t}_mid ON {t}_future (message_id)"},
			"foreign key from a partition": {"CREATE TABLE {t}_ref (m text PRIMARY KEY)",
				"CREATE TABLE {t}_future PARTITION OF {t} FOR VALUES FROM ('2099-01-01 00:00:00Z') TO ('2099-01-08 00:00:00Z')",
				"ALTER TABLE {t}_future ADD CONSTRAINT {t}_fk FOREIGN KEY (message_id) REFERENCES {t}_ref (m)"},
			"foreign key to a partition": {"CREATE TABLE {t}_future PARTITION OF {t} FOR VALUES FROM ('2099-01-01 00:00:00Z') TO ('2099-01-08 00:00:00Z')",
				"CREATE TABLE {t}_ref (c text, m text, p timestamptz, FOREIGN KEY (c, m, p) REFERENCES {t}_future (consumer, message_id, processed_at))"},
		},
		"mysql": {
			"unique message_id": {"CREATE UNIQUE INDEX {t}_mid ON {t} (message_id)"},
			"trigger":           {"CREATE TRIGGER {t}_lower BEFORE INSERT ON {t} FOR EACH ROW SET NEW.message_id = LOWER(NEW.message_id)"},
			"CHECK":             {"ALTER TABLE {t} ADD CONSTRAINT {t}_len CHECK (length(message_id) < 40)"},
			"foreign key":       {"CREATE TABLE {t}_ref (c varbinary(255), m varbinary(255), FOREIGN KEY (c, m) REFERENCES {t} (consumer, message_id) ON DELETE CASCADE) ENGINE=InnoDB"},
		},
		"sqlite": {
			"unique NOCASE": {"CREATE UNIQUE INDEX {t}_nocase ON {t} (consumer, message_id COLLATE NOCASE)"},
			"trigger":       {"CREATE TRIGGER {t}_ignore BEFORE INSERT ON {t} WHEN NEW.message_id LIKE 'x%' BEGIN SELECT RAISE(IGNORE); END"},
		},
	}
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		name := tdb.Name
		if name == "mysql-clientFoundRows" {
			name = "mysql"
		}
		for what, ddl := range objects[name] {
			t.Run(what, func(t *testing.T) {
				table := "inbox_" + randomSuffix()
				t.Cleanup(func() {
					for _, suffix := range []string{"_ref", "_archive", ""} {
						drop := "DROP TABLE IF EXISTS " + table + suffix
						if isPostgres(tdb.Dialect) {
							drop += " CASCADE"
						}
						db.Exec(drop)
					}
					if isPostgres(tdb.Dialect) {
						db.Exec("DROP FUNCTION IF EXISTS " + table + "_lower()")
					}
				})
				ib := verifyInbox(t, db, tdb.Dialect, table)
				if err := ib.InitializeSchema(context.Background()); err != nil {
					t.Fatal(err)
				}
				for _, stmt := range ddl {
					exec(t, db, expand(stmt, table))
				}
				err := ib.Verify(context.Background())
				if !errors.Is(err, inbox.ErrIncompatibleTable) {
					t.Fatalf("Verify with a %s: %v, want ErrIncompatibleTable", what, err)
				}
				applyFixes(t, db, err)
				if err := ib.Verify(context.Background()); err != nil {
					t.Errorf("Verify after the printed fixes: %v", err)
				}
			})
		}
	})
}

// A dialect for another database server than the one DB reaches passes New,
// and is then refused with ErrDialectMismatch, naming the dialect, the
// server found and the fix, by Verify, by RouterPlugin (router.Run fails),
// by InitializeSchema and by the middleware's first message (the handler is
// not called, nothing is written), instead of a syntax error per message.
func TestDialect_mismatchWithServerIsRefused(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		open    func(t *testing.T) *sqlx.DB
		dialect inbox.Dialect // nil: inferred from the driver name open gives
		want    []string      // in the error's text
	}{
		{"postgres opened as mysql", func(t *testing.T) *sqlx.DB {
			return sqlx.NewDb(testdb.OpenPostgres(t, "").DB, "mysql")
		}, nil, []string{`dialect is mysql (inferred from DB's driver name "mysql"), which is for MySQL/MariaDB`, "is PostgreSQL (version ", "inbox.PostgreSQL", `"pgx"`}},
		{"postgres opened as sqlite3", func(t *testing.T) *sqlx.DB {
			return sqlx.NewDb(testdb.OpenPostgres(t, "").DB, "sqlite3")
		}, nil, []string{`dialect is sqlite (inferred from DB's driver name "sqlite3"`, "is PostgreSQL", "inbox.PostgreSQL"}},
		{"mysql with PostgreSQL", func(t *testing.T) *sqlx.DB { return testdb.OpenMySQL(t, "") },
			inbox.PostgreSQL, []string{"dialect is postgres (Config.Dialect", "is MySQL/MariaDB (version ", "inbox.MySQL", `"mysql"`}},
		{"mysql with SQLite", func(t *testing.T) *sqlx.DB { return testdb.OpenMySQL(t, "") },
			inbox.SQLite, []string{"dialect is sqlite (Config.Dialect", "is MySQL/MariaDB (version ", "inbox.MySQL"}},
		{"sqlite with MySQL", sqliteDB, inbox.MySQL, []string{"dialect is mysql (Config.Dialect", "is SQLite (version 3.", "inbox.SQLite", `"sqlite"`}},
		{"sqlite with PostgreSQL", sqliteDB, inbox.PostgreSQL, []string{"dialect is postgres (Config.Dialect", "is SQLite", "inbox.SQLite"}},
		{"sqlite with PostgreSQLPartitioned", sqliteDB, inbox.PostgreSQLPartitioned, []string{"dialect is postgres-partitioned", "is SQLite"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			db := tc.open(t)
			table := "inbox_" + randomSuffix()
			ib, err := inbox.New(inbox.Config{DB: db, Dialect: tc.dialect, Table: table})
			if err != nil {
				t.Fatalf("New: %v", err) // New does not touch the database
			}
			ctx := context.Background()
			check := func(what string, err error) {
				t.Helper()
				if !errors.Is(err, inbox.ErrDialectMismatch) {
					t.Fatalf("%s: got %v, want ErrDialectMismatch", what, err)
				}
				for _, w := range tc.want {
					if !strings.Contains(err.Error(), w) {
						t.Errorf("%s: %q does not say %q", what, err, w)
					}
				}
				// At startup it stops the process; per message it is, like a
				// missing table, nothing about the message: transient, so a
				// poison filter keeps the topic until the setup is fixed.
				if transient := what == "middleware"; inbox.IsTransient(err) != transient {
					t.Errorf("%s: IsTransient(%v) = %v, want %v", what, err, !transient, transient)
				}
			}

			var called atomic.Int32
			rec := &recorder{}
			f := newFeed()
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(rec.Middleware, ib.Middleware)
				r.AddConsumerHandler("h", "topic", f, func(*message.Message) error {
					called.Add(1)
					return nil
				})
			})
			if f.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
				t.Fatal("the message was acked")
			}
			check("middleware", rec.last())
			if n := called.Load(); n != 0 {
				t.Fatalf("handler called %d times", n)
			}

			check("Verify", ib.Verify(ctx))
			check("InitializeSchema", ib.InitializeSchema(ctx))

			r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
			if err != nil {
				t.Fatal(err)
			}
			r.AddPlugin(ib.RouterPlugin)
			check("router.Run with RouterPlugin", r.Run(ctx))
		})
	}
}

// The middleware checks the dialect against the server once per Inbox: a
// matching server costs one query on the first message and none after.
func TestDialect_serverCheckedOncePerInbox(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "inbox.db")
	plain := testdb.OpenSQLite(t, path)
	log := &statementLog{}
	db := openRecording(t, plain.Driver(), "file:"+path+"?"+testdb.SQLiteParams, "sqlite", log)
	f := newFixture(t, db)
	ib := f.newInbox(inbox.Config{})
	rec := &recorder{}
	feed := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(rec.Middleware, ib.Middleware)
		r.AddConsumerHandler("h", "topic", feed, func(msg *message.Message) error { return f.writeBusinessRow(msg) })
	})
	log.take() // InitializeSchema's
	probes := func() (n int) {
		for _, q := range log.take() {
			if strings.Contains(q, "version()") {
				n++
			}
		}
		return n
	}
	for i := range 3 {
		if !feed.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
			t.Fatalf("message %d nacked: %v", i, rec.last())
		}
		if n := probes(); n != 0 {
			t.Fatalf("message %d: %d server probes; the check of InitializeSchema must be kept", i, n)
		}
	}

	// A new Inbox on the same pool checks once, on its first message.
	ib2, err := inbox.New(inbox.Config{DB: db, Table: f.inbox, Consumer: "other"})
	if err != nil {
		t.Fatal(err)
	}
	feed2 := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(rec.Middleware, ib2.Middleware)
		r.AddConsumerHandler("h2", "topic", feed2, func(*message.Message) error { return nil })
	})
	for i := range 3 {
		if !feed2.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
			t.Fatalf("message %d nacked: %v", i, rec.last())
		}
		want := 0
		if i == 0 {
			want = 1
		}
		if n := probes(); n != want {
			t.Fatalf("message %d: %d server probes, want %d", i, n, want)
		}
	}
}

// A MariaDB system-versioned inbox table (WITH SYSTEM VERSIONING) is
// refused, and the fix printed makes it pass: it was accepted, and every
// redelivery of a processed message failed (its claim affected 3 rows:
// ErrUnexpectedRowsAffected, not transient, so the poison filter took the
// duplicates), while the purge's DELETE kept every row as history.
func TestVerifyRefusesASystemVersionedTableUntilItsFixIsApplied(t *testing.T) {
	db := testdb.OpenMySQL(t, "")
	table := "inbox_" + randomSuffix()
	dropLater(t, db, table)
	exec(t, db, expand(myTable("varbinary(255)", myRest)+" WITH SYSTEM VERSIONING", table))
	err := verifyInbox(t, db, inbox.MySQL, table).Verify(context.Background())
	if !errors.Is(err, inbox.ErrIncompatibleTable) {
		t.Fatalf("Verify: %v, want ErrIncompatibleTable", err)
	}
	exec(t, db, expand("ALTER TABLE `{t}` DROP SYSTEM VERSIONING", table))
	if err := verifyInbox(t, db, inbox.MySQL, table).Verify(context.Background()); err != nil {
		t.Fatalf("Verify after the fix: %v", err)
	}
}

// An Outbox whose dialect is for another database server than the one its
// DB reaches is refused with ErrDialectMismatch, naming both, by Verify
// (and so RouterPlugin), InitializeSchema, Stats, RequeueDeadLetters and
// the functions without an Outbox: the relay's catalog read took a table
// for present and the first statements failed with the driver's syntax
// errors.
func TestOutboxDialectMismatchWithServerIsRefused(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		open    func(t *testing.T) *sqlx.DB
		dialect inbox.Dialect // nil: inferred from the driver name open gives
		want    []string
	}{
		{"postgres opened as mysql", func(t *testing.T) *sqlx.DB {
			return sqlx.NewDb(testdb.OpenPostgres(t, "").DB, "mysql")
		}, nil, []string{`dialect is mysql (inferred from DB's driver name "mysql")`, "is PostgreSQL (version ", "set OutboxConfig.Dialect to inbox.PostgreSQL"}},
		{"mysql with PostgreSQL", func(t *testing.T) *sqlx.DB { return testdb.OpenMySQL(t, "") },
			inbox.PostgreSQL, []string{"dialect is postgres (OutboxConfig.Dialect", "is MySQL/MariaDB (version ", "set OutboxConfig.Dialect to inbox.MySQL"}},
		{"sqlite with MySQL", sqliteDB, inbox.MySQL, []string{"dialect is mysql (OutboxConfig.Dialect", "is SQLite (version 3.", "set OutboxConfig.Dialect to inbox.SQLite"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			db := tc.open(t)
			table := "outbox_" + randomSuffix()
			ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Dialect: tc.dialect, Table: table, Publisher: gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})})
			if err != nil {
				t.Fatalf("NewOutbox: %v", err) // it does not touch the database
			}
			ctx := context.Background()
			check := func(what string, err error) {
				t.Helper()
				if !errors.Is(err, inbox.ErrDialectMismatch) {
					t.Fatalf("%s: got %v, want ErrDialectMismatch", what, err)
				}
				for _, w := range tc.want {
					if !strings.Contains(err.Error(), w) {
						t.Errorf("%s: %q does not say %q", what, err, w)
					}
				}
			}
			check("Verify", ob.Verify(ctx))
			check("InitializeSchema", ob.InitializeSchema(ctx))
			_, err = ob.Stats(ctx)
			check("Stats", err)
			_, err = ob.RequeueDeadLetters(ctx, inbox.DeadLetterSelection{All: true})
			check("RequeueDeadLetters", err)
			_, err = inbox.ReadOutboxStats(ctx, db, tc.dialect, table)
			check("ReadOutboxStats", err)
			_, err = inbox.RequeueDeadLetters(ctx, db, tc.dialect, table, inbox.DeadLetterSelection{All: true})
			check("inbox.RequeueDeadLetters", err)
			r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
			if err != nil {
				t.Fatal(err)
			}
			r.AddPlugin(ob.RouterPlugin)
			check("router.Run with RouterPlugin", r.Run(ctx))
		})
	}
}
