package inbox

import (
	"context"
	"database/sql"
	"errors"
	"slices"
	"strconv"
	"strings"

	"github.com/jmoiron/sqlx"
)

var _ Dialect = sqliteDialect{}

// sqliteDialect is SQLite: every statement the inbox runs there.
type sqliteDialect struct{}

func (sqliteDialect) String() string { return "sqlite" }

func (sqliteDialect) server() serverKind { return serverSQLite }

func (sqliteDialect) quote(ident string) string { return `"` + ident + `"` }

func (d sqliteDialect) claimSQL(t qualifiedName) string {
	// unixepoch('subsec') (SQLite 3.42+) is fractional seconds; processed_at
	// holds whole Unix microseconds, UTC.
	return "INSERT INTO " + t.quoted(d) + " (consumer, message_id, processed_at)" +
		" VALUES (?, ?, CAST(unixepoch('subsec') * 1000000 AS INTEGER))" +
		" ON CONFLICT (consumer, message_id) DO NOTHING"
}

func (d sqliteDialect) claimFingerprintSQL(t qualifiedName) string {
	return "INSERT INTO " + t.quoted(d) + " (consumer, message_id, processed_at, fingerprint)" +
		" VALUES (?, ?, CAST(unixepoch('subsec') * 1000000 AS INTEGER), ?)" +
		" ON CONFLICT (consumer, message_id) DO NOTHING"
}

func (sqliteDialect) claimFlagsOtherFingerprint() bool { return false }

func (d sqliteDialect) storedFingerprintSQL(t qualifiedName) string {
	return "SELECT fingerprint FROM " + t.quoted(d) + " WHERE consumer = ? AND message_id = ?"
}

func (sqliteDialect) fingerprintColumn() string { return "fingerprint  BLOB" }

func (sqliteDialect) fingerprintColumnSQL(t qualifiedName) (string, []any) {
	// The table an unqualified name resolves to, as SQLite resolves it
	// (temp, main, then the attached databases in order: sqliteTableSQL);
	// "main" alone turned the check off, in silence, for a table in an
	// attached database. SQLite compares column names without case
	// (FINGERPRINT is the same column); pragma_table_info gives the name as
	// it was declared. The type says whether the table is STRICT
	// (pragma_table_list, SQLite 3.37+), where the declared type is
	// enforced.
	return "SELECT ti.type || CASE WHEN tl.strict THEN '" + sqliteStrictSuffix + "' ELSE '' END" +
			" FROM (" + sqliteResolvedTableSQL + ") tl, pragma_table_info(?1, tl.schema) ti WHERE lower(ti.name) = 'fingerprint'",
		[]any{t.name, t.schema}
}

// sqliteStrictSuffix follows the fingerprint column's type, in what
// fingerprintColumnSQL reads, when its table is STRICT.
const sqliteStrictSuffix = " in a STRICT table"

// Any declared type in an ordinary table: SQLite stores a BLOB value as it
// is whatever the column's affinity (https://sqlite.org/datatype3.html,
// 3.1). A STRICT table refuses a BLOB in a column declared other than BLOB
// or ANY (https://sqlite.org/stricttables.html), and SQLite cannot change
// a column's type: the fix drops the column and adds it again.
func (d sqliteDialect) fingerprintColumnFits(t qualifiedName, typ string) (string, bool) {
	declared, strict := strings.CutSuffix(typ, sqliteStrictSuffix)
	fix := "ALTER TABLE " + t.quoted(d) + " DROP COLUMN fingerprint, then ALTER TABLE " + t.quoted(d) + " ADD COLUMN fingerprint BLOB"
	return fix, !strict || strings.EqualFold(declared, "BLOB") || strings.EqualFold(declared, "ANY")
}

func (sqliteDialect) claimed(n int64) (bool, bool) { return n == 1, n == 0 || n == 1 }

func (d sqliteDialect) createSQL(t qualifiedName) []string {
	// In SQLite an index lives in its table's database, which is named on the
	// index, not on the table: CREATE INDEX "aux"."idx" ON "t" (...).
	index := d.quote(t.indexName())
	if t.schema != "" {
		index = d.quote(t.schema) + "." + index
	}
	return []string{
		"CREATE TABLE IF NOT EXISTS " + t.quoted(d) + " (\n" +
			"    consumer     TEXT    NOT NULL,\n" +
			"    message_id   TEXT    NOT NULL,\n" +
			"    processed_at INTEGER NOT NULL,\n" +
			"    " + d.fingerprintColumn() + ",\n" +
			"    PRIMARY KEY (consumer, message_id)\n" +
			") WITHOUT ROWID",
		"CREATE INDEX IF NOT EXISTS " + index + " ON " + d.quote(t.name) + " (processed_at)",
	}
}

func (d sqliteDialect) existsSQL(t qualifiedName) (string, []any) {
	master := "sqlite_master"
	if t.schema != "" {
		master = d.quote(t.schema) + ".sqlite_master"
	}
	return "SELECT COUNT(*) FROM " + master + " WHERE (type = 'table' AND name = ?) OR (type = 'index' AND name = ?)",
		[]any{t.name, t.indexName()}
}

func (sqliteDialect) keyLock() (string, bool) { return "", false }

func (sqliteDialect) lockedClaim(context.Context, sqlx.QueryerContext, qualifiedName, bool) (string, error) {
	return "", nil
}

func (sqliteDialect) claimFunctionSQL(qualifiedName, bool) string { return "" }

// A transaction SQLite rolled back by itself (SQLITE_FULL, SQLITE_IOERR, ...)
// makes COMMIT fail: no transaction is active.
func (sqliteDialect) preCommitCheck(qualifiedName) (string, bool) { return "", false }

// SQLite refuses the COMMIT of an ended transaction (commitFoundNoTx).
func (sqliteDialect) statuslessCheck(qualifiedName) (string, bool) { return "", false }

func (sqliteDialect) uncodedBoundaryErrIsLostConn() bool { return false }

func (sqliteDialect) preparesByDefault() bool { return true }

func (sqliteDialect) expiredSQL(byConsumer bool) string {
	where := "processed_at < CAST(unixepoch('subsec') * 1000000 AS INTEGER) - ?1"
	if byConsumer {
		where += " AND consumer = ?2"
	}
	return where
}

// WITHOUT ROWID, so the batch is chosen by primary key.
func (d sqliteDialect) purgeStatement(t qualifiedName, cutoff int64, batch int, consumer string) purgeQuery {
	where := "processed_at < ?1" // microseconds since the Unix epoch, as processed_at
	if consumer != "" {
		where += " AND consumer = ?2"
	}
	return purgeQuery{
		sql:  deleteOldestSQL(t.quoted(d), where, batchParam("?", consumer != ""), ""),
		args: purgeArgs(cutoff, batch, consumer),
	}
}

func (sqliteDialect) nowMicrosSQL() string {
	return "SELECT CAST(unixepoch('subsec') * 1000000 AS INTEGER)"
}

// An INSERT of no row still needs the write lock, which a
// read-only file or query_only refuses (SQLITE_READONLY).
func (d sqliteDialect) writeProbeSQL(t qualifiedName) string {
	return "INSERT INTO " + t.quoted(d) + " (consumer, message_id) SELECT '', '' WHERE 0"
}

// busy_timeout bounds SQLite's wait.
func (sqliteDialect) writeProbeLockTimeout() string { return "" }

func (sqliteDialect) readOnlyTxSQL() string { return "" }

func (d sqliteDialect) oldestAgeSQL(t qualifiedName, consumer string) (string, []any) {
	q := "SELECT CAST(unixepoch('subsec') * 1000000 AS INTEGER) - MIN(processed_at) FROM " + t.quoted(d)
	if consumer == "" {
		return q, nil
	}
	return q + " WHERE consumer = ?", []any{consumer}
}

// SQLite keeps no estimate: an exact count (SQLite tables are expected to be
// small enough).
func (d sqliteDialect) estimateRowsSQL(t qualifiedName) (string, []any) {
	return "SELECT COUNT(*) FROM " + t.quoted(d), nil
}

func (d sqliteDialect) spanSQL(t qualifiedName) string {
	return "SELECT MIN(processed_at), MAX(processed_at), CAST(unixepoch('subsec') * 1000000 AS INTEGER) FROM " + t.quoted(d)
}

// The pages of the table's B-tree and of its indexes', from the dbstat
// virtual table (https://sqlite.org/dbstat.html; modernc.org/sqlite has it,
// a driver built without it fails the read, and Stats reports no size).
// It read the whole database file, the business tables' pages and the
// outbox's included, as the inbox table's size.
func (d sqliteDialect) sizeSQL(t qualifiedName) (string, []any) {
	schema, master := "main", "sqlite_master"
	if t.schema != "" {
		schema, master = t.schema, d.quote(t.schema)+".sqlite_master"
	}
	return "SELECT COALESCE(SUM(pgsize), 0) FROM dbstat(?) WHERE name IN (SELECT name FROM " + master +
		" WHERE tbl_name = ? COLLATE NOCASE)", []any{schema, t.name}
}

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
const sqliteTableSQL = `SELECT schema, type FROM (` + sqliteResolvedTableSQL + `)`

// sqliteResolvedTableSQL is the pragma_table_list row of table ?1 in
// schema ?2, or with ?2 = ” of the table the unqualified name resolves to:
// in temp, main, then the attached databases in the order of their ATTACH.
const sqliteResolvedTableSQL = `SELECT tl.schema AS schema, tl.type AS type, tl.strict AS strict
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
	var cols []sqliteColumn
	if err := sqlx.SelectContext(ctx, q, &cols, sqliteColumnsSQL, t.name, table.Schema); err != nil {
		return nil, err
	}
	byName := map[string]sqliteColumn{}
	for _, c := range cols {
		byName[strings.ToLower(c.Name)] = c
	}
	_, hasProcessedAt := byName[processedAt]
	_, hasFingerprint := byName["fingerprint"]
	recreate := d.recreateScript(t, hasProcessedAt, hasFingerprint)
	if table.Type != "table" {
		ps.add(recreate, "%q is a %q, not a table", t.String(), table.Type)
		return ps, nil
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
	default:
		// Declared right, but holding another unit (seconds from
		// unixepoch(), milliseconds from Date.now()) or other values
		// (text from CURRENT_TIMESTAMP, fractional seconds from
		// unixepoch('subsec')): the purge took every row for one
		// processed in 1970 and deleted rows processed moments before.
		// The two ends of the purge index, two seeks (SQLite sorts
		// numbers before text and blobs; min and max take its min/max
		// optimisation one per query, not together).
		tq := d.quote(table.Schema) + "." + d.quote(t.name)
		var lo, hi any
		if err := q.QueryRowxContext(ctx, "SELECT (SELECT min(processed_at) FROM "+tq+"), (SELECT max(processed_at) FROM "+tq+")").
			Scan(&lo, &hi); err != nil {
			return nil, err
		}
		inRange := func(v any) bool {
			n, ok := v.(int64)
			return v == nil || ok && n >= sqliteMinMicros && n < sqliteMaxMicros
		}
		if !inRange(lo) || !inRange(hi) {
			ps.add("UPDATE "+tq+" SET processed_at = "+sqliteProcessedAtMicros+" WHERE typeof(processed_at) <> 'integer' OR"+
				" processed_at < "+strconv.FormatInt(sqliteMinMicros, 10)+" OR processed_at >= "+strconv.FormatInt(sqliteMaxMicros, 10),
				"column %q holds values that are not Unix microseconds (from %v to %v: seconds, milliseconds, text?), by which"+
					" the purge would delete rows inside their window", c.Name, lo, hi)
		}
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
	if err := d.checkObjects(ctx, q, t, table.Schema, recreate, &ps); err != nil {
		return nil, err
	}
	return ps, nil
}

// checkObjects adds the problems of what besides columns and the primary
// key can make a claim merge, drop or reject ids: a second unique index
// (a conflict on it is not the claim's ON CONFLICT target and fails the
// claim; one with a NOCASE collation merges ids), a trigger (RAISE(IGNORE)
// drops the claim's row), a CHECK constraint.
func (d sqliteDialect) checkObjects(ctx context.Context, q sqlx.QueryerContext, t qualifiedName, schema, recreate string, ps *problems) error {
	var unique []struct {
		Name   string `db:"name"`
		Origin string `db:"origin"`
	}
	if err := sqlx.SelectContext(ctx, q, &unique,
		`SELECT name, origin FROM pragma_index_list(?, ?) WHERE "unique" = 1 AND origin <> 'pk'`, t.name, schema); err != nil {
		return err
	}
	for _, u := range unique {
		fix := "DROP INDEX " + d.quote(schema) + "." + d.quote(u.Name)
		if u.Origin == "u" { // a UNIQUE constraint of the table's definition
			fix = recreate
		}
		ps.add(fix, "unique index %q: a second unique key of the claim's row, which can merge or reject ids", u.Name)
	}
	var triggers []string
	if err := sqlx.SelectContext(ctx, q, &triggers,
		"SELECT name FROM "+d.quote(schema)+".sqlite_master WHERE type = 'trigger' AND tbl_name = ? COLLATE NOCASE", t.name); err != nil {
		return err
	}
	for _, name := range triggers {
		ps.add("DROP TRIGGER "+d.quote(schema)+"."+d.quote(name), "trigger %q: it can change, reject or drop the claim's row", name)
	}
	var ddl string
	if err := sqlx.GetContext(ctx, q, &ddl,
		"SELECT sql FROM "+d.quote(schema)+".sqlite_master WHERE type = 'table' AND name = ? COLLATE NOCASE", t.name); err != nil {
		return err
	}
	if sqliteHasCheckConstraint(ddl) {
		ps.add(recreate, "the table has a CHECK constraint, which can reject a valid message id")
	}
	return nil
}

// sqliteHasCheckConstraint says whether the CREATE TABLE statement ddl
// (sqlite_master.sql) has a CHECK constraint: the keyword CHECK as a token
// of its own, outside quoted identifiers ("…", `…`, […]), string literals
// and comments. CHECK is a reserved word in SQLite's grammar, so as a bare
// token it is the constraint and never a name; the letters inside a name
// (checkout_inbox, a column checked_by) were taken for one, and a table the
// inbox had just made was refused.
func sqliteHasCheckConstraint(ddl string) bool {
	isWord := func(c byte) bool {
		return c == '_' || c == '$' || c >= 0x80 || ('0' <= c && c <= '9') || ('a' <= c && c <= 'z') || ('A' <= c && c <= 'Z')
	}
	for i := 0; i < len(ddl); {
		c := ddl[i]
		switch {
		case c == '"' || c == '`' || c == '\'' || c == '[':
			end := c
			if c == '[' {
				end = ']'
			}
			i++
			for i < len(ddl) {
				if ddl[i] == end {
					if end != ']' && i+1 < len(ddl) && ddl[i+1] == end { // a doubled quote stands for itself
						i += 2
						continue
					}
					break
				}
				i++
			}
			i++ // past the closing quote
		case c == '-' && i+1 < len(ddl) && ddl[i+1] == '-':
			for i < len(ddl) && ddl[i] != '\n' {
				i++
			}
		case c == '/' && i+1 < len(ddl) && ddl[i+1] == '*':
			if end := strings.Index(ddl[i+2:], "*/"); end >= 0 {
				i += 2 + end + 2
			} else {
				i = len(ddl)
			}
		case isWord(c):
			start := i
			for i < len(ddl) && isWord(ddl[i]) {
				i++
			}
			// SQLite matches keywords by their ASCII letters alone (a
			// byte from 0x80 up is a name's): not EqualFold, which takes
			// the Kelvin sign for a k.
			if w := ddl[start:i]; len(w) == 5 && asciiUpper(w) == "CHECK" {
				return true
			}
		default:
			i++
		}
	}
	return false
}

// asciiUpper returns s with its ASCII letters in upper case, every other
// byte as it is.
func asciiUpper(s string) string {
	b := []byte(s)
	for i, c := range b {
		if 'a' <= c && c <= 'z' {
			b[i] = c - 'a' + 'A'
		}
	}
	return string(b)
}

// sqliteNowMicros is the current time as whole Unix microseconds, UTC, by
// julianday, which every SQLite has (unixepoch's 'subsec' needs 3.42: an
// older sqlite3 shell running a script gives NULL).
const sqliteNowMicros = "CAST((julianday('now') - 2440587.5) * 86400000000 AS INTEGER)"

// sqliteProcessedAtMicros converts the processed_at of a table made by hand
// to whole Unix microseconds, UTC, whatever it holds: text (SQLite's
// CURRENT_TIMESTAMP, ISO 8601, read by julianday as UTC), a Julian day
// number (real, below 10^7), or a Unix time told by its size for any time
// from 1973 to 5138: seconds below 10^11, milliseconds below 10^14,
// microseconds below 10^17, nanoseconds above; the current time when it is
// none of these (NULL, text julianday cannot read), so that such a row is
// kept for a whole window rather than deleted by the next purge.
const sqliteProcessedAtMicros = "COALESCE(CASE" +
	" WHEN typeof(processed_at) = 'text' THEN CAST((julianday(processed_at) - 2440587.5) * 86400000000 AS INTEGER)" +
	" WHEN typeof(processed_at) NOT IN ('integer', 'real') THEN NULL" +
	" WHEN typeof(processed_at) = 'real' AND abs(processed_at) < 10000000 THEN CAST((processed_at - 2440587.5) * 86400000000 AS INTEGER)" +
	" WHEN abs(processed_at) < 100000000000 THEN CAST(processed_at * 1000000 AS INTEGER)" +
	" WHEN abs(processed_at) < 100000000000000 THEN CAST(processed_at * 1000 AS INTEGER)" +
	" WHEN abs(processed_at) < 100000000000000000 THEN CAST(processed_at AS INTEGER)" +
	" ELSE CAST(processed_at / 1000 AS INTEGER) END, " + sqliteNowMicros + ")"

// The Unix microseconds sqliteProcessedAtMicros keeps as they are (1973 to
// 5138): a processed_at outside them is in another unit.
const (
	sqliteMinMicros int64 = 100000000000000
	sqliteMaxMicros int64 = 100000000000000000
)

// recreateScript returns the statements that replace t with a table of the
// canonical shape, keeping its rows: SQLite cannot alter a column. Its
// processed_at is converted to Unix microseconds (sqliteProcessedAtMicros);
// a table without one gets the current time, so that its rows are kept a
// whole window; its fingerprints are kept. The old table is left, renamed, for the operator to drop
// once the rows are checked: a statement that fails in the sqlite3 shell
// does not stop it (without .bail on), and a DROP after an INSERT that
// failed lost every processed row.
func (d sqliteDialect) recreateScript(t qualifiedName, hasProcessedAt, hasFingerprint bool) string {
	old := oldName(t)
	create := d.createSQL(t)
	cols, values := "consumer, message_id, processed_at", "consumer, message_id, "+sqliteNowMicros
	if hasProcessedAt {
		values = "consumer, message_id, " + sqliteProcessedAtMicros
	}
	if hasFingerprint {
		// Config.ReusedIDs's: left out, a reused id with other content was
		// acked as a duplicate after the script, its event lost.
		cols, values = cols+", fingerprint", values+", fingerprint"
	}
	index := d.quote(t.indexName())
	if t.schema != "" {
		index = d.quote(t.schema) + "." + index
	}
	return "-- in the sqlite3 shell, run it with .bail on first, so that it stops at an error\n" +
		"BEGIN IMMEDIATE;\n" +
		"ALTER TABLE " + t.quoted(d) + " RENAME TO " + d.quote(old.name) + ";\n" +
		// The old table's index of that name would keep create[1] from
		// making the new one.
		"DROP INDEX IF EXISTS " + index + ";\n" +
		create[0] + ";\n" +
		"INSERT INTO " + t.quoted(d) + " (" + cols + ") SELECT " + values + " FROM " + old.quoted(d) + ";\n" +
		create[1] + ";\n" +
		"COMMIT;\n" +
		"-- then, once " + t.quoted(d) + " holds the rows of " + old.quoted(d) + ": DROP TABLE " + old.quoted(d) + ";"
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

func (sqliteDialect) readTx(_ context.Context, db dbConn, f func(q sqlx.QueryerContext) error) error {
	return f(db)
}

// "main": an unqualified name is created in the main database.
func (sqliteDialect) resolveSchema(context.Context, sqlx.QueryerContext, qualifiedName) (string, error) {
	return "main", nil
}

// SQLite drivers ignore the level (SQLite transactions are always
// SERIALIZABLE), so any is accepted.
func (sqliteDialect) checkIsolation(sql.IsolationLevel) error { return nil }

func (sqliteDialect) txOptions(user *sql.TxOptions) *sql.TxOptions { return copyTxOptions(user) }

func (sqliteDialect) nativeBegin(*sql.TxOptions) (string, bool) { return "", false }

func (sqliteDialect) schemaNotes(qualifiedName) string {
	return "-- Primary key (consumer, message_id): the claim. Index on processed_at: the purge.\n" +
		fingerprintNote +
		"-- processed_at: Unix microseconds, UTC, from the database clock.\n"
}

// Each statement is atomic and IF NOT EXISTS, and the second only creates
// the index; running them outside one transaction keeps a concurrent
// starter from failing on a stale read snapshot.
func (d sqliteDialect) createSchema(ctx context.Context, db *sqlx.DB, t qualifiedName, _ int) error {
	return runStatements(ctx, db, t, d.createSQL(t))
}

func (sqliteDialect) maintainSchema(context.Context, dbConn, qualifiedName) error { return nil }

// One DELETE, autocommit: SQLite serialises writers anyway.
func (sqliteDialect) purgeBatch(ctx context.Context, db dbConn, _ qualifiedName, q purgeQuery, _ *hooks) (deleted, found int64, err error) {
	res, err := db.ExecContext(ctx, q.sql, q.args...)
	if err != nil {
		return 0, 0, err
	}
	n, err := res.RowsAffected()
	return n, n, err
}

// No lock: every writer is serialised by the database anyway.
func (sqliteDialect) purgeLock(_ context.Context, db *sqlx.DB, _ qualifiedName, _ bool) (purgeLease, bool, error) {
	return purgeLease{work: db, release: func() error { return nil }}, true, nil
}

func (d sqliteDialect) purgeRound(ctx context.Context, db dbConn, cfg PurgeConfig, t qualifiedName) PurgeRound {
	return purgeRows(ctx, d, db, cfg, t)
}

// fingerprintWriteProbeSQL: none, SQLite has no privileges.
func (sqliteDialect) fingerprintWriteProbeSQL(qualifiedName) string { return "" }

// outboxDurability finds nothing: every SQLite table keeps what commits,
// and an INTEGER PRIMARY KEY is always 64 bits.
func (sqliteDialect) outboxDurability(context.Context, sqlx.QueryerContext, qualifiedName, bool) (problem, fix string, err error) {
	return "", "", nil
}
