package inbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
)

// Verify checks that the inbox table exists and has the shape the inbox
// relies on, reading only the catalog (no DDL, no lock on the table). It
// returns nil for a table made by InitializeSchema or from schema/, an error
// wrapping ErrTableNotFound for a missing table, and one wrapping
// ErrIncompatibleTable that names every problem and the DDL that fixes it
// for a table that could merge, truncate or reject message ids (see
// ErrIncompatibleTable). Other errors are the database's, wrapped.
//
// Call it at startup when your migrations own the table, before the router
// consumes (or add Inbox.RouterPlugin to the router), so that a missing or
// wrong table stops the process instead of nacking every message. The
// middleware runs the same check once before its first claim, and
// InitializeSchema runs it on a table that already exists. It is safe for
// concurrent use and works behind a transaction-mode connection pooler (on
// PostgreSQL it reads in one short transaction).
func (ib *Inbox) Verify(ctx context.Context) error {
	if err := verifySchema(ctx, ib.db, ib.dialect, ib.table); err != nil {
		return err
	}
	ib.verified.Store(true) // the middleware need not check again
	return nil
}

// VerifyTimeout bounds the check that Inbox.RouterPlugin runs.
const VerifyTimeout = 30 * time.Second

// RouterPlugin is a Watermill router plugin that runs Verify before the
// router subscribes to anything: add it with router.AddPlugin(ib.RouterPlugin),
// and router.Run returns Verify's error (errors.Is matches ErrTableNotFound
// and ErrIncompatibleTable through the router's wrapping) instead of
// starting handlers that would nack every message. The check is bounded by
// VerifyTimeout. Router plugins run once, in router.Run, before its
// handlers start (a Watermill convention).
func (ib *Inbox) RouterPlugin(*message.Router) error {
	ctx, cancel := context.WithTimeout(context.Background(), VerifyTimeout)
	defer cancel()
	return ib.Verify(ctx)
}

// verifySchema runs verifyTable in a read-only unit of work.
func verifySchema(ctx context.Context, db *sqlx.DB, d Dialect, t qualifiedName) error {
	return withReadTx(ctx, db, d, func(q sqlx.QueryerContext) error {
		return verifyTable(ctx, q, d, t)
	})
}

// verifyTable checks table t through q (catalog reads only) with
// d.checkTable. A missing table gives an error wrapping ErrTableNotFound
// with the DDL that creates it; problems give one error wrapping
// ErrIncompatibleTable that lists each with its fix, then the canonical DDL.
func verifyTable(ctx context.Context, q sqlx.QueryerContext, d Dialect, t qualifiedName) error {
	problems, err := d.checkTable(ctx, q, t)
	canonical, _ := SchemaSQL(d, t.String()) // t passed the name pattern
	switch {
	case errors.Is(err, ErrTableNotFound):
		return fmt.Errorf("%w: run InitializeSchema, or apply the DDL of SchemaSQL:\n%s", err, canonical)
	case err != nil:
		return fmt.Errorf("inbox: verify table %q: %w", t.String(), err)
	case len(problems) == 0:
		return nil
	}
	var b strings.Builder
	plural := "s"
	if len(problems) == 1 {
		plural = ""
	}
	fmt.Fprintf(&b, "table %q (%s) has %d problem%s:", t.String(), d, len(problems), plural)
	// A fix of several lines (a table to recreate) is printed once, below
	// the list, however many problems it fixes.
	var scripts []string
	for _, p := range problems {
		if !strings.Contains(p.fix, "\n") {
			fmt.Fprintf(&b, "\n  - %s; fix: %s", p.what, p.fix)
			continue
		}
		n := slices.Index(scripts, p.fix)
		if n < 0 {
			scripts, n = append(scripts, p.fix), len(scripts)
		}
		fmt.Fprintf(&b, "\n  - %s; fix: script %d below", p.what, n+1)
	}
	for i, s := range scripts {
		fmt.Fprintf(&b, "\nscript %d:\n%s", i+1, s)
	}
	fmt.Fprintf(&b, "\ncanonical DDL for comparison:\n%s", canonical)
	return fmt.Errorf("%w: %s", ErrIncompatibleTable, b.String())
}

// nameList formats names for a message: ("consumer", "message_id").
func nameList(names []string) string {
	quoted := make([]string, len(names))
	for i, n := range names {
		quoted[i] = strconv.Quote(n)
	}
	return "(" + strings.Join(quoted, ", ") + ")"
}

// tableProblem is one thing wrong with an existing inbox table.
type tableProblem struct {
	what string // what is wrong, e.g. `column "message_id" has collation "utf8mb4_general_ci", which compares case-insensitively`
	fix  string // the DDL that fixes it, e.g. "ALTER TABLE ... MODIFY ..."; several lines for a table to recreate
}

// problems collects tableProblems.
type problems []tableProblem

func (ps *problems) add(fix, format string, args ...any) {
	*ps = append(*ps, tableProblem{what: fmt.Sprintf(format, args...), fix: fix})
}

// tableNotFound is checkTable's error for a missing table.
func tableNotFound(t qualifiedName) error {
	return fmt.Errorf("%w: %q", ErrTableNotFound, t.String())
}

// oldName is the name a recreate script renames t to: t's name with
// "_old", within 63 bytes.
func oldName(t qualifiedName) qualifiedName {
	name := t.name
	if len(name) > 59 {
		name = name[:59]
	}
	return qualifiedName{schema: t.schema, name: name + "_old"}
}

// keyColumns is the primary key, in order; partitionedKey that of a
// PostgreSQLPartitioned table.
var (
	keyColumns     = []string{"consumer", "message_id"}
	partitionedKey = []string{"consumer", "message_id", "processed_at"}
)

const processedAt = "processed_at"

// --- PostgreSQL ---

// pgRelation is what pg_class says about the table.
type pgRelation struct {
	Kind     string `db:"kind"`     // relkind: r table, p partitioned table, v view, ...
	Encoding string `db:"encoding"` // the database's encoding
}

// pgColumn is one column of the table, from pg_attribute.
type pgColumn struct {
	Name          string `db:"name"`
	Ident         string `db:"ident"` // quote_ident(name), for DDL
	Type          string `db:"type"`  // format_type, for messages
	Kind          string `db:"kind"`  // text, varchar, bpchar, timestamptz, timestamp, domain or the type's name
	Typmod        int    `db:"typmod"`
	NotNull       bool   `db:"not_null"`
	HasDefault    bool   `db:"has_default"` // a default, an identity or a generated column
	Collation     string `db:"collation"`
	Deterministic bool   `db:"deterministic"`
}

// pgPrimaryKeyColumn is one column of the table's primary key constraint.
type pgPrimaryKeyColumn struct {
	Constraint string `db:"constraint_name"` // quote_ident(conname), for DDL
	Deferrable bool   `db:"deferrable"`
	Column     string `db:"col"`
}

const pgRelationSQL = `SELECT c.relkind::text AS kind, current_setting('server_encoding') AS encoding
FROM pg_class c WHERE c.oid = to_regclass($1)`

const pgColumnsSQL = `SELECT a.attname::text AS name, quote_ident(a.attname) AS ident,
	format_type(a.atttypid, a.atttypmod) AS type,
	CASE WHEN a.atttypid = 'pg_catalog.text'::regtype THEN 'text'
		WHEN a.atttypid = 'pg_catalog.varchar'::regtype THEN 'varchar'
		WHEN a.atttypid = 'pg_catalog.bpchar'::regtype THEN 'bpchar'
		WHEN a.atttypid = 'pg_catalog.timestamptz'::regtype THEN 'timestamptz'
		WHEN a.atttypid = 'pg_catalog.timestamp'::regtype THEN 'timestamp'
		WHEN ty.typtype = 'd' THEN 'domain'
		ELSE ty.typname::text END AS kind,
	a.atttypmod AS typmod, a.attnotnull AS not_null,
	(a.atthasdef OR a.attidentity <> '' OR a.attgenerated <> '') AS has_default,
	COALESCE(co.collname::text, '') AS collation, COALESCE(co.collisdeterministic, true) AS deterministic
FROM pg_attribute a
JOIN pg_type ty ON ty.oid = a.atttypid
LEFT JOIN pg_collation co ON co.oid = a.attcollation
WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum`

const pgPrimaryKeySQL = `SELECT quote_ident(con.conname) AS constraint_name, con.condeferrable AS deferrable,
	a.attname::text AS col
FROM pg_index i
JOIN pg_constraint con ON con.conrelid = i.indrelid AND con.contype = 'p'
CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY k(attnum, ord)
JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
WHERE i.indrelid = to_regclass($1) AND i.indisprimary
ORDER BY k.ord`

// A valid, non-partial btree or BRIN index led by processed_at: one that
// serves the purge's range scan.
const pgPurgeIndexSQL = `SELECT EXISTS (SELECT 1 FROM pg_index i
	JOIN pg_class ic ON ic.oid = i.indexrelid
	JOIN pg_am am ON am.oid = ic.relam
	JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
	WHERE i.indrelid = to_regclass($1) AND a.attname = 'processed_at'
		AND i.indisvalid AND i.indpred IS NULL AND am.amname IN ('btree', 'brin'))`

const pgPartitioningSQL = `SELECT pt.partstrat::text AS strategy, pt.partnatts AS columns,
	COALESCE(a.attname::text, '') AS key
FROM pg_partitioned_table pt
LEFT JOIN pg_attribute a ON a.attrelid = pt.partrelid AND a.attnum = pt.partattrs[0]
WHERE pt.partrelid = to_regclass($1)`

func pgReadRelation(ctx context.Context, q sqlx.QueryerContext, d Dialect, t qualifiedName) (pgRelation, error) {
	var rel pgRelation
	err := sqlx.GetContext(ctx, q, &rel, pgRelationSQL, t.quoted(d))
	if errors.Is(err, sql.ErrNoRows) {
		return rel, tableNotFound(t)
	}
	return rel, err
}

func (d postgresDialect) checkTable(ctx context.Context, q sqlx.QueryerContext, t qualifiedName) ([]tableProblem, error) {
	rel, err := pgReadRelation(ctx, q, d, t)
	if err != nil {
		return nil, err
	}
	var ps problems
	switch rel.Kind {
	case "r":
	case "p":
		// Its primary key must include processed_at, so it cannot be the
		// (consumer, message_id) the plain claim relies on.
		ps.add("set Config.Dialect to inbox.PostgreSQLPartitioned",
			"the table is partitioned, which only the PostgreSQLPartitioned dialect supports")
		return ps, nil
	default:
		ps.add("replace it with the table of the canonical DDL below",
			"%q is not a table (relkind %q)", t.String(), rel.Kind)
		return ps, nil
	}
	if err := pgCheckCommon(ctx, q, d, t, rel, &ps, keyColumns, false); err != nil {
		return nil, err
	}
	var indexed bool
	if err := sqlx.GetContext(ctx, q, &indexed, pgPurgeIndexSQL, t.quoted(d)); err != nil {
		return nil, err
	}
	if !indexed {
		ps.add(d.createSQL(t)[1], "no index is led by %q, so every purge scans the whole table", processedAt)
	}
	return ps, nil
}

func (d postgresPartitionedDialect) checkTable(ctx context.Context, q sqlx.QueryerContext, t qualifiedName) ([]tableProblem, error) {
	rel, err := pgReadRelation(ctx, q, d, t)
	if err != nil {
		return nil, err
	}
	var ps problems
	recreate := d.recreateScript(t)
	switch rel.Kind {
	case "p":
	case "r":
		ps.add(recreate, "the table is not partitioned; PostgreSQLPartitioned needs one range-partitioned on %q"+
			" (or set Config.Dialect to inbox.PostgreSQL)", processedAt)
		return ps, nil
	default:
		ps.add(recreate, "%q is not a table (relkind %q)", t.String(), rel.Kind)
		return ps, nil
	}
	var part struct {
		Strategy string `db:"strategy"`
		Columns  int    `db:"columns"`
		Key      string `db:"key"`
	}
	if err := sqlx.GetContext(ctx, q, &part, pgPartitioningSQL, t.quoted(d)); err != nil {
		return nil, err
	}
	if part.Strategy != "r" || part.Columns != 1 || part.Key != processedAt {
		strategy := map[string]string{"r": "range", "l": "list", "h": "hash"}[part.Strategy]
		ps.add(recreate, "the table is partitioned by %s on %d column(s), the first %q, not by range on %q alone,"+
			" so DropPartitions cannot purge it", strategy, part.Columns, part.Key, processedAt)
		return ps, nil
	}
	if err := pgCheckCommon(ctx, q, d, t, rel, &ps, partitionedKey, true); err != nil {
		return nil, err
	}
	return ps, nil
}

// recreateScript returns the statements that replace t with a partitioned
// table of the canonical shape, keeping its rows.
func (d postgresPartitionedDialect) recreateScript(t qualifiedName) string {
	old := oldName(t)
	return "ALTER TABLE " + t.quoted(d) + " RENAME TO " + d.quote(old.name) + ";\n" +
		"-- Create the partitioned table (the canonical DDL below, or InitializeSchema) and the partitions\n" +
		"-- for the days of the existing rows (CreatePartitions), then copy the rows and drop the old table:\n" +
		"INSERT INTO " + t.quoted(d) + " (consumer, message_id, processed_at) SELECT consumer, message_id, processed_at FROM " +
		old.quoted(d) + ";\n" +
		"DROP TABLE " + old.quoted(d) + ";"
}

// pgCheckCommon adds the problems of the database encoding, the columns and
// the primary key, which must be exactly pk. When partitioned, processed_at
// is the partition key, whose type cannot be altered in place.
func pgCheckCommon(ctx context.Context, q sqlx.QueryerContext, d Dialect, t qualifiedName, rel pgRelation,
	ps *problems, pk []string, partitioned bool,
) error {
	tq := t.quoted(d)
	if rel.Encoding != "UTF8" && rel.Encoding != "SQL_ASCII" {
		ps.add("move the table to a database created with ENCODING 'UTF8'",
			"the database encoding %q cannot store every UTF-8 message id", rel.Encoding)
	}
	var cols []pgColumn
	if err := sqlx.SelectContext(ctx, q, &cols, pgColumnsSQL, tq); err != nil {
		return err
	}
	byName := map[string]pgColumn{}
	for _, c := range cols {
		byName[c.Name] = c
	}
	for _, name := range keyColumns {
		c, ok := byName[name]
		fix := "ALTER TABLE " + tq + " ALTER COLUMN " + name + ` TYPE text COLLATE "C"`
		if !ok {
			ps.add("ALTER TABLE "+tq+" ADD COLUMN "+name+` text COLLATE "C" NOT NULL`, "column %q is missing", name)
			continue
		}
		if what := pgKeyColumnProblem(c); what != "" {
			ps.add(fix, "%s", what)
		}
		if !c.NotNull {
			ps.add("ALTER TABLE "+tq+" ALTER COLUMN "+name+" SET NOT NULL", "column %q is nullable", name)
		}
	}
	fix := "ALTER TABLE " + tq + " ALTER COLUMN " + processedAt + " TYPE timestamptz"
	if partitioned {
		fix = postgresPartitionedDialect{}.recreateScript(t)
	}
	switch c, ok := byName[processedAt]; {
	case !ok:
		ps.add("ALTER TABLE "+tq+" ADD COLUMN "+processedAt+" timestamptz NOT NULL DEFAULT now()", "column %q is missing", processedAt)
	case c.Kind == "timestamp":
		ps.add(fix, "column %q has type %q: the session time zone would change which rows a purge deletes", c.Name, c.Type)
	case c.Kind != "timestamptz":
		ps.add(fix, "column %q has type %q, not timestamptz", c.Name, c.Type)
	}
	for _, c := range cols {
		if c.Name == processedAt || slices.Contains(keyColumns, c.Name) {
			continue
		}
		if c.NotNull && !c.HasDefault {
			ps.add("ALTER TABLE "+tq+" ALTER COLUMN "+c.Ident+" DROP NOT NULL",
				"column %q is NOT NULL without a default, so every claim (which sets only consumer, message_id and processed_at) fails", c.Name)
		}
	}

	want := strings.Join(pk, ", ")
	var key []pgPrimaryKeyColumn
	if err := sqlx.SelectContext(ctx, q, &key, pgPrimaryKeySQL, tq); err != nil {
		return err
	}
	if len(key) == 0 {
		ps.add("ALTER TABLE "+tq+" ADD PRIMARY KEY ("+want+")",
			"the table has no primary key; the claim needs the primary key %s", nameList(pk))
		return nil
	}
	got := make([]string, len(key))
	for i, k := range key {
		got[i] = k.Column
	}
	pkFix := "ALTER TABLE " + tq + " DROP CONSTRAINT " + key[0].Constraint + ", ADD PRIMARY KEY (" + want + ")"
	switch {
	case !slices.Equal(got, pk):
		ps.add(pkFix, "the primary key is %s, not %s", nameList(got), nameList(pk))
	case key[0].Deferrable:
		// ON CONFLICT cannot use a deferrable constraint as its arbiter.
		ps.add(pkFix, "the primary key is DEFERRABLE, which INSERT ... ON CONFLICT refuses")
	}
	return nil
}

// pgKeyColumnProblem says what is wrong with the type or collation of key
// column c, or "" when it stores any id of up to MaxKeyLength bytes and
// compares byte for byte.
func pgKeyColumnProblem(c pgColumn) string {
	switch c.Kind {
	case "text":
	case "varchar":
		if n := c.Typmod - 4; c.Typmod >= 0 && n < MaxKeyLength {
			return fmt.Sprintf("column %q has type %q, narrower than %d bytes (MaxKeyLength): longer ids are rejected",
				c.Name, c.Type, MaxKeyLength)
		}
	case "bpchar":
		return fmt.Sprintf("column %q has type %q, which pads with spaces: ids that differ only in trailing spaces merge",
			c.Name, c.Type)
	case "citext":
		return fmt.Sprintf("column %q has type %q, which compares case-insensitively: Order-1 and order-1 merge",
			c.Name, c.Type)
	case "domain":
		return fmt.Sprintf("column %q has type %q, a domain; the key columns must be text", c.Name, c.Type)
	default:
		return fmt.Sprintf("column %q has type %q; the key columns must be text (or varchar of at least %d characters)",
			c.Name, c.Type, MaxKeyLength)
	}
	if !c.Deterministic {
		return fmt.Sprintf("column %q has the nondeterministic collation %q, under which distinct ids can compare equal",
			c.Name, c.Collation)
	}
	return ""
}

// --- MySQL / MariaDB ---

// myColumn is one column of the table, from information_schema.COLUMNS.
type myColumn struct {
	Name      string         `db:"name"`
	DataType  string         `db:"data_type"`   // varbinary, varchar, datetime, ...
	Type      string         `db:"column_type"` // varbinary(255), for messages and DDL
	MaxLength sql.NullInt64  `db:"max_length"`  // characters (bytes for binary types)
	Charset   sql.NullString `db:"charset"`
	Collation sql.NullString `db:"collation"`
	Nullable  string         `db:"nullable"` // YES or NO
	Default   sql.NullString `db:"column_default"`
	Extra     sql.NullString `db:"extra"` // auto_increment, VIRTUAL GENERATED, ...
	Precision sql.NullInt64  `db:"datetime_precision"`
}

// myIndexColumn is one column of one index, from information_schema.STATISTICS.
type myIndexColumn struct {
	Index   string         `db:"index_name"`
	Unique  bool           `db:"is_unique"`
	Seq     int            `db:"seq"`
	Column  sql.NullString `db:"column_name"` // NULL for a functional key part (MySQL 8)
	SubPart sql.NullInt64  `db:"sub_part"`    // the prefix length; NULL for the whole column
}

const myColumnsSQL = `SELECT COLUMN_NAME AS name, DATA_TYPE AS data_type, COLUMN_TYPE AS column_type,
	CHARACTER_MAXIMUM_LENGTH AS max_length, CHARACTER_SET_NAME AS charset, COLLATION_NAME AS collation,
	IS_NULLABLE AS nullable, COLUMN_DEFAULT AS column_default, EXTRA AS extra, DATETIME_PRECISION AS datetime_precision
FROM information_schema.COLUMNS WHERE `

const myIndexesSQL = `SELECT INDEX_NAME AS index_name, NON_UNIQUE = 0 AS is_unique, SEQ_IN_INDEX AS seq,
	COLUMN_NAME AS column_name, SUB_PART AS sub_part
FROM information_schema.STATISTICS WHERE `

func (d mysqlDialect) checkTable(ctx context.Context, q sqlx.QueryerContext, t qualifiedName) ([]tableProblem, error) {
	where, args := mysqlTableWhere(t)
	tq := t.quoted(d)
	var table struct {
		Type   string         `db:"table_type"`
		Engine sql.NullString `db:"engine"`
	}
	err := sqlx.GetContext(ctx, q, &table, "SELECT TABLE_TYPE AS table_type, ENGINE AS engine FROM information_schema.TABLES WHERE "+where, args...)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, tableNotFound(t)
	}
	if err != nil {
		return nil, err
	}
	var ps problems
	if strings.Contains(table.Type, "VIEW") {
		ps.add("replace it with the table of the canonical DDL below", "%q is a %q, not a table", t.String(), table.Type)
		return ps, nil
	}
	if !strings.EqualFold(table.Engine.String, "InnoDB") {
		ps.add("ALTER TABLE "+tq+" ENGINE=InnoDB", "the table uses the storage engine %q, not InnoDB: the claim relies on"+
			" InnoDB's transactions and row locks (on MyISAM a claim survives its handler's failure)", table.Engine.String)
	}

	var cols []myColumn
	if err := sqlx.SelectContext(ctx, q, &cols, myColumnsSQL+where+" ORDER BY ORDINAL_POSITION", args...); err != nil {
		return nil, err
	}
	byName := map[string]myColumn{}
	for _, c := range cols {
		byName[strings.ToLower(c.Name)] = c
	}
	for _, name := range keyColumns {
		fix := "ALTER TABLE " + tq + " MODIFY " + name + " varbinary(255) NOT NULL"
		c, ok := byName[name]
		if !ok {
			ps.add("ALTER TABLE "+tq+" ADD COLUMN "+name+" varbinary(255) NOT NULL", "column %q is missing", name)
			continue
		}
		what, err := d.keyColumnProblem(ctx, q, c)
		if err != nil {
			return nil, err
		}
		if what == "" && c.Nullable != "NO" {
			what = fmt.Sprintf("column %q is nullable", c.Name)
		}
		if what != "" {
			ps.add(fix, "%s", what)
		}
	}
	fix := "ALTER TABLE " + tq + " MODIFY " + processedAt + " datetime(6) NOT NULL"
	switch c, ok := byName[processedAt]; {
	case !ok:
		ps.add("ALTER TABLE "+tq+" ADD COLUMN "+processedAt+" datetime(6) NOT NULL", "column %q is missing", processedAt)
	case c.DataType == "timestamp":
		ps.add(fix, "column %q has type %q, which the server converts by the session time zone:"+
			" the time zone would change which rows a purge deletes", c.Name, c.Type)
	case c.DataType != "datetime":
		ps.add(fix, "column %q has type %q, not datetime(6)", c.Name, c.Type)
	case c.Precision.Int64 != 6:
		ps.add(fix, "column %q has type %q, with fewer than 6 fractional digits: the claim of a duplicate adds"+
			" 1 microsecond to it and must change the row", c.Name, c.Type)
	}
	for _, c := range cols {
		name := strings.ToLower(c.Name)
		if name == processedAt || slices.Contains(keyColumns, name) {
			continue
		}
		generated := strings.Contains(strings.ToLower(c.Extra.String), "auto_increment") ||
			strings.Contains(strings.ToUpper(c.Extra.String), "GENERATED")
		if c.Nullable == "NO" && !c.Default.Valid && !generated {
			def := c.Type
			if c.Collation.Valid {
				def += " CHARACTER SET " + c.Charset.String + " COLLATE " + c.Collation.String
			}
			ps.add("ALTER TABLE "+tq+" MODIFY "+myQuote(c.Name)+" "+def+" NULL",
				"column %q is NOT NULL without a default, so every claim (which sets only consumer, message_id and processed_at) fails", c.Name)
		}
	}

	var keys []myIndexColumn
	if err := sqlx.SelectContext(ctx, q, &keys, myIndexesSQL+where+" ORDER BY INDEX_NAME, SEQ_IN_INDEX", args...); err != nil {
		return nil, err
	}
	indexes := map[string][]myIndexColumn{}
	var names []string
	for _, k := range keys {
		if _, ok := indexes[k.Index]; !ok {
			names = append(names, k.Index)
		}
		indexes[k.Index] = append(indexes[k.Index], k)
	}
	want := strings.Join(keyColumns, ", ")
	if pk, ok := indexes["PRIMARY"]; !ok {
		fix := "ALTER TABLE " + tq + " ADD PRIMARY KEY (" + want + ")"
		for _, name := range names {
			if idx := indexes[name]; idx[0].Unique && myIndexIsKey(idx) {
				fix = "ALTER TABLE " + tq + " DROP INDEX " + myQuote(name) + ", ADD PRIMARY KEY (" + want + ")"
			}
		}
		ps.add(fix, "the table has no primary key; the claim needs the primary key %s"+
			" (a UNIQUE index does not do: InnoDB takes gap locks on it that block neighbouring claims)", nameList(keyColumns))
	} else if !myIndexIsKey(pk) {
		why := ""
		for _, k := range pk {
			if k.SubPart.Valid {
				why = ": it indexes a prefix of a key column, so ids that share the prefix merge"
			}
		}
		ps.add("ALTER TABLE "+tq+" DROP PRIMARY KEY, ADD PRIMARY KEY ("+want+")",
			"the primary key is (%s), not %s%s", myIndexColumns(pk), nameList(keyColumns), why)
	}
	indexed := false
	for _, name := range names {
		if idx := indexes[name]; name != "PRIMARY" && strings.EqualFold(idx[0].Column.String, processedAt) {
			indexed = true
		}
	}
	if !indexed {
		ps.add("CREATE INDEX "+d.quote(t.indexName())+" ON "+tq+" ("+processedAt+")",
			"no index is led by %q, so every purge scans the whole table", processedAt)
	}
	return ps, nil
}

// keyColumnProblem says what is wrong with the type, character set or
// collation of key column c, or "" when it stores any id of up to
// MaxKeyLength bytes and compares byte for byte.
func (d mysqlDialect) keyColumnProblem(ctx context.Context, q sqlx.QueryerContext, c myColumn) (string, error) {
	narrow := c.MaxLength.Int64 < MaxKeyLength
	switch c.DataType {
	case "varbinary":
		if narrow {
			return fmt.Sprintf("column %q has type %q, narrower than %d bytes (MaxKeyLength): longer ids are truncated or rejected",
				c.Name, c.Type, MaxKeyLength), nil
		}
		return "", nil
	case "binary", "char":
		return fmt.Sprintf("column %q has type %q, which pads ids: ids that differ only in trailing padding merge", c.Name, c.Type), nil
	case "tinyblob", "blob", "mediumblob", "longblob", "tinytext", "text", "mediumtext", "longtext":
		return fmt.Sprintf("column %q has type %q, which a primary key indexes only by a prefix: ids that share it merge",
			c.Name, c.Type), nil
	case "varchar":
	default:
		return fmt.Sprintf("column %q has type %q; the key columns must be varbinary(255)", c.Name, c.Type), nil
	}
	if narrow {
		return fmt.Sprintf("column %q has type %q, narrower than %d bytes (MaxKeyLength): longer ids are truncated or rejected",
			c.Name, c.Type, MaxKeyLength), nil
	}
	if c.Charset.String != "utf8mb4" {
		return fmt.Sprintf("column %q has the character set %q, which cannot hold every UTF-8 id", c.Name, c.Charset.String), nil
	}
	coll := c.Collation.String
	noPad, err := d.noPad(ctx, q, coll)
	if err != nil {
		return "", err
	}
	var why []string
	switch {
	case strings.Contains(coll, "_ci"):
		why = append(why, "compares case-insensitively (Order-1 = order-1), may fold accents (ö = o) or expand letters (ß = ss)")
	case !strings.HasSuffix(coll, "_bin"):
		why = append(why, "does not compare byte for byte")
	}
	if !noPad {
		why = append(why, "is PAD SPACE (ids that differ only in trailing spaces merge)")
	}
	if len(why) > 0 {
		return fmt.Sprintf("column %q has the collation %q, which %s", c.Name, coll, strings.Join(why, ", and ")), nil
	}
	return "", nil
}

// noPad reports whether collation coll is NO PAD: by information_schema.
// COLLATIONS.PAD_ATTRIBUTE where the server has it (MySQL 8), else by the
// MariaDB naming ("_nopad_").
func (mysqlDialect) noPad(ctx context.Context, q sqlx.QueryerContext, coll string) (bool, error) {
	var has int
	if err := sqlx.GetContext(ctx, q, &has, "SELECT COUNT(*) FROM information_schema.COLUMNS"+
		" WHERE TABLE_SCHEMA = 'information_schema' AND TABLE_NAME = 'COLLATIONS' AND COLUMN_NAME = 'PAD_ATTRIBUTE'"); err != nil {
		return false, err
	}
	if has == 0 {
		return strings.Contains(coll, "_nopad_"), nil
	}
	var pad string
	err := sqlx.GetContext(ctx, q, &pad, "SELECT PAD_ATTRIBUTE FROM information_schema.COLLATIONS WHERE COLLATION_NAME = ?", coll)
	if errors.Is(err, sql.ErrNoRows) {
		return false, nil
	}
	return pad == "NO PAD", err
}

// myIndexIsKey reports whether idx is exactly (consumer, message_id) on
// whole columns.
func myIndexIsKey(idx []myIndexColumn) bool {
	if len(idx) != len(keyColumns) {
		return false
	}
	for i, k := range idx {
		if !strings.EqualFold(k.Column.String, keyColumns[i]) || k.SubPart.Valid {
			return false
		}
	}
	return true
}

// myIndexColumns describes idx's key parts for a message: `"consumer", "message_id"(36)`.
func myIndexColumns(idx []myIndexColumn) string {
	parts := make([]string, len(idx))
	for i, k := range idx {
		parts[i] = strconv.Quote(k.Column.String)
		if !k.Column.Valid {
			parts[i] = "an expression"
		}
		if k.SubPart.Valid {
			parts[i] += fmt.Sprintf("(%d)", k.SubPart.Int64)
		}
	}
	return strings.Join(parts, ", ")
}

// myQuote quotes a name read from the catalog, which may hold any character.
func myQuote(name string) string { return "`" + strings.ReplaceAll(name, "`", "``") + "`" }

// --- SQLite ---

// sqliteColumn is one column of the table, from pragma_table_xinfo.
type sqliteColumn struct {
	Name       string `db:"name"`
	Type       string `db:"type"` // the declared type
	NotNull    bool   `db:"not_null"`
	HasDefault bool   `db:"has_default"`
	PK         int    `db:"pk"`     // position in the primary key, 0 if not in it
	Hidden     int    `db:"hidden"` // 2, 3: a generated column
}

// The schema that an unqualified name resolves to (temp, main, then the
// attached databases in order) or the given one (parameter 2, "" for
// unqualified), and what the object is there.
const sqliteTableSQL = `SELECT tl.schema AS schema, tl.type AS type
FROM pragma_table_list(?1) tl LEFT JOIN pragma_database_list dl ON dl.name = tl.schema
WHERE ?2 = '' OR tl.schema = ?2 COLLATE NOCASE
ORDER BY CASE tl.schema WHEN 'temp' THEN -1 ELSE COALESCE(dl.seq, 1000) END LIMIT 1`

const sqliteColumnsSQL = `SELECT name, type, "notnull" AS not_null, dflt_value IS NOT NULL AS has_default, pk, hidden
FROM pragma_table_xinfo(?1, ?2) ORDER BY cid`

// The collation of each key column of the primary key, in order.
const sqlitePKCollationsSQL = `SELECT ix.name AS name, ix.coll AS coll
FROM pragma_index_list(?1, ?2) il, pragma_index_xinfo(il.name, ?2) ix
WHERE il.origin = 'pk' AND ix.key = 1 ORDER BY ix.seqno`

// Whether a full (not partial) index is led by processed_at.
const sqlitePurgeIndexSQL = `SELECT EXISTS (SELECT 1
FROM pragma_index_list(?1, ?2) il, pragma_index_xinfo(il.name, ?2) ix
WHERE il.partial = 0 AND ix.seqno = 0 AND ix.name = 'processed_at' COLLATE NOCASE)`

func (d sqliteDialect) checkTable(ctx context.Context, q sqlx.QueryerContext, t qualifiedName) ([]tableProblem, error) {
	var table struct {
		Schema string `db:"schema"`
		Type   string `db:"type"`
	}
	err := sqlx.GetContext(ctx, q, &table, sqliteTableSQL, t.name, t.schema)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, tableNotFound(t)
	}
	if err != nil {
		return nil, err
	}
	var ps problems
	recreate := d.recreateScript(t)
	if table.Type != "table" {
		ps.add(recreate, "%q is a %q, not a table", t.String(), table.Type)
		return ps, nil
	}
	var cols []sqliteColumn
	if err := sqlx.SelectContext(ctx, q, &cols, sqliteColumnsSQL, t.name, table.Schema); err != nil {
		return nil, err
	}
	byName := map[string]sqliteColumn{}
	for _, c := range cols {
		byName[strings.ToLower(c.Name)] = c
	}
	// SQLite cannot alter a column: every fix but the index's is the
	// recreate script.
	for _, name := range keyColumns {
		c, ok := byName[name]
		switch {
		case !ok:
			ps.add(recreate, "column %q is missing", name)
			continue
		case sqliteAffinity(c.Type) != "TEXT":
			ps.add(recreate, "column %q has the declared type %q, of %s affinity, not TEXT: ids that look like numbers are"+
				" converted ('0123' becomes 123) and merge", c.Name, c.Type, sqliteAffinity(c.Type))
		}
		if !c.NotNull {
			ps.add(recreate, "column %q is nullable", c.Name)
		}
	}
	switch c, ok := byName[processedAt]; {
	case !ok:
		ps.add(recreate, "column %q is missing", processedAt)
	case sqliteAffinity(c.Type) != "INTEGER":
		ps.add(recreate, "column %q has the declared type %q, not of INTEGER affinity (Unix microseconds)", c.Name, c.Type)
	}
	var pk []string
	for _, c := range cols {
		name := strings.ToLower(c.Name)
		if c.PK > 0 {
			for len(pk) < c.PK {
				pk = append(pk, "")
			}
			pk[c.PK-1] = c.Name
		}
		if name == processedAt || slices.Contains(keyColumns, name) {
			continue
		}
		if c.NotNull && !c.HasDefault && c.Hidden != 2 && c.Hidden != 3 {
			ps.add(recreate, "column %q is NOT NULL without a default, so every claim"+
				" (which sets only consumer, message_id and processed_at) fails", c.Name)
		}
	}
	switch {
	case len(pk) == 0:
		ps.add(recreate, "the table has no primary key; the claim needs the primary key %s", nameList(keyColumns))
	case !slices.EqualFunc(pk, keyColumns, strings.EqualFold):
		ps.add(recreate, "the primary key is %s, not %s", nameList(pk), nameList(keyColumns))
	default:
		var colls []struct {
			Name string         `db:"name"`
			Coll sql.NullString `db:"coll"`
		}
		if err := sqlx.SelectContext(ctx, q, &colls, sqlitePKCollationsSQL, t.name, table.Schema); err != nil {
			return nil, err
		}
		for _, c := range colls {
			if strings.EqualFold(c.Coll.String, "BINARY") {
				continue
			}
			why := "which may not compare byte for byte"
			switch strings.ToUpper(c.Coll.String) {
			case "NOCASE":
				why = "which folds case: Order-1 and order-1 merge"
			case "RTRIM":
				why = "which ignores trailing spaces: ids that differ only in them merge"
			}
			ps.add(recreate, "the primary key compares column %q with the collation %q, %s", c.Name, c.Coll.String, why)
		}
	}
	var indexed bool
	if err := sqlx.GetContext(ctx, q, &indexed, sqlitePurgeIndexSQL, t.name, table.Schema); err != nil {
		return nil, err
	}
	if !indexed {
		ps.add(d.createSQL(t)[1], "no index is led by %q, so every purge scans the whole table", processedAt)
	}
	return ps, nil
}

// recreateScript returns the statements that replace t with a table of the
// canonical shape, keeping its rows: SQLite cannot alter a column.
func (d sqliteDialect) recreateScript(t qualifiedName) string {
	old := oldName(t)
	create := d.createSQL(t)
	return "BEGIN IMMEDIATE;\n" +
		"ALTER TABLE " + t.quoted(d) + " RENAME TO " + d.quote(old.name) + ";\n" +
		create[0] + ";\n" +
		"INSERT INTO " + t.quoted(d) + " (consumer, message_id, processed_at) SELECT consumer, message_id, processed_at FROM " +
		old.quoted(d) + ";\n" +
		"DROP TABLE " + old.quoted(d) + ";\n" +
		create[1] + ";\n" +
		"COMMIT;"
}

// sqliteAffinity returns the type affinity SQLite gives a column of the
// declared type decl (https://sqlite.org/datatype3.html, 3.1).
func sqliteAffinity(decl string) string {
	u := strings.ToUpper(decl)
	switch {
	case strings.Contains(u, "INT"):
		return "INTEGER"
	case strings.Contains(u, "CHAR"), strings.Contains(u, "CLOB"), strings.Contains(u, "TEXT"):
		return "TEXT"
	case strings.Contains(u, "BLOB"), u == "":
		return "BLOB"
	case strings.Contains(u, "REAL"), strings.Contains(u, "FLOA"), strings.Contains(u, "DOUB"):
		return "REAL"
	}
	return "NUMERIC"
}
