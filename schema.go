package inbox

import (
	"context"
	"fmt"
	"hash/fnv"
	"strings"

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
	b.WriteString(d.schemaNotes(t))
	for _, stmt := range d.createSQL(t) {
		b.WriteString("\n")
		b.WriteString(stmt)
		b.WriteString(";\n")
	}
	return b.String(), nil
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
		if err := d.createSchema(ctx, db, t, found); err != nil {
			return err
		}
	}
	// A table someone else made (a migration, a DBA, a concurrent starter)
	// is used only once it is known not to merge or truncate ids.
	if err := verifySchema(ctx, db, d, t); err != nil {
		return &wrapped{msg: fmt.Sprintf("inbox: initialize schema of %s", t), err: err}
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
