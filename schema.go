package inbox

import (
	"context"
	"fmt"
	"hash/fnv"
	"strings"
	"time"

	"github.com/jmoiron/sqlx"
)

// SchemaSQL returns the DDL that creates the inbox table named table (empty:
// DefaultTable) and its purge index for dialect d, as one script of
// semicolon-terminated statements. For the default name it is byte for byte
// the content of schema/postgres.sql, schema/mysql.sql or schema/sqlite.sql
// (a test checks it): use it to write a migration for goose, golang-migrate
// or atlas when the table has another name. An invalid table name gives an
// error wrapping ErrInvalidTableName.
func SchemaSQL(d Dialect, table string) (string, error) {
	if d == nil {
		return "", fmt.Errorf("%w: nil dialect", ErrUnknownDialect)
	}
	if table == "" {
		table = DefaultTable
	}
	t, err := parseTableName(table)
	if err != nil {
		return "", err
	}
	var b strings.Builder
	fmt.Fprintf(&b, "-- Inbox table for github.com/watermill-inbox/inbox (%s).\n", d)
	notes := schemaNotes[d]
	if d == PostgreSQLPartitioned {
		p, _ := partitionName(t, time.Date(2026, 11, 29, 0, 0, 0, 0, time.UTC))
		notes += "-- Partition of one day: CREATE TABLE " + p.quoted(d) + " PARTITION OF " + t.quoted(d) + "\n" +
			"--   FOR VALUES FROM ('2026-11-29 00:00:00Z') TO ('2026-11-30 00:00:00Z');\n"
	}
	b.WriteString(notes)
	for _, stmt := range d.createSQL(t) {
		b.WriteString("\n")
		b.WriteString(stmt)
		b.WriteString(";\n")
	}
	return b.String(), nil
}

// schemaNotes are dialect-specific comment lines for SchemaSQL.
var schemaNotes = map[Dialect]string{
	PostgreSQL: "-- Primary key (consumer, message_id): the claim. Index on processed_at: the purge.\n" +
		"-- processed_at: the database clock (now()), an absolute instant.\n",
	PostgreSQLPartitioned: "-- Range-partitioned by UTC day on processed_at; partitions are created ahead by\n" +
		"-- InitializeSchema / CreatePartitions (or a Purger) and dropped by DropPartitions.\n" +
		"-- The primary key must include the partition key, so it guards one partition only:\n" +
		"-- the claim serialises each key with pg_advisory_xact_lock and checks every partition.\n",
	MySQL: "-- Primary key (consumer, message_id): the claim. Index on processed_at: the purge.\n" +
		"-- varbinary, not varchar: MySQL and MariaDB collations fold case or trailing spaces\n" +
		"-- (PAD SPACE, even utf8mb4_bin), and message ids must compare byte for byte.\n" +
		"-- processed_at: UTC_TIMESTAMP(6), UTC whatever the session time zone.\n",
	SQLite: "-- Primary key (consumer, message_id): the claim. Index on processed_at: the purge.\n" +
		"-- processed_at: Unix microseconds, UTC, from the database clock.\n",
}

func initializeSchema(ctx context.Context, db *sqlx.DB, d Dialect, t qualifiedName) error {
	// When the table and its index exist, run no DDL at all: on PostgreSQL
	// even CREATE INDEX IF NOT EXISTS takes a SHARE lock on the table, which
	// queues behind running handlers and stalls every new claim behind it,
	// and every dialect's CREATE needs privileges a least-privilege
	// application role may not have.
	var found int
	err := withReadTx(ctx, db, d, func(q sqlx.QueryerContext) (err error) {
		found, err = schemaObjects(ctx, q, d, t)
		return err
	})
	if err != nil {
		return fmt.Errorf("inbox: initialize schema of %s: check catalog: %w", t, err)
	}
	if found < 2 {
		if err := createSchema(ctx, db, d, t, found); err != nil {
			return err
		}
	}
	// A table someone else made (a migration, a DBA, a concurrent starter)
	// is used only once it is known not to merge or truncate ids.
	if err := verifySchema(ctx, db, d, t); err != nil {
		return fmt.Errorf("inbox: initialize schema of %s: %w", t, err)
	}
	return nil
}

// createSchema runs the DDL of d for t, of which found objects (see
// schemaObjects) already exist.
func createSchema(ctx context.Context, db *sqlx.DB, d Dialect, t qualifiedName, found int) error {
	stmts := d.createSQL(t)
	if d == MySQL && found == 1 {
		// The table exists without its purge index, and CREATE TABLE IF NOT
		// EXISTS would skip the inline index with the table. MySQL 8 has no
		// CREATE INDEX IF NOT EXISTS; a concurrent starter doing the same
		// fails with error 1061 (duplicate key name) and can simply retry.
		stmts = []string{"CREATE INDEX " + d.quote(t.indexName()) + " ON " + t.quoted(d) + " (processed_at)"}
	}
	if !isPostgres(d) {
		// MySQL: one CREATE TABLE IF NOT EXISTS (index inline), atomic under
		// the metadata lock. SQLite: each statement is atomic and the second
		// only creates the index; running them outside one transaction keeps
		// a concurrent starter from failing on a stale read snapshot.
		for _, stmt := range stmts {
			if _, err := db.ExecContext(ctx, stmt); err != nil {
				return fmt.Errorf("inbox: initialize schema of %s: %w", t, err)
			}
		}
		return nil
	}

	// PostgreSQL: concurrent CREATE TABLE IF NOT EXISTS of one name can fail
	// with a unique violation on pg_type; serialise starters on an advisory
	// lock that ends with the transaction (so it holds behind a
	// transaction-mode pooler), keyed by the name as resolved by the
	// database. DDL is transactional here.
	tx, err := db.BeginTxx(ctx, nil)
	if err != nil {
		return fmt.Errorf("inbox: initialize schema of %s: begin: %w", t, err)
	}
	defer tx.Rollback() //nolint:errcheck // after Commit it is a no-op returning ErrTxDone
	ct, err := canonicalTable(ctx, tx, d, t)
	if err != nil {
		return fmt.Errorf("inbox: initialize schema of %s: %w", t, err)
	}
	if _, err := tx.ExecContext(ctx, "SELECT pg_advisory_xact_lock($1)", schemaLockKey(ct)); err != nil {
		return fmt.Errorf("inbox: initialize schema of %s: lock: %w", t, err)
	}
	for _, stmt := range stmts {
		if _, err := tx.ExecContext(ctx, stmt); err != nil {
			return fmt.Errorf("inbox: initialize schema of %s: %w", t, err)
		}
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("inbox: initialize schema of %s: commit: %w", t, err)
	}
	return nil
}

// schemaLockKey is the PostgreSQL advisory lock key for creating table t.
func schemaLockKey(t qualifiedName) int64 {
	h := fnv.New64a()
	h.Write([]byte("watermill-inbox schema " + t.String()))
	return int64(h.Sum64())
}

// schemaObjects returns how many of the table and its purge index exist:
// 0, 1 (the table only) or 2.
func schemaObjects(ctx context.Context, q sqlx.QueryerContext, d Dialect, t qualifiedName) (int, error) {
	query, args := d.existsSQL(t)
	var n int
	err := sqlx.GetContext(ctx, q, &n, query, args...)
	return n, err
}
