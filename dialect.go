package inbox

import (
	"context"
	"fmt"
	"hash/fnv"
	"regexp"
	"strings"

	"github.com/jmoiron/sqlx"
)

// Dialect is the SQL dialect of the database that holds the inbox table. The
// only implementations are PostgreSQL, MySQL and SQLite; the interface is
// sealed (it has an unexported method) so that every statement the inbox runs
// is one this package wrote and tested.
type Dialect interface {
	// String returns the dialect's name: "postgres", "mysql" or "sqlite".
	String() string

	// quote quotes one identifier that has already passed the table name
	// pattern, so it cannot contain a quote character.
	quote(ident string) string
	// claimSQL returns the insert-if-absent statement for table. Its two bind
	// parameters are the consumer and the message id.
	claimSQL(table qualifiedName) string
	// claimed maps the claim's rows affected to claimed (a new row) or not (a
	// duplicate); ok is false for a count the statement cannot produce.
	claimed(rowsAffected int64) (claimed, ok bool)
	// createSQL returns the DDL statements that create the table and its
	// purge index if they do not exist, in order.
	createSQL(table qualifiedName) []string
	// existsSQL returns a query for how many of the table and its purge
	// index exist (2 means both), reading only the catalog.
	existsSQL(table qualifiedName) (string, []any)
	// keyLock returns a statement that takes a transaction-scoped lock on
	// one key (its bind parameter is an int64 hash of table and key), run
	// before the claim, and true; false when the primary key alone decides.
	keyLock() (stmt string, ok bool)
	// preCommitCheck returns a query, run in the transaction right before
	// COMMIT, that counts the claim's row (bind parameters: consumer,
	// message id), 0 meaning the database has already rolled the
	// transaction back, and true; false when COMMIT itself fails for a
	// transaction the database rolled back.
	preCommitCheck(table qualifiedName) (query string, ok bool)
	// uncodedBoundaryErrIsLostConn reports whether a COMMIT error whose
	// chain carries no database error code means the connection was lost
	// around the COMMIT, and whether a BEGIN that failed so is worth one
	// retry: go-sql-driver/mysql reports a connection lost after the
	// statement was sent as its plain ErrInvalidConn. Not on PostgreSQL,
	// where pgx reports a lost connection as a network error or a
	// SafeToRetry one, and reports a COMMIT that PostgreSQL turned into
	// ROLLBACK (after a failed statement the handler ignored, whose cause is
	// unknown) as the plain ErrTxCommitRollback; not on SQLite, which has no
	// connection to lose.
	uncodedBoundaryErrIsLostConn() bool
	// preparesByDefault reports whether the inbox prepares its claim on
	// the pool without Config.PrepareStatements: not on PostgreSQL, where a
	// named prepared statement outlives the transaction, which breaks
	// behind a transaction-mode connection pooler (PgBouncer before 1.21).
	preparesByDefault() bool

	// expiredSQL returns the condition for the rows a purge deletes:
	// processed_at older than the window (bind parameter 1, microseconds) by
	// the database clock in UTC, and, when byConsumer, consumer = parameter 2.
	// Purge and CountExpired share it, so a dry run counts exactly what a
	// purge deletes.
	expiredSQL(byConsumer bool) string
	// purgeSQL returns one purge batch: a DELETE of at most the batch size
	// (the parameter after expiredSQL's) expired rows, oldest first; on
	// MySQL a non-locking SELECT of their keys instead (see purgeBatch).
	purgeSQL(table qualifiedName, byConsumer bool) string
	// oldestAgeSQL returns a query for the age of the oldest row, in
	// microseconds by the database clock, NULL when the table is empty.
	oldestAgeSQL(table qualifiedName) string
	// estimateRowsSQL returns a cheap query for the table's row count (an
	// estimate where the database keeps one); no row means no such table.
	estimateRowsSQL(table qualifiedName) (string, []any)
	// spanSQL returns a query for the smallest and largest processed_at, as
	// Unix microseconds.
	spanSQL(table qualifiedName) string
	// sizeSQL returns a query for the table's size on disk with its indexes,
	// in bytes.
	sizeSQL(table qualifiedName) (string, []any)

	// checkTable reads the catalog through q and returns every problem of
	// the existing table t that could make the inbox merge, truncate or
	// reject message ids or break the claim or the purge, each with the DDL
	// that fixes it; an error wrapping ErrTableNotFound when t does not
	// exist. Implemented in verify.go.
	checkTable(ctx context.Context, q sqlx.QueryerContext, t qualifiedName) ([]tableProblem, error)
}

// Exported dialects. Compare a Config.Dialect with them by equality.
var (
	// PostgreSQL is the dialect for PostgreSQL 12 and later (any driver: pgx's
	// database/sql adapter, lib/pq). The claim is
	// INSERT ... ON CONFLICT (consumer, message_id) DO NOTHING, which reports
	// 1 row for a new key and 0 for an existing one.
	PostgreSQL Dialect = postgresDialect{}

	// MySQL is the dialect for MySQL 8 and MariaDB 10.5 and later with InnoDB,
	// through github.com/go-sql-driver/mysql. The claim is
	// INSERT ... ON DUPLICATE KEY UPDATE with an assignment that always changes
	// the existing row, so MySQL reports 1 row for a new key and 2 for an
	// existing one whether or not the DSN sets clientFoundRows=true (the
	// duplicate's transaction is rolled back, so the change never persists).
	// INSERT IGNORE is not used: it also silences unrelated errors.
	MySQL Dialect = mysqlDialect{}

	// PostgreSQLPartitioned is the dialect for an inbox table on PostgreSQL
	// 14 or later that is range-partitioned by day on processed_at
	// (schema/postgres_partitioned.sql), for volumes where dropping whole
	// partitions (DropPartitions) beats deleting rows. It is never inferred:
	// set Config.Dialect to it. A partitioned table's primary key must
	// include processed_at, so it only guards within one partition; the
	// claim therefore first takes a transaction-scoped advisory lock on the
	// key (pg_advisory_xact_lock of a 64-bit hash of table, consumer and
	// message id), then inserts only if the key is in no partition. Two
	// deliveries of one key are thereby serialised even when they fall on
	// both sides of a partition boundary. The transaction runs at READ
	// COMMITTED, so that the insert's snapshot is taken after the lock is
	// granted; New refuses any other isolation level. The claim costs one
	// more round trip than PostgreSQL's.
	PostgreSQLPartitioned Dialect = postgresPartitionedDialect{}

	// SQLite is the dialect for SQLite 3.42 and later (modernc.org/sqlite, or
	// any driver with a recent enough SQLite). The claim is
	// INSERT ... ON CONFLICT (consumer, message_id) DO NOTHING.
	SQLite Dialect = sqliteDialect{}
)

// dialectForDriver infers the dialect from a sqlx driver name.
func dialectForDriver(driverName string) (Dialect, error) {
	switch driverName {
	case "postgres", "pgx", "pgx/v4", "pgx/v5": // PostgreSQLPartitioned is never inferred
		return PostgreSQL, nil
	case "mysql":
		return MySQL, nil
	case "sqlite", "sqlite3":
		return SQLite, nil
	}
	return nil, fmt.Errorf("%w: driver name %q (set Config.Dialect to inbox.PostgreSQL, inbox.MySQL or inbox.SQLite)", ErrUnknownDialect, driverName)
}

// DefaultTable is the inbox table name used when Config.Table is empty.
const DefaultTable = "watermill_inbox"

// tableNamePattern is the allow-list for table names: one
// identifier, optionally qualified by a schema (PostgreSQL), a database
// (MySQL) or an attached database (SQLite). 63 bytes is PostgreSQL's
// identifier limit (NAMEDATALEN-1); MySQL allows 64.
var tableNamePattern = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,62}(\.[A-Za-z_][A-Za-z0-9_]{0,62})?$`)

// qualifiedName is a table name that passed the pattern, split at the dot.
type qualifiedName struct {
	schema string // empty when not qualified
	name   string
}

func parseTableName(s string) (qualifiedName, error) {
	if !tableNamePattern.MatchString(s) {
		return qualifiedName{}, fmt.Errorf("%w: %q must match %s", ErrInvalidTableName, s, tableNamePattern)
	}
	if schema, name, ok := strings.Cut(s, "."); ok {
		return qualifiedName{schema: schema, name: name}, nil
	}
	return qualifiedName{name: s}, nil
}

// String returns the name as the caller wrote it.
func (q qualifiedName) String() string {
	if q.schema == "" {
		return q.name
	}
	return q.schema + "." + q.name
}

// quoted returns the name quoted for d, schema included.
func (q qualifiedName) quoted(d Dialect) string {
	if q.schema == "" {
		return d.quote(q.name)
	}
	return d.quote(q.schema) + "." + d.quote(q.name)
}

// indexName returns the name of the purge index: "<table>_processed_at_idx",
// shortened with a hash of the table name when that would pass the 63-byte
// identifier limit, so that two long table names never share an index name.
func (q qualifiedName) indexName() string {
	const suffix = "_processed_at_idx"
	if len(q.name)+len(suffix) <= 63 {
		return q.name + suffix
	}
	h := fnv.New32a()
	h.Write([]byte(q.name))
	hashed := fmt.Sprintf("_%08x%s", h.Sum32(), suffix)
	return q.name[:63-len(hashed)] + hashed
}

type postgresDialect struct{}

func (postgresDialect) String() string            { return "postgres" }
func (postgresDialect) quote(ident string) string { return `"` + ident + `"` }

func (d postgresDialect) claimSQL(t qualifiedName) string {
	return "INSERT INTO " + t.quoted(d) + " (consumer, message_id, processed_at) VALUES ($1, $2, now())" +
		" ON CONFLICT (consumer, message_id) DO NOTHING"
}

func (postgresDialect) claimed(n int64) (bool, bool) { return n == 1, n == 0 || n == 1 }

func (d postgresDialect) createSQL(t qualifiedName) []string {
	return []string{
		"CREATE TABLE IF NOT EXISTS " + t.quoted(d) + " (\n" +
			"    consumer     text        NOT NULL,\n" +
			"    message_id   text        NOT NULL,\n" +
			"    processed_at timestamptz NOT NULL DEFAULT now(),\n" +
			"    PRIMARY KEY (consumer, message_id)\n" +
			")",
		"CREATE INDEX IF NOT EXISTS " + d.quote(t.indexName()) + " ON " + t.quoted(d) + " (processed_at)",
	}
}

func (d postgresDialect) existsSQL(t qualifiedName) (string, []any) {
	index := d.quote(t.indexName())
	if t.schema != "" {
		index = d.quote(t.schema) + "." + index
	}
	// to_regclass resolves unqualified names through search_path, as the
	// DDL does, and returns NULL for a missing relation instead of failing.
	return "SELECT (to_regclass($1) IS NOT NULL)::int + (to_regclass($2) IS NOT NULL)::int", []any{t.quoted(d), index}
}

func (postgresDialect) keyLock() (string, bool) { return "", false }

// After an error PostgreSQL keeps the transaction open but aborted, and
// turns COMMIT into ROLLBACK, which the driver reports as an error.
func (postgresDialect) preCommitCheck(qualifiedName) (string, bool) { return "", false }

func (postgresDialect) uncodedBoundaryErrIsLostConn() bool { return false }

func (postgresDialect) preparesByDefault() bool { return false }

func (postgresDialect) expiredSQL(byConsumer bool) string {
	where := "processed_at < now() - $1 * interval '1 microsecond'"
	if byConsumer {
		where += " AND consumer = $2"
	}
	return where
}

// A batch skips rows that live transactions hold (FOR UPDATE SKIP LOCKED).
func (d postgresDialect) purgeSQL(t qualifiedName, byConsumer bool) string {
	return deleteOldestSQL(t.quoted(d), d.expiredSQL(byConsumer), batchParam("$", byConsumer), " FOR UPDATE SKIP LOCKED")
}

func (d postgresDialect) oldestAgeSQL(t qualifiedName) string {
	return "SELECT CAST(EXTRACT(EPOCH FROM now() - MIN(processed_at)) * 1000000 AS bigint) FROM " + t.quoted(d)
}

// The planner's estimate (reltuples: -1 before the first ANALYZE on
// PostgreSQL 14+, reported as 0).
func (d postgresDialect) estimateRowsSQL(t qualifiedName) (string, []any) {
	return "SELECT GREATEST(reltuples, 0)::bigint FROM pg_class WHERE oid = to_regclass($1)", []any{t.quoted(d)}
}

func (d postgresDialect) spanSQL(t qualifiedName) string {
	return "SELECT CAST(EXTRACT(EPOCH FROM MIN(processed_at)) * 1000000 AS bigint), " +
		"CAST(EXTRACT(EPOCH FROM MAX(processed_at)) * 1000000 AS bigint) FROM " + t.quoted(d)
}

func (d postgresDialect) sizeSQL(t qualifiedName) (string, []any) {
	return "SELECT pg_total_relation_size(to_regclass($1))", []any{t.quoted(d)}
}

type postgresPartitionedDialect struct{ postgresDialect }

func (postgresPartitionedDialect) String() string { return "postgres-partitioned" }

func (d postgresPartitionedDialect) claimSQL(t qualifiedName) string {
	q := t.quoted(d)
	// Under the key lock (keyLockSQL), so the NOT EXISTS sees a concurrent
	// claim of the key once it committed, in whatever partition.
	return "INSERT INTO " + q + " (consumer, message_id, processed_at) SELECT $1, $2, now()" +
		" WHERE NOT EXISTS (SELECT 1 FROM " + q + " WHERE consumer = $1 AND message_id = $2)" +
		" ON CONFLICT DO NOTHING"
}

func (postgresPartitionedDialect) keyLock() (string, bool) {
	return "SELECT pg_advisory_xact_lock($1)", true
}

// Summed over the partitions: the parent holds no rows.
func (d postgresPartitionedDialect) estimateRowsSQL(t qualifiedName) (string, []any) {
	return `SELECT COALESCE(SUM(GREATEST(c.reltuples, 0)), 0)::bigint FROM pg_inherits i
			JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass($1)
			HAVING to_regclass($1) IS NOT NULL`, []any{t.quoted(d)}
}

func (d postgresPartitionedDialect) sizeSQL(t qualifiedName) (string, []any) {
	return "SELECT COALESCE(SUM(pg_total_relation_size(inhrelid)), 0) FROM pg_inherits WHERE inhparent = to_regclass($1)",
		[]any{t.quoted(d)}
}

func (d postgresPartitionedDialect) createSQL(t qualifiedName) []string {
	// No purge index: purging drops whole partitions. The primary key, led
	// by (consumer, message_id), serves the claim's lookup in every
	// partition. No DEFAULT partition: a claim with no partition for its
	// day fails loudly (nack) instead of landing where no drop reaches it.
	return []string{
		"CREATE TABLE IF NOT EXISTS " + t.quoted(d) + " (\n" +
			"    consumer     text        NOT NULL,\n" +
			"    message_id   text        NOT NULL,\n" +
			"    processed_at timestamptz NOT NULL DEFAULT now(),\n" +
			"    PRIMARY KEY (consumer, message_id, processed_at)\n" +
			") PARTITION BY RANGE (processed_at)",
	}
}

func (d postgresPartitionedDialect) existsSQL(t qualifiedName) (string, []any) {
	// The table alone: its partitions are managed by CreatePartitions.
	return "SELECT 2 * (to_regclass($1) IS NOT NULL)::int", []any{t.quoted(d)}
}

type mysqlDialect struct{}

func (mysqlDialect) String() string            { return "mysql" }
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
func (d mysqlDialect) preCommitCheck(t qualifiedName) (string, bool) {
	return "SELECT COUNT(*) FROM " + t.quoted(d) + " WHERE consumer = ? AND message_id = ? FOR UPDATE", true
}

func (mysqlDialect) expiredSQL(byConsumer bool) string {
	where := "processed_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND"
	if byConsumer {
		where += " AND consumer = ?"
	}
	return where
}

// Not a DELETE: the batch's keys, by a non-locking consistent read of the
// processed_at index (see purgeBatch).
func (d mysqlDialect) purgeSQL(t qualifiedName, byConsumer bool) string {
	return "SELECT consumer, message_id FROM " + t.quoted(d) + " WHERE " + d.expiredSQL(byConsumer) +
		" ORDER BY processed_at LIMIT ?"
}

func (d mysqlDialect) oldestAgeSQL(t qualifiedName) string {
	return "SELECT TIMESTAMPDIFF(MICROSECOND, MIN(processed_at), UTC_TIMESTAMP(6)) FROM " + t.quoted(d)
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
		"TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', MAX(processed_at)) FROM " + t.quoted(d)
}

func (mysqlDialect) sizeSQL(t qualifiedName) (string, []any) {
	where, args := mysqlTableWhere(t)
	return "SELECT data_length + index_length FROM information_schema.tables WHERE " + where, args
}

type sqliteDialect struct{}

func (sqliteDialect) String() string            { return "sqlite" }
func (sqliteDialect) quote(ident string) string { return `"` + ident + `"` }

func (d sqliteDialect) claimSQL(t qualifiedName) string {
	// unixepoch('subsec') (SQLite 3.42+) is fractional seconds; processed_at
	// holds whole Unix microseconds, UTC.
	return "INSERT INTO " + t.quoted(d) + " (consumer, message_id, processed_at)" +
		" VALUES (?, ?, CAST(unixepoch('subsec') * 1000000 AS INTEGER))" +
		" ON CONFLICT (consumer, message_id) DO NOTHING"
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

// A transaction SQLite rolled back by itself (SQLITE_FULL, SQLITE_IOERR, ...)
// makes COMMIT fail: no transaction is active.
func (sqliteDialect) preCommitCheck(qualifiedName) (string, bool) { return "", false }

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
func (d sqliteDialect) purgeSQL(t qualifiedName, byConsumer bool) string {
	return deleteOldestSQL(t.quoted(d), d.expiredSQL(byConsumer), batchParam("?", byConsumer), "")
}

func (d sqliteDialect) oldestAgeSQL(t qualifiedName) string {
	return "SELECT CAST(unixepoch('subsec') * 1000000 AS INTEGER) - MIN(processed_at) FROM " + t.quoted(d)
}

// SQLite keeps no estimate: an exact count (SQLite tables are expected to be
// small enough).
func (d sqliteDialect) estimateRowsSQL(t qualifiedName) (string, []any) {
	return "SELECT COUNT(*) FROM " + t.quoted(d), nil
}

func (d sqliteDialect) spanSQL(t qualifiedName) string {
	return "SELECT MIN(processed_at), MAX(processed_at) FROM " + t.quoted(d)
}

// The whole database file.
func (sqliteDialect) sizeSQL(qualifiedName) (string, []any) {
	return "SELECT page_count * page_size FROM pragma_page_count(), pragma_page_size()", nil
}

// deleteOldestSQL is a DELETE of the oldest rows of the quoted table q that
// match where, at most limit (a placeholder) of them, chosen by primary key
// with the row-locking clause lock ("" for none).
func deleteOldestSQL(q, where, limit, lock string) string {
	return "DELETE FROM " + q + " WHERE (consumer, message_id) IN (" +
		"SELECT consumer, message_id FROM " + q + " WHERE " + where +
		" ORDER BY processed_at LIMIT " + limit + lock + ")"
}

// batchParam is the numbered placeholder (prefix "$" or "?") of the batch
// size, the bind parameter after expiredSQL's.
func batchParam(prefix string, byConsumer bool) string {
	if byConsumer {
		return prefix + "3"
	}
	return prefix + "2"
}

// isPostgres reports whether d is one of the PostgreSQL dialects.
func isPostgres(d Dialect) bool { return d == PostgreSQL || d == PostgreSQLPartitioned }

// canonicalTable returns t qualified the way the database resolves it, so
// that every instance derives the same lock keys and partition names
// however the table name was written ("inbox" or "public.inbox"): on
// PostgreSQL, the schema the table is in, or the one CREATE TABLE would use
// (current_schema()) when it does not exist yet; on MySQL, the current
// database; on SQLite, "main".
func canonicalTable(ctx context.Context, q sqlx.QueryerContext, d Dialect, t qualifiedName) (qualifiedName, error) {
	if t.schema != "" {
		return t, nil
	}
	var schema string
	var err error
	switch {
	case isPostgres(d):
		err = sqlx.GetContext(ctx, q, &schema, `SELECT COALESCE(
			(SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = to_regclass($1)),
			current_schema())`, t.quoted(d))
	case d == MySQL:
		err = sqlx.GetContext(ctx, q, &schema, "SELECT DATABASE()")
	default:
		schema = "main"
	}
	if err != nil {
		return t, fmt.Errorf("resolve table %s: %w", t, err)
	}
	if schema == "" {
		return t, fmt.Errorf("resolve table %s: no current schema or database", t)
	}
	return qualifiedName{schema: schema, name: t.name}, nil
}
