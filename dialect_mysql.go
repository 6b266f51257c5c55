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

	"github.com/jmoiron/sqlx"
)

var _ Dialect = mysqlDialect{}

// mysqlDialect is MySQL and MariaDB through go-sql-driver/mysql: every
// statement the inbox runs there.
type mysqlDialect struct{}

func (mysqlDialect) String() string { return "mysql" }

func (mysqlDialect) server() serverKind { return serverMySQL }

func (mysqlDialect) quote(ident string) string { return "`" + ident + "`" }

func (d mysqlDialect) claimSQL(t qualifiedName) string {
	// The update always changes the row (processed_at moves by 1µs), so a
	// duplicate reports 2 rows affected with or without CLIENT_FOUND_ROWS;
	// a no-op update would report 0 without it and 1 with it, which is
	// indistinguishable from a new row. The duplicate's transaction is rolled
	// back, so the change is never seen.
	return "INSERT INTO " + t.quoted(d) + " (consumer, message_id, processed_at) VALUES (?, ?, UTC_TIMESTAMP(6))" +
		" ON DUPLICATE KEY UPDATE processed_at = processed_at + INTERVAL 1 MICROSECOND"
}

// As claimSQL, and a duplicate leaves the stored fingerprint as it is, but
// says through LAST_INSERT_ID(expr) whether it differs from the given one
// (not NULL and another): the statement's OK packet then carries 1 as its
// last insert id, 0 otherwise (the table has no AUTO_INCREMENT column, and
// MySQL and MariaDB report the expr of LAST_INSERT_ID(expr) set by the
// statement itself). A duplicate of the same content then needs no read.
// VALUES(col) is the value the INSERT gave (deprecated from MySQL 8.0.20 in
// favour of a row alias, which MariaDB lacks).
func (d mysqlDialect) claimFingerprintSQL(t qualifiedName) string {
	return "INSERT INTO " + t.quoted(d) + " (consumer, message_id, processed_at, fingerprint) VALUES (?, ?, UTC_TIMESTAMP(6), ?)" +
		" ON DUPLICATE KEY UPDATE processed_at = processed_at + INTERVAL 1 MICROSECOND," +
		" fingerprint = IF(LAST_INSERT_ID(fingerprint IS NOT NULL AND fingerprint <> VALUES(fingerprint)), fingerprint, fingerprint)"
}

func (mysqlDialect) claimFlagsOtherFingerprint() bool { return true }

func (d mysqlDialect) storedFingerprintSQL(t qualifiedName) string {
	// The claim's ON DUPLICATE KEY UPDATE has locked and changed the row in
	// this transaction, so even at REPEATABLE READ this read sees it.
	return "SELECT fingerprint FROM " + t.quoted(d) + " WHERE consumer = ? AND message_id = ?"
}

func (mysqlDialect) fingerprintColumn() string { return "fingerprint  varbinary(16)  NULL" }

func (mysqlDialect) fingerprintColumnSQL(t qualifiedName) (string, []any) {
	schema, args := "DATABASE()", []any{t.name}
	if t.schema != "" {
		schema, args = "?", []any{t.schema, t.name}
	}
	return "SELECT LOWER(column_type) FROM information_schema.columns WHERE table_schema = " + schema +
		" AND table_name = ? AND column_name = 'fingerprint'", args
}

// A binary string that keeps 16 bytes as they are: varbinary of 16 or
// more, binary(16) exactly (a longer binary pads with zero bytes, so the
// stored value would never match), or a blob. A character column would
// pass the bytes through a character set and a collation.
func (d mysqlDialect) fingerprintColumnFits(t qualifiedName, typ string) (string, bool) {
	fix := "ALTER TABLE " + t.quoted(d) + " MODIFY fingerprint varbinary(16) NULL"
	var n int
	switch {
	case typ == "binary(16)", typ == "tinyblob", typ == "blob", typ == "mediumblob", typ == "longblob":
		return fix, true
	case strings.HasPrefix(typ, "varbinary("):
		_, err := fmt.Sscanf(typ, "varbinary(%d)", &n)
		return fix, err == nil && n >= fingerprintSize
	}
	return fix, false
}

func (mysqlDialect) claimed(n int64) (bool, bool) { return n == 1, n == 1 || n == 2 }

func (d mysqlDialect) createSQL(t qualifiedName) []string {
	// varbinary, not varchar: MySQL's and MariaDB's collations compare
	// case-insensitively or ignore trailing spaces (PAD SPACE, even
	// utf8mb4_bin), which would make distinct message ids collide.
	return []string{
		"CREATE TABLE IF NOT EXISTS " + t.quoted(d) + " (\n" +
			"    consumer     varbinary(255) NOT NULL,\n" +
			"    message_id   varbinary(255) NOT NULL,\n" +
			"    processed_at datetime(6)    NOT NULL,\n" +
			"    " + d.fingerprintColumn() + ",\n" +
			"    PRIMARY KEY (consumer, message_id),\n" +
			"    INDEX " + d.quote(t.indexName()) + " (processed_at)\n" +
			") ENGINE=InnoDB",
	}
}

func (mysqlDialect) existsSQL(t qualifiedName) (string, []any) {
	schema, args := "DATABASE()", []any{t.name, t.indexName()}
	if t.schema != "" {
		schema, args = "?", append([]any{t.schema}, args...)
	}
	// The primary key and the purge index, the table implied.
	return "SELECT COUNT(DISTINCT index_name) FROM information_schema.statistics" +
		" WHERE table_schema = " + schema + " AND table_name = ? AND index_name IN ('PRIMARY', ?)", args
}

func (mysqlDialect) keyLock() (string, bool) { return "", false }

func (mysqlDialect) lockedClaim(context.Context, sqlx.QueryerContext, qualifiedName, bool) (string, error) {
	return "", nil
}

func (mysqlDialect) claimFunctionSQL(qualifiedName, bool) string { return "" }

func (mysqlDialect) uncodedBoundaryErrIsLostConn() bool { return true }

func (mysqlDialect) preparesByDefault() bool { return true }

// A deadlock (1213) or a snapshot-isolation conflict (1020) makes InnoDB roll
// the whole transaction back and end it: a handler that ignores the error
// runs its later statements in autocommit mode, and COMMIT succeeds with
// nothing to commit. The claim's row tells: it is there, and visible to a
// locking read, only while the transaction holds it or once another delivery
// committed the key (then the message is processed either way). A locking
// read, so that no isolation level can show another delivery's uncommitted
// claim.
// preCommitCheck runs whatever the driver says.
func (mysqlDialect) statuslessCheck(qualifiedName) (string, bool) { return "", false }

func (d mysqlDialect) preCommitCheck(t qualifiedName) (string, bool) {
	return claimCountSQL(t.quoted(d)) + " FOR UPDATE", true
}

func (mysqlDialect) expiredSQL(byConsumer bool) string {
	where := "processed_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND"
	if byConsumer {
		where += " AND consumer = ?"
	}
	return where
}

// Not a DELETE: the batch's keys and processed_at (microseconds since the
// Unix epoch), by a non-locking consistent read of the processed_at index
// (see purgeBatch); resume is the same read from a lower bound on
// processed_at, its bind parameter after the consumer's.
func (d mysqlDialect) purgeStatement(t qualifiedName, cutoff int64, batch int, consumer string) purgeQuery {
	where := mysqlBeforeCutoff
	if consumer != "" {
		where += " AND consumer = ?"
	}
	keys := func(where string) string {
		return "SELECT consumer, message_id, TIMESTAMPDIFF(MICROSECOND, TIMESTAMP '1970-01-01 00:00:00', processed_at) AS processed_us FROM " +
			t.quoted(d) + " WHERE " + where + " ORDER BY processed_at LIMIT ?"
	}
	return purgeQuery{
		sql:  keys(where),
		args: purgeArgs(cutoff, batch, consumer),
		size: int64(batch),
		resume: func(int64) string {
			return keys(where + " AND processed_at >= TIMESTAMPADD(MICROSECOND, ?, TIMESTAMP '1970-01-01 00:00:00')")
		},
		below:  keys(where + " AND processed_at < TIMESTAMPADD(MICROSECOND, ?, TIMESTAMP '1970-01-01 00:00:00')"),
		cursor: &purgeCursor{},
	}
}

// mysqlBeforeCutoff is processed_at (DATETIME(6), UTC) before the bind
// parameter, microseconds since the Unix epoch: DATETIME arithmetic, which
// no session time zone changes.
const mysqlBeforeCutoff = "processed_at < TIMESTAMPADD(MICROSECOND, ?, TIMESTAMP '1970-01-01 00:00:00')"

func (mysqlDialect) nowMicrosSQL() string {
	return "SELECT TIMESTAMPDIFF(MICROSECOND, TIMESTAMP '1970-01-01 00:00:00', UTC_TIMESTAMP(6))"
}

// An INSERT of no row (needing only the claim's privilege) is still
// refused where writes are
// (1290 read_only/super_read_only, 1792 a read-only transaction, 1836
// innodb_read_only).
func (d mysqlDialect) writeProbeSQL(t qualifiedName) string {
	return "INSERT INTO " + t.quoted(d) + " (consumer, message_id, processed_at) SELECT '', '', UTC_TIMESTAMP(6) FROM DUAL WHERE 1 = 0"
}

// The claim's column privileges (claimFingerprintSQL: INSERT, and in its ON
// DUPLICATE KEY UPDATE SELECT and UPDATE): MySQL/MariaDB check them when the
// statement is prepared, whatever it writes. A column the user may use in
// part is visible in information_schema, and every claim failed on it.
func (d mysqlDialect) fingerprintWriteProbeSQL(t qualifiedName) string {
	return "INSERT INTO " + t.quoted(d) + " (consumer, message_id, processed_at, fingerprint) SELECT '', '', UTC_TIMESTAMP(6), NULL" +
		" FROM DUAL WHERE 1 = 0 ON DUPLICATE KEY UPDATE processed_at = processed_at, fingerprint = fingerprint"
}

// MySQL has no SET LOCAL, and lock_wait_timeout would outlive the transaction.
func (mysqlDialect) writeProbeLockTimeout() string { return "" }

func (mysqlDialect) readOnlyTxSQL() string { return "" }

func (d mysqlDialect) oldestAgeSQL(t qualifiedName, consumer string) (string, []any) {
	q := "SELECT TIMESTAMPDIFF(MICROSECOND, MIN(processed_at), UTC_TIMESTAMP(6)) FROM " + t.quoted(d)
	if consumer == "" {
		return q, nil
	}
	return q + " WHERE consumer = ?", []any{consumer}
}

// mysqlTableWhere is the information_schema.tables condition for t and its
// arguments: the current database unless t names its schema.
func mysqlTableWhere(t qualifiedName) (string, []any) {
	if t.schema != "" {
		return "table_schema = ? AND table_name = ?", []any{t.schema, t.name}
	}
	return "table_schema = DATABASE() AND table_name = ?", []any{t.name}
}

// InnoDB's estimate, which can be off by 40-50 %.
func (mysqlDialect) estimateRowsSQL(t qualifiedName) (string, []any) {
	where, args := mysqlTableWhere(t)
	return "SELECT COALESCE(table_rows, 0) FROM information_schema.tables WHERE " + where, args
}

// processed_at holds UTC: arithmetic from the epoch, no CONVERT_TZ.
func (d mysqlDialect) spanSQL(t qualifiedName) string {
	return "SELECT TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', MIN(processed_at)), " +
		"TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', MAX(processed_at)), " +
		"TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) FROM " + t.quoted(d)
}

func (mysqlDialect) sizeSQL(t qualifiedName) (string, []any) {
	where, args := mysqlTableWhere(t)
	return "SELECT data_length + index_length FROM information_schema.tables WHERE " + where, args
}

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

// checkTable reports what makes t unfit for the claim and the purge: a view
// or a storage engine without transactions, wrong columns, wrong keys and
// indexes, and the objects checkObjects finds; each problem in that order.
func (d mysqlDialect) checkTable(ctx context.Context, q sqlx.QueryerContext, t qualifiedName) ([]tableProblem, error) {
	where, args := mysqlTableWhere(t)
	var ps problems
	isTable, err := d.checkTableKind(ctx, q, t, where, args, &ps)
	if err != nil {
		return nil, err
	}
	if !isTable {
		return ps, nil
	}
	if err := d.checkColumns(ctx, q, t, where, args, &ps); err != nil {
		return nil, err
	}
	if err := d.checkIndexes(ctx, q, t, where, args, &ps); err != nil {
		return nil, err
	}
	if err := d.checkObjects(ctx, q, t, &ps); err != nil {
		return nil, err
	}
	return ps, nil
}

// checkTableKind reads t's type and storage engine (where and args select t
// in information_schema): it reports false, with a problem, for a view,
// which no other check applies to, and a problem for an engine other than
// InnoDB. A missing t is tableNotFound's error.
func (d mysqlDialect) checkTableKind(ctx context.Context, q sqlx.QueryerContext, t qualifiedName, where string, args []any, ps *problems) (bool, error) {
	var table struct {
		Type   string         `db:"table_type"`
		Engine sql.NullString `db:"engine"`
	}
	err := sqlx.GetContext(ctx, q, &table, "SELECT TABLE_TYPE AS table_type, ENGINE AS engine FROM information_schema.TABLES WHERE "+where, args...)
	if errors.Is(err, sql.ErrNoRows) {
		return false, tableNotFound(t)
	}
	if err != nil {
		return false, err
	}
	if strings.Contains(table.Type, "VIEW") {
		ps.add("replace it with the table of the canonical DDL below", "%q is a %q, not a table", t.String(), table.Type)
		return false, nil
	}
	if strings.EqualFold(table.Type, "SYSTEM VERSIONED") {
		// MariaDB's system-versioned tables (WITH SYSTEM VERSIONING).
		ps.add("ALTER TABLE "+t.quoted(d)+" DROP SYSTEM VERSIONING", "the table is %q (MariaDB keeps every updated or deleted row"+
			" as history): the claim of a processed message's redelivery affects 3 rows instead of 0 or 2, so every duplicate fails"+
			" with ErrUnexpectedRowsAffected, and the purge's DELETE keeps its rows in the table", table.Type)
	}
	if !strings.EqualFold(table.Engine.String, "InnoDB") {
		ps.add("ALTER TABLE "+t.quoted(d)+" ENGINE=InnoDB", "the table uses the storage engine %q, not InnoDB: the claim relies on"+
			" InnoDB's transactions and row locks (on MyISAM a claim survives its handler's failure)", table.Engine.String)
	}
	return true, nil
}

// checkColumns reports the key columns' and processed_at's problems, then
// any other column a claim cannot leave out.
func (d mysqlDialect) checkColumns(ctx context.Context, q sqlx.QueryerContext, t qualifiedName, where string, args []any, ps *problems) error {
	var cols []myColumn
	if err := sqlx.SelectContext(ctx, q, &cols, myColumnsSQL+where+" ORDER BY ORDINAL_POSITION", args...); err != nil {
		return err
	}
	byName := map[string]myColumn{}
	for _, c := range cols {
		byName[strings.ToLower(c.Name)] = c
	}
	tq := t.quoted(d)
	if err := d.checkKeyColumns(ctx, q, tq, byName, ps); err != nil {
		return err
	}
	var tz string // the session's time zone, which a TIMESTAMP column's fix converts by
	if c, ok := byName[processedAt]; ok && c.DataType == "timestamp" {
		if err := sqlx.GetContext(ctx, q, &tz, "SELECT @@session.time_zone"); err != nil {
			return err
		}
	}
	myCheckProcessedAt(tq, byName, tz, ps)
	if c, ok := byName[processedAt]; ok && c.DataType == "datetime" {
		// Rows of the zero date (a processed_at added NOT NULL without a
		// default: every existing row got it) are older than any cutoff,
		// and the next purge deleted rows processed moments before. Read
		// by the processed_at index when there is one.
		var zero int
		err := sqlx.GetContext(ctx, q, &zero, "SELECT COUNT(*) FROM (SELECT 1 FROM "+tq+" WHERE "+processedAt+" < '1000-01-01' LIMIT 1) AS z")
		if err != nil {
			return err
		}
		if zero > 0 {
			ps.add("UPDATE "+tq+" SET "+processedAt+" = UTC_TIMESTAMP(6) WHERE "+processedAt+" < '1000-01-01'",
				"column %q holds the zero date (0000-00-00), which the purge takes for the oldest time and deletes inside the"+
					" window; the fix keeps those rows a whole window from now", processedAt)
		}
	}
	myCheckOtherColumns(tq, cols, ps)
	return nil
}

// checkKeyColumns reports a key column (consumer, message_id) of the table
// tq (quoted) that is missing, nullable, or of a type or collation
// keyColumnProblem refuses.
func (d mysqlDialect) checkKeyColumns(ctx context.Context, q sqlx.QueryerContext, tq string, byName map[string]myColumn, ps *problems) error {
	for _, name := range keyColumns {
		c, ok := byName[name]
		if !ok {
			ps.add("ALTER TABLE "+tq+" ADD COLUMN "+name+" varbinary(255) NOT NULL", "column %q is missing", name)
			continue
		}
		fix := myKeyColumnFix(tq, c)
		what, err := d.keyColumnProblem(ctx, q, c)
		if err != nil {
			return err
		}
		if what == "" && c.Nullable != "NO" {
			what = fmt.Sprintf("column %q is nullable", c.Name)
		}
		if what != "" {
			ps.add(fix, "%s", what)
		}
	}
	return nil
}

// myKeyColumnFix returns the statements that make key column c of the
// table tq (quoted) a varbinary(255) keeping the ids stored in it as the
// claims send them: UTF-8 (a column of another character set is converted
// to utf8mb4 first; made varbinary at once it kept latin1's bytes, and no
// id processed before matched its redelivery's claim), without a binary(N)
// column's padding of zero bytes (kept, every id processed before became
// another key). Ids hold no NUL (checkKey), so the padding is all trimmed.
func myKeyColumnFix(tq string, c myColumn) string {
	name := c.Name
	modify := "ALTER TABLE " + tq + " MODIFY " + name + " varbinary(255) NOT NULL"
	switch {
	case c.DataType == "binary":
		return modify + ";\nUPDATE " + tq + " SET " + name + " = TRIM(TRAILING X'00' FROM " + name + ");"
	case c.Charset.Valid && c.Charset.String != "utf8mb4" && c.Charset.String != "binary":
		return "ALTER TABLE " + tq + " MODIFY " + name + " varchar(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL;\n" + modify + ";"
	}
	return modify
}

// myCheckProcessedAt reports a processed_at column of the table tq (quoted)
// that is missing or is not a datetime(6). tz is the session's time zone
// (read when the column is a TIMESTAMP), by which the inbox wrote that
// column's instants.
func myCheckProcessedAt(tq string, byName map[string]myColumn, tz string, ps *problems) {
	fix := "ALTER TABLE " + tq + " MODIFY " + processedAt + " datetime(6) NOT NULL"
	switch c, ok := byName[processedAt]; {
	case !ok:
		// Added NULL, set to the current time, then made NOT NULL: added
		// NOT NULL at once, every row got the zero date, and the next
		// purge deleted rows processed moments before (their redeliveries
		// were processed again). Now, each row is kept for a whole window.
		ps.add("ALTER TABLE "+tq+" ADD COLUMN "+processedAt+" datetime(6) NULL;\n"+
			"UPDATE "+tq+" SET "+processedAt+" = UTC_TIMESTAMP(6);\n"+fix+";", "column %q is missing", processedAt)
	case c.DataType == "timestamp":
		// The conversion to datetime goes by the session's time zone: the
		// one the inbox's sessions write in (this check's), so that each row
		// keeps the UTC time it was written with, whoever runs the fix.
		ps.add("SET time_zone = '"+strings.ReplaceAll(tz, "'", "''")+"';\n"+fix+";",
			"column %q has type %q, which the server converts by the session time zone:"+
				" the time zone would change which rows a purge deletes", c.Name, c.Type)
	case c.DataType != "datetime":
		ps.add(fix, "column %q has type %q, not datetime(6)", c.Name, c.Type)
	case c.Precision.Int64 != 6:
		ps.add(fix, "column %q has type %q, with fewer than 6 fractional digits: the claim of a duplicate adds"+
			" 1 microsecond to it and must change the row", c.Name, c.Type)
	}
}

// myCheckOtherColumns reports every column of the table tq (quoted) besides
// the inbox's own that is NOT NULL without a default or a generated value:
// the claim, which sets only the inbox's columns, would fail.
func myCheckOtherColumns(tq string, cols []myColumn, ps *problems) {
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
}

// checkIndexes reports a missing or wrong primary key, any other unique
// index (ON DUPLICATE KEY UPDATE fires on it too), and a missing index led
// by processed_at.
func (d mysqlDialect) checkIndexes(ctx context.Context, q sqlx.QueryerContext, t qualifiedName, where string, args []any, ps *problems) error {
	var keys []myIndexColumn
	if err := sqlx.SelectContext(ctx, q, &keys, myIndexesSQL+where+" ORDER BY INDEX_NAME, SEQ_IN_INDEX", args...); err != nil {
		return err
	}
	indexes := map[string][]myIndexColumn{}
	var names []string // in the order of the query
	for _, k := range keys {
		if _, ok := indexes[k.Index]; !ok {
			names = append(names, k.Index)
		}
		indexes[k.Index] = append(indexes[k.Index], k)
	}
	tq := t.quoted(d)
	standIn := myCheckPrimaryKey(tq, indexes, names, ps)
	for _, name := range names {
		// ON DUPLICATE KEY UPDATE fires on any unique key, so a key this
		// index shares (another consumer's message id) is taken for a
		// duplicate.
		if idx := indexes[name]; name != "PRIMARY" && name != standIn && idx[0].Unique {
			ps.add("ALTER TABLE "+tq+" DROP INDEX "+myQuote(name),
				"unique index %q: ON DUPLICATE KEY UPDATE fires on it too, so a key it shares (another consumer's message id) is taken for a duplicate", name)
		}
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
	return nil
}

// myCheckPrimaryKey reports a primary key of the table tq (quoted) that is
// missing or is not exactly the key columns. Without one, it returns the
// name of a unique index on the key columns that the fix replaces by the
// primary key (the last of them, if several), which checkIndexes must not
// report again; otherwise "".
func myCheckPrimaryKey(tq string, indexes map[string][]myIndexColumn, names []string, ps *problems) (standIn string) {
	want := strings.Join(keyColumns, ", ")
	pk, ok := indexes["PRIMARY"]
	if !ok {
		fix := "ALTER TABLE " + tq + " ADD PRIMARY KEY (" + want + ")"
		for _, name := range names {
			if idx := indexes[name]; idx[0].Unique && myIndexIsKey(idx) {
				standIn = name
				fix = "ALTER TABLE " + tq + " DROP INDEX " + myQuote(name) + ", ADD PRIMARY KEY (" + want + ")"
			}
		}
		ps.add(fix, "the table has no primary key; the claim needs the primary key %s"+
			" (a UNIQUE index does not do: InnoDB takes gap locks on it that block neighbouring claims)", nameList(keyColumns))
		return standIn
	}
	if !myIndexIsKey(pk) {
		why := ""
		for _, k := range pk {
			if k.SubPart.Valid {
				why = ": it indexes a prefix of a key column, so ids that share the prefix merge"
			}
		}
		ps.add("ALTER TABLE "+tq+" DROP PRIMARY KEY, ADD PRIMARY KEY ("+want+")",
			"the primary key is (%s), not %s%s", myIndexColumns(pk), nameList(keyColumns), why)
	}
	return ""
}

// myObjectsSQL lists, as (what, fix), what besides columns and indexes can
// make a claim change or reject ids, or a purge fail or reach other rows:
// triggers, CHECK constraints, foreign keys to and from the table. Its parameters are the schema (twice, or DATABASE()) and the
// table name, for each part.
func myObjectsSQL(t qualifiedName) (string, []any) {
	schema, args := "DATABASE()", []any{}
	if t.schema != "" {
		schema = "?"
	}
	arg := func() []any {
		if t.schema != "" {
			return []any{t.schema, t.name}
		}
		return []any{t.name}
	}
	tq := t.quoted(mysqlDialect{})
	query := "SELECT CONCAT('trigger ', TRIGGER_NAME, ': it can change or reject the claim''s row') AS what," +
		" CONCAT('DROP TRIGGER `', TRIGGER_SCHEMA, '`.`', TRIGGER_NAME, '`') AS fix" +
		" FROM information_schema.TRIGGERS WHERE EVENT_OBJECT_SCHEMA = " + schema + " AND EVENT_OBJECT_TABLE = ?" +
		" UNION ALL SELECT CONCAT('CHECK constraint ', CONSTRAINT_NAME, ': it can reject a valid message id'), CONCAT('ALTER TABLE " + tq + " DROP CONSTRAINT `', CONSTRAINT_NAME, '`')" +
		" FROM information_schema.TABLE_CONSTRAINTS WHERE TABLE_SCHEMA = " + schema + " AND TABLE_NAME = ? AND CONSTRAINT_TYPE = 'CHECK'" +
		" UNION ALL SELECT CONCAT('foreign key ', CONSTRAINT_NAME, ' of ', TABLE_NAME, ' references the inbox table: a purge fails on it, or cascades into that table')," +
		" CONCAT('ALTER TABLE `', CONSTRAINT_SCHEMA, '`.`', TABLE_NAME, '` DROP FOREIGN KEY `', CONSTRAINT_NAME, '`')" +
		" FROM information_schema.REFERENTIAL_CONSTRAINTS WHERE UNIQUE_CONSTRAINT_SCHEMA = " + schema + " AND REFERENCED_TABLE_NAME = ?" +
		" UNION ALL SELECT CONCAT('foreign key ', CONSTRAINT_NAME, ' from the inbox table: it can reject a claim'), CONCAT('ALTER TABLE " + tq + " DROP FOREIGN KEY `', CONSTRAINT_NAME, '`')" +
		" FROM information_schema.REFERENTIAL_CONSTRAINTS WHERE CONSTRAINT_SCHEMA = " + schema + " AND TABLE_NAME = ?"
	for range 4 {
		args = append(args, arg()...)
	}
	return query, args
}

// checkObjects adds the problems of myObjectsSQL.
func (d mysqlDialect) checkObjects(ctx context.Context, q sqlx.QueryerContext, t qualifiedName, ps *problems) error {
	query, args := myObjectsSQL(t)
	var objects []struct {
		What string `db:"what"`
		Fix  string `db:"fix"`
	}
	if err := sqlx.SelectContext(ctx, q, &objects, query, args...); err != nil {
		return err
	}
	for _, o := range objects {
		ps.add(o.Fix, "%s", o.What)
	}
	return nil
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
	// A character column takes what the session sends in its character
	// set: a utf8mb3 session (the DSN's charset=utf8) cannot send a
	// 4-byte character, and an id with one (an emoji) failed its claim on
	// every delivery (1366), or its pre-commit check without strict mode
	// (1267). A varbinary column takes the bytes as they are.
	var sessionCharset string
	if err := sqlx.GetContext(ctx, q, &sessionCharset, "SELECT @@character_set_connection"); err != nil {
		return "", err
	}
	if sessionCharset != "utf8mb4" && sessionCharset != "binary" {
		return fmt.Sprintf("column %q is utf8mb4 but the checking session sends strings in %s (@@character_set_connection, the"+
			" DSN's charset=…): an id with a character %s cannot hold (an emoji) fails its claim on every delivery; use"+
			" charset=utf8mb4 in the DSN, or make the column varbinary", c.Name, sessionCharset, sessionCharset), nil
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

func (mysqlDialect) readTx(_ context.Context, db dbConn, f func(q sqlx.QueryerContext) error) error {
	return f(db)
}

// The current database.
func (mysqlDialect) resolveSchema(ctx context.Context, q sqlx.QueryerContext, _ qualifiedName) (string, error) {
	var schema string
	err := sqlx.GetContext(ctx, q, &schema, "SELECT DATABASE()")
	return schema, err
}

func (d mysqlDialect) checkIsolation(l sql.IsolationLevel) error {
	if !standardIsolation(l) {
		return errIsolationRefused(l, d)
	}
	return nil
}

func (mysqlDialect) txOptions(user *sql.TxOptions) *sql.TxOptions { return copyTxOptions(user) }

func (mysqlDialect) nativeBegin(*sql.TxOptions) (string, bool) { return "", false }

func (mysqlDialect) schemaNotes(qualifiedName) string {
	return "-- Primary key (consumer, message_id): the claim. Index on processed_at: the purge.\n" +
		fingerprintNote +
		"-- varbinary, not varchar: MySQL and MariaDB collations fold case or trailing spaces\n" +
		"-- (PAD SPACE, even utf8mb4_bin), and message ids must compare byte for byte.\n" +
		"-- processed_at: UTC_TIMESTAMP(6), UTC whatever the session time zone.\n"
}

// One CREATE TABLE IF NOT EXISTS (index inline), atomic under the metadata
// lock. When the table exists without its purge index (found 1), CREATE
// TABLE IF NOT EXISTS would skip the inline index with the table, and MySQL
// 8 has no CREATE INDEX IF NOT EXISTS: a starter that loses that race to a
// concurrent one gets error 1061 (duplicate key name), which means the index
// is there.
func (d mysqlDialect) createSchema(ctx context.Context, db *sqlx.DB, t qualifiedName, found int) error {
	stmts := d.createSQL(t)
	if found == 1 {
		stmts = []string{"CREATE INDEX " + d.quote(t.indexName()) + " ON " + t.quoted(d) + " (processed_at)"}
	}
	err := runStatements(ctx, db, t, stmts)
	if found == 1 && hasMySQLNumber(err, 1061) {
		return nil // ER_DUP_KEYNAME: a concurrent starter created the index first
	}
	return err
}

func (mysqlDialect) maintainSchema(context.Context, dbConn, qualifiedName) error { return nil }

// A DELETE that walks the processed_at index must lock the first record
// past the cutoff to see that the range ended, at any isolation level; when
// that record is a live handler's uncommitted claim (a quiet table), the
// batch would wait for the whole handler. So the keys are read first with a
// non-locking consistent read (purgeStatement), and then deleted by primary key,
// at READ COMMITTED: only the expired rows themselves are locked.
//
// A batch after one that read rows reads from the newest processed_at that
// one read (pq.cursor, inclusive: rows of the same instant are read again
// if still there), not from the oldest entry: InnoDB keeps a deleted row's
// index entries for as long as any snapshot older than the delete is open
// (a mysqldump --single-transaction, a long report), and a read from the
// oldest entry stepped over every row the round had deleted, each batch
// slower than the one before (BenchmarkPurgeBehindOpenSnapshot). A batch
// from a bound that finds fewer rows than the batch size (the purge's
// last) also reads, up to the batch size, the expired rows below the bound
// that the round has not seen (a claim whose transaction committed after
// the batches passed its processed_at), from the oldest entry once; when
// there are any, the next batch starts from the oldest entry.
func (d mysqlDialect) purgeBatch(ctx context.Context, db dbConn, t qualifiedName, pq purgeQuery, h *hooks) (deleted, found int64, err error) {
	args := pq.args
	tx, err := db.BeginTxx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return 0, 0, err
	}
	defer tx.Rollback() //nolint:errcheck // no-op after Commit
	type key struct {
		Consumer    []byte        `db:"consumer"`
		MessageID   []byte        `db:"message_id"`
		ProcessedUS sql.NullInt64 `db:"processed_us"` // NULL for a zero date, or a zero day or month
	}
	var keys []key
	bounded := pq.cursor != nil && pq.cursor.set
	// withBound is args with the bound before the batch size, the last
	// bind parameter, as limit.
	withBound := func(limit int64) []any {
		return append(append(slices.Clone(args[:len(args)-1]), pq.cursor.fromMicros), limit)
	}
	belowBound := false
	if !bounded {
		if err := sqlx.SelectContext(ctx, tx, &keys, pq.sql, args...); err != nil {
			return 0, 0, err
		}
	} else {
		if err := sqlx.SelectContext(ctx, tx, &keys, pq.resume(pq.cursor.fromMicros), withBound(pq.size)...); err != nil {
			return 0, 0, err
		}
		if int64(len(keys)) < pq.size {
			var below []key
			if err := sqlx.SelectContext(ctx, tx, &below, pq.below, withBound(pq.size-int64(len(keys)))...); err != nil {
				return 0, 0, err
			}
			belowBound = len(below) > 0
			keys = append(below, keys...)
		}
	}
	h.purgeKeysRead()
	// consumer = ? AND message_id IN (...) is a primary-key range MariaDB
	// resolves by point lookups; a row-value IN ((?, ?), ...) list it scans,
	// locking every row it reads, live claims included.
	byConsumer := map[string][]any{}
	var consumers []string
	for _, k := range keys {
		c := string(k.Consumer)
		if _, ok := byConsumer[c]; !ok {
			consumers = append(consumers, c)
		}
		byConsumer[c] = append(byConsumer[c], k.MessageID)
	}
	const perStatement = 1000 // placeholders, far below MySQL's 65,535
	for _, c := range consumers {
		ids := byConsumer[c]
		for lo := 0; lo < len(ids); lo += perStatement {
			chunk := ids[lo:min(len(ids), lo+perStatement)]
			// The expiry condition again: a key that another purge deleted
			// and a late redelivery claimed afresh since the read above is
			// young now, and must stay.
			query := "DELETE FROM " + t.quoted(d) + " WHERE consumer = ? AND message_id IN (?" +
				strings.Repeat(", ?", len(chunk)-1) + ") AND " + mysqlBeforeCutoff
			stmtArgs := append(append([]any{c}, chunk...), args[0]) // args[0]: the cutoff
			res, err := tx.ExecContext(ctx, query, stmtArgs...)
			if err != nil {
				return 0, 0, err
			}
			n, err := res.RowsAffected()
			if err != nil {
				return 0, 0, err
			}
			deleted += n
		}
	}
	if err := tx.Commit(); err != nil {
		return 0, 0, err
	}
	if pq.cursor != nil {
		*pq.cursor = purgeCursor{}
		// A zero date (or a zero day or month, which MariaDB's default
		// sql_mode stores) has no microseconds since the epoch: the next
		// batch reads from the oldest entry, where those rows sort.
		if last := len(keys) - 1; last >= 0 && !belowBound && keys[last].ProcessedUS.Valid {
			*pq.cursor = purgeCursor{set: true, fromMicros: keys[last].ProcessedUS.Int64}
		}
	}
	return deleted, int64(len(keys)), nil
}

// GET_LOCK, a session lock, on one connection taken from the pool for the
// round; the round's statements run on that connection.
func (d mysqlDialect) purgeLock(ctx context.Context, db *sqlx.DB, t qualifiedName, wait bool) (purgeLease, bool, error) {
	conn, err := db.Connx(ctx)
	if err != nil {
		return purgeLease{}, false, fmt.Errorf("connection: %w", err)
	}
	ct, err := canonicalTable(ctx, conn, d, t)
	if err != nil {
		conn.Close()
		return purgeLease{}, false, err
	}
	name := mysqlLockName(purgeLockKey(ct))
	timeout := 0
	if wait {
		// A year: until ctx ends. Not -1, MySQL's "forever": MariaDB
		// answers NULL to a negative timeout, at once, without the lock.
		timeout = 365 * 24 * 3600
	}
	var got sql.NullBool
	if err := conn.QueryRowxContext(ctx, "SELECT GET_LOCK(?, ?) = 1", name, timeout).Scan(&got); err != nil {
		// The server may have granted the lock before the error (a
		// context cancelled in between): never return this session to
		// the pool, or it would hold the lock for good.
		_ = conn.Raw(func(any) error { return errBadConn })
		conn.Close()
		return purgeLease{}, false, err
	}
	if !got.Valid || !got.Bool {
		conn.Close()
		return purgeLease{}, false, nil
	}
	release := func() error {
		defer conn.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := conn.ExecContext(ctx, "SELECT RELEASE_LOCK(?)", name); err != nil {
			// The session may still hold the lock: close the connection
			// instead of returning it to the pool, which releases it.
			_ = conn.Raw(func(any) error { return errBadConn })
			return err
		}
		return nil
	}
	return purgeLease{work: conn, release: release}, true, nil
}

func (d mysqlDialect) purgeRound(ctx context.Context, db dbConn, cfg PurgeConfig, t qualifiedName) PurgeRound {
	return purgeRows(ctx, d, db, cfg, t)
}

// mysqlLockName is the GET_LOCK name for key: at most 64 characters.
func mysqlLockName(key int64) string { return fmt.Sprintf("watermill-inbox-purge-%016x", uint64(key)) }

// outboxDurability refuses a storage engine other than InnoDB (MyISAM
// keeps a handler's outputs when its transaction rolls back, and the relay
// sends messages of a transaction that never committed) and an outbox id
// narrower than bigint (it runs out, and every handler's transaction then
// fails on its insert).
func (d mysqlDialect) outboxDurability(ctx context.Context, q sqlx.QueryerContext, t qualifiedName, outbox bool) (problem, fix string, err error) {
	var kind struct {
		Engine string `db:"engine"`
		IDType string `db:"id_type"`
	}
	schema, args := "DATABASE()", []any{t.name}
	if t.schema != "" {
		schema, args = "?", []any{t.name, t.schema}
	}
	err = sqlx.GetContext(ctx, q, &kind, `SELECT COALESCE(t.ENGINE, '') AS engine,
		COALESCE((SELECT c.DATA_TYPE FROM information_schema.COLUMNS c WHERE c.TABLE_SCHEMA = t.TABLE_SCHEMA
			AND c.TABLE_NAME = t.TABLE_NAME AND c.COLUMN_NAME = 'id'), '') AS id_type
		FROM information_schema.TABLES t WHERE t.TABLE_NAME = ? AND t.TABLE_SCHEMA = `+schema, args...)
	switch {
	case err != nil:
		return "", "", err
	case kind.Engine != "" && !strings.EqualFold(kind.Engine, "InnoDB"):
		return "uses the storage engine " + kind.Engine + ", not InnoDB: a handler's outputs written to it stay when its" +
			" transaction rolls back, and the relay sends them", "ALTER TABLE " + t.quoted(d) + " ENGINE=InnoDB", nil
	case outbox && kind.IDType != "" && !strings.EqualFold(kind.IDType, "bigint"):
		return "has an id of type " + kind.IDType + ", which runs out, and every handler's transaction then fails on its insert",
			"ALTER TABLE " + t.quoted(d) + " MODIFY id bigint NOT NULL AUTO_INCREMENT", nil
	}
	return "", "", nil
}
