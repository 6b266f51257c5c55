package inbox

import (
	"context"
	"database/sql"
	"fmt"
	"hash/fnv"
	"regexp"
	"strings"
	"time"

	"github.com/jmoiron/sqlx"
)

// Dialect is the SQL dialect of the database that holds the inbox table. The
// only implementations are PostgreSQL, MySQL and SQLite; the interface is
// sealed (it has an unexported method) so that every statement the inbox runs
// is one this package wrote and tested.
type Dialect interface {
	// String returns the dialect's name: "postgres", "mysql" or "sqlite".
	String() string
	// server is the database server the dialect's SQL is for (see
	// checkServer).
	server() serverKind

	// quote quotes one identifier that has already passed the table name
	// pattern, so it cannot contain a quote character.
	quote(ident string) string
	// claimSQL returns the insert-if-absent statement for table. Its two bind
	// parameters are the consumer and the message id.
	claimSQL(table qualifiedName) string
	// claimFingerprintSQL returns claimSQL that also stores the content's
	// fingerprint in a new row (bind parameter 3; Config.ReusedIDs).
	claimFingerprintSQL(table qualifiedName) string
	// claimFlagsOtherFingerprint reports whether claimFingerprintSQL's
	// result carries, as its last insert id, 1 for a processed key stored
	// with another fingerprint and 0 otherwise, so that a duplicate of the
	// same content needs no read (MySQL/MariaDB).
	claimFlagsOtherFingerprint() bool
	// storedFingerprintSQL returns the query of the fingerprint stored with
	// a key (bind parameters: consumer, message id), NULL when the row was
	// written without one.
	storedFingerprintSQL(table qualifiedName) string
	// fingerprintColumnSQL returns a catalog query for the type of table's
	// fingerprint column as the catalog spells it: no row without one.
	fingerprintColumnSQL(table qualifiedName) (string, []any)
	// fingerprintWriteProbeSQL returns a statement that writes nothing and
	// that the database refuses (isPrivilegeRefusal) when the session's
	// user may not read and write the fingerprint column as the claims do;
	// "" where fingerprintColumnSQL tells it already.
	fingerprintWriteProbeSQL(table qualifiedName) string
	// fingerprintColumnFits reports whether a fingerprint column of type
	// typ (as fingerprintColumnSQL reads it) stores 16 bytes exactly as
	// given, and otherwise returns the statement that makes it so.
	fingerprintColumnFits(table qualifiedName, typ string) (fix string, ok bool)
	// fingerprintColumn returns the column definition that holds a
	// fingerprint: 16 bytes, NULL for rows written without one.
	fingerprintColumn() string
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
	// lockedClaim returns one statement that takes the key lock and claims
	// (bind parameters: consumer, message id, the key lock's hash, and with
	// fingerprint the content's fingerprint; its rows affected are the
	// claim's), when the dialect has a key lock and the
	// database holds the function that statement calls for table exactly as
	// this package creates it (read through q); "" otherwise, and the key
	// lock and the claim then run as two statements.
	lockedClaim(ctx context.Context, q sqlx.QueryerContext, table qualifiedName, fingerprint bool) (string, error)
	// claimFunctionSQL returns the statement that creates the function
	// lockedClaim calls for table (with fingerprint, the overload that
	// stores it), "" for a dialect that has none.
	claimFunctionSQL(table qualifiedName, fingerprint bool) string
	// preCommitCheck returns a query, run in the transaction right before
	// COMMIT, that counts the claim's row (bind parameters: consumer,
	// message id), 0 meaning the database has already rolled the
	// transaction back, and true; false when COMMIT itself fails for a
	// transaction the database rolled back.
	preCommitCheck(table qualifiedName) (query string, ok bool)
	// statuslessCheck returns, where preCommitCheck has none, a statement
	// run with Exec (no rows to read, so that the handler's goroutines'
	// statements cannot come between) before COMMIT and each outbox write
	// only when the driver connection gives no transaction status (an
	// instrumentation wrapper that hides it: driverTxEnded): it affects 1
	// row while the transaction that made the claim is open, 0 after the
	// handler's ROLLBACK or COMMIT; false where COMMIT itself tells.
	statuslessCheck(table qualifiedName) (query string, ok bool)
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

	// expiredSQL returns the condition for the rows a dry run counts
	// (CountExpired): processed_at older than the window (bind parameter 1,
	// microseconds) by the database clock in UTC at the statement, and,
	// when byConsumer, consumer = parameter 2. A purge deletes by the same
	// rule, with the database's time fixed at its window check
	// (purgeCutoff, purgeStatement).
	expiredSQL(byConsumer bool) string
	// purgeStatement returns one purge batch: a DELETE of at most batch
	// rows processed before cutoff (microseconds since the Unix epoch, on
	// the database clock in UTC: nowMicrosSQL's) (of consumer only, unless
	// it is ""), oldest first (on a partitioned table, the oldest
	// partition first: a walk of its partitions); on MySQL a non-locking SELECT of their keys
	// instead (see purgeBatch). Every batch of a purge runs with the same
	// cutoff.
	purgeStatement(table qualifiedName, cutoff int64, batch int, consumer string) purgeQuery
	// nowMicrosSQL returns a query, without bind parameters, of the
	// database's current time in microseconds since the Unix epoch, UTC:
	// the clock processed_at is written by.
	nowMicrosSQL() string
	// writeProbeSQL returns a statement that writes nothing to table (an
	// INSERT of no row: the claim's privilege) but is refused as a write is where the database refuses writes (a
	// read-only transaction or server: isReadOnlyRefusal); Verify runs it
	// in a transaction it rolls back.
	writeProbeSQL(table qualifiedName) string
	// writeProbeLockTimeout returns a statement, run in the write probe's
	// transaction before it, that bounds the probe's wait for the table's
	// lock to that transaction ("" where none is set that way).
	writeProbeLockTimeout() string
	// readOnlyTxSQL returns a query, run in a transaction begun as a
	// message's, that takes no lock and reports whether the transaction
	// refuses writes, for when writeProbeSQL could not take its lock; ""
	// where nothing short of a write tells (MySQL's read_only spares
	// privileged users; SQLite refuses a read-only file before any lock).
	readOnlyTxSQL() string
	// oldestAgeSQL returns a query for the age of the oldest row, of
	// consumer's rows when it is not "", in microseconds by the database
	// clock, NULL when there is none; with its arguments.
	oldestAgeSQL(table qualifiedName, consumer string) (string, []any)
	// estimateRowsSQL returns a cheap query for the table's row count (an
	// estimate where the database keeps one); no row means no such table.
	estimateRowsSQL(table qualifiedName) (string, []any)
	// spanSQL returns a query for the smallest and largest processed_at and
	// the database clock's now, as Unix microseconds.
	spanSQL(table qualifiedName) string
	// sizeSQL returns a query for the table's size on disk with its indexes,
	// in bytes.
	sizeSQL(table qualifiedName) (string, []any)

	// outbox returns the statements of the outbox relay (Outbox) for the
	// outbox table t and its dead-letter table dead.
	outbox(t, dead qualifiedName) outboxSQL
	// outboxTableOptions returns what follows the column list of an outbox
	// table's CREATE TABLE.
	outboxTableOptions() string
	// createOutbox runs the outbox DDL stmts of table t, safely against
	// concurrent starters.
	createOutbox(ctx context.Context, db *sqlx.DB, t qualifiedName, stmts []string) error
	// outboxDurability says what keeps the outbox table t (outbox) or a
	// dead-letter table (!outbox), which exists, from keeping what its
	// transactions commit, and the statement that fixes it; "" when
	// nothing does (checkOutboxDurable).
	outboxDurability(ctx context.Context, q sqlx.QueryerContext, t qualifiedName, outbox bool) (problem, fix string, err error)

	// checkIsolation returns why isolation level l cannot run on this
	// dialect (a driver refuses it at every BEGIN, or the claim needs
	// another level), nil when it can.
	checkIsolation(l sql.IsolationLevel) error
	// txOptions returns the options a message's transaction begins with,
	// from the validated user options (nil: the database default).
	txOptions(user *sql.TxOptions) *sql.TxOptions
	// nativeBegin returns the BEGIN statement of a message's transaction
	// with the options opts (from txOptions), for a backend that sends it as
	// text (package pgxinbox), and false when the dialect has no such
	// backend.
	nativeBegin(opts *sql.TxOptions) (string, bool)
	// schemaNotes returns the comment lines SchemaSQL prints before the
	// DDL of t.
	schemaNotes(t qualifiedName) string
	// createSchema runs the DDL that creates t and its purge index, of
	// which found (existsSQL) already exist, safely against concurrent
	// starters.
	createSchema(ctx context.Context, db *sqlx.DB, t qualifiedName, found int) error
	// maintainSchema does what InitializeSchema and every Purger round do
	// once the table exists: create the partitions ahead; nothing for a
	// plain table.
	maintainSchema(ctx context.Context, db dbConn, t qualifiedName) error
	// resolveSchema returns the schema (PostgreSQL), database (MySQL) or
	// attached database (SQLite) an unqualified t is in, or would be
	// created in; see canonicalTable.
	resolveSchema(ctx context.Context, q sqlx.QueryerContext, t qualifiedName) (string, error)
	// readTx runs f with a queryer for reads outside a message's
	// transaction (see withReadTx).
	readTx(ctx context.Context, db dbConn, f func(q sqlx.QueryerContext) error) error
	// purgeBatch runs one purge batch (from purgeStatement) in its own
	// transaction and returns the rows it deleted and the expired rows it
	// found (fewer than the batch size: the purge is done).
	purgeBatch(ctx context.Context, db dbConn, t qualifiedName, q purgeQuery, h *hooks) (deleted, found int64, err error)
	// purgeLock takes the purge lock of t (see acquirePurgeLock).
	purgeLock(ctx context.Context, db *sqlx.DB, t qualifiedName, wait bool) (purgeLease, bool, error)
	// purgeRound does one Purger round's work on db, under the purge lock.
	purgeRound(ctx context.Context, db dbConn, cfg PurgeConfig, t qualifiedName) PurgeRound

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
	// 14 or later that is range-partitioned on processed_at, by week or by
	// day (the table's PartitionInterval; schema/postgres_partitioned.sql),
	// for volumes where dropping whole partitions (DropPartitions) beats
	// deleting rows. It is never inferred:
	// set Config.Dialect to it. A partitioned table's primary key must
	// include processed_at, so it only guards within one partition; the
	// claim therefore first takes a transaction-scoped advisory lock on the
	// key (pg_advisory_xact_lock of a 64-bit hash of table, consumer and
	// message id), then inserts only if the key is in no partition. Two
	// deliveries of one key are thereby serialised even when they fall on
	// both sides of a partition boundary. The transaction runs at READ
	// COMMITTED, so that the insert's snapshot is taken after the lock is
	// granted; New refuses any other isolation level. The lock and the
	// insert are one call of the table's claim function ("<table>_claim",
	// PL/pgSQL, created with the table by InitializeSchema and in
	// schema/postgres_partitioned.sql), one round trip as PostgreSQL's
	// claim; on a table without that function (made by an older version, or
	// by a migration that left it out) they are two statements, one round
	// trip more, until InitializeSchema or a migration adds it (an Inbox
	// looks for it again at most a minute later, or at once after its own
	// InitializeSchema).
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
// claimCountSQL counts the rows of the claim of a key in quotedTable, an
// inbox table: 1 while it is there, 0 once a rollback took it. Bind
// parameters ("?"): consumer, message id.
func claimCountSQL(quotedTable string) string {
	return "SELECT COUNT(*) FROM " + quotedTable + " WHERE consumer = ? AND message_id = ?"
}

func (q qualifiedName) quoted(d Dialect) string {
	if q.schema == "" {
		return d.quote(q.name)
	}
	return d.quote(q.schema) + "." + d.quote(q.name)
}

// indexName returns the name of the purge index: "<table>_processed_at_idx"
// (see derivedName).
func (q qualifiedName) indexName() string { return q.derivedName("_processed_at_idx") }

// derivedName returns the name of an object that belongs to table q: q's
// name with suffix, shortened with a hash of q's name when that would pass
// the 63-byte identifier limit, so that two long table names never share an
// object name.
func (q qualifiedName) derivedName(suffix string) string {
	if len(q.name)+len(suffix) <= 63 {
		return q.name + suffix
	}
	h := fnv.New32a()
	h.Write([]byte(q.name))
	hashed := fmt.Sprintf("_%08x%s", h.Sum32(), suffix)
	return q.name[:63-len(hashed)] + hashed
}

// deleteOldestSQL is a DELETE of the oldest rows of the quoted table q that
// match where, at most limit (a placeholder) of them, chosen by primary key
// with the row-locking clause lock ("" for none).
// purgeQuery is one purge batch as a dialect's purgeStatement builds it
// for its purgeBatch.
type purgeQuery struct {
	sql  string // the batch: a DELETE (on PostgreSQL in a WITH that returns its count and the next bound), or on MySQL the SELECT of its keys
	args []any  // sql's bind parameters
	size int64  // the batch size
	// remaining, where set, counts the expired rows left, up to the batch
	// size: what a batch that deleted fewer rows than the batch size asks
	// to tell whether it ran out of rows or lost some to another purge (see
	// postgresDialect.purgeBatch).
	remaining string
	// oldest, where set, reads the oldest expired row's ctid (as text)
	// and counts the expired rows: what a batch from
	// the oldest row that deleted nothing asks (see
	// postgresDialect.purgeBatch).
	oldest string
	// resume, where set, is the batch that starts its scan at a lower
	// bound on processed_at (Unix milliseconds on PostgreSQL, a bind
	// parameter in microseconds on MySQL), and cursor the bound a round's
	// batches carry from one to the next (see postgresDialect.purgeBatch
	// and mysqlDialect.purgeBatch).
	resume func(fromMillis int64) string
	cursor *purgeCursor
	// below, where set, is MySQL's read of the expired keys under the
	// cursor's bound, its bind parameter after the consumer's (see
	// mysqlDialect.purgeBatch).
	below string
	// walk, where set, is a partitioned table's purge, partition by
	// partition (see postgresPartitionedDialect.purgeBatch).
	walk *partitionedPurge
}

// purgeCursor is where a round's next purge batch starts: after a batch
// that deleted rows (set), just below the newest processed_at it deleted;
// else from the oldest row (the first batch, and after a batch that deleted
// nothing).
type purgeCursor struct {
	fromMillis int64 // PostgreSQL's bound
	fromMicros int64 // MySQL's bound (mysqlDialect.purgeBatch)
	set        bool
	// fruitless: the last batch ran from the oldest expired row and
	// deleted nothing; oldest is the ctid of the oldest expired row then,
	// and left how many expired rows there were
	// (postgresDialect.purgeBatch).
	fruitless bool
	oldest    string
	left      int64
}

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

// purgeArgs are the bind parameters of a purge batch's condition and
// batchParam: the cutoff (or window) in microseconds, the consumer when set,
// and the batch size.
func purgeArgs(cutoff int64, batch int, consumer string) []any {
	args := []any{cutoff}
	if consumer != "" {
		args = append(args, consumer)
	}
	return append(args, batch)
}

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
	schema, err := d.resolveSchema(ctx, q, t)
	if err != nil {
		return t, fmt.Errorf("resolve table %s: %w", t, err)
	}
	if schema == "" {
		return t, fmt.Errorf("resolve table %s: no current schema or database", t)
	}
	return qualifiedName{schema: schema, name: t.name}, nil
}

// standardIsolation reports whether l is the default or one of the four SQL
// standard levels: what the PostgreSQL and MySQL drivers (pgx, lib/pq,
// go-sql-driver/mysql) accept; they refuse every other level at BEGIN with
// an error that carries no server code (pgx runs sql.LevelSnapshot as
// REPEATABLE READ, but lib/pq refuses it: ask for LevelRepeatableRead,
// which on PostgreSQL is snapshot isolation).
func standardIsolation(l sql.IsolationLevel) bool {
	switch l {
	case sql.LevelDefault, sql.LevelReadUncommitted, sql.LevelReadCommitted, sql.LevelRepeatableRead, sql.LevelSerializable:
		return true
	}
	return false
}

// errIsolationRefused is checkIsolation's error for a level the drivers
// refuse.
func errIsolationRefused(l sql.IsolationLevel, d Dialect) error {
	return fmt.Errorf("inbox: Config.TxOptions.Isolation %v: not run on %v (a driver refuses it at every BEGIN)", l, d)
}

// copyTxOptions returns a copy of user: what Validate checked is what runs.
func copyTxOptions(user *sql.TxOptions) *sql.TxOptions {
	if user == nil {
		return nil
	}
	opts := *user
	return &opts
}

// runStatements runs stmts on db one by one, for the DDL of dialects whose
// statements are each atomic and IF NOT EXISTS.
func runStatements(ctx context.Context, db *sqlx.DB, t qualifiedName, stmts []string) error {
	for _, stmt := range stmts {
		if _, err := db.ExecContext(ctx, stmt); err != nil {
			return fmt.Errorf("inbox: initialize schema of %s: %w", t, err)
		}
	}
	return nil
}

// purgeRows is a Purger round of the dialects that delete rows: the window
// checked (and reported in the round), Purge, then the age of the oldest
// row left.
func purgeRows(ctx context.Context, d Dialect, db dbConn, cfg PurgeConfig, t qualifiedName) (round PurgeRound) {
	checked := time.Now() // before the source is asked: its window holds from then
	olderThan, err := checkWindow(ctx, cfg.Window, cfg.OlderThan)
	if err != nil {
		round.Err = fmt.Errorf("inbox: purge %s: %w", t, err)
		return round
	}
	round.Window = olderThan
	// Checked once: purge does not ask the source again, and deletes by
	// the cutoff of this check.
	cfg.OlderThan, cfg.Window, cfg.windowChecked = olderThan, nil, checked
	if round.Deleted, round.Err = purge(ctx, db, cfg); round.Err != nil {
		return round
	}
	oldest := func(consumer string) (time.Duration, error) {
		var us sql.NullInt64
		query, args := d.oldestAgeSQL(t, consumer)
		if err := db.QueryRowxContext(ctx, query, args...).Scan(&us); err != nil {
			return 0, fmt.Errorf("inbox: oldest row age of %s: %w", t, err)
		}
		return time.Duration(max(us.Int64, 0)) * time.Microsecond, nil
	}
	if round.OldestAge, round.Err = oldest(cfg.Consumer); round.Err != nil {
		return round
	}
	round.TableOldestAge = round.OldestAge
	if cfg.Consumer != "" {
		if round.TableOldestAge, round.Err = oldest(""); round.Err != nil {
			round.OldestAge, round.TableOldestAge = 0, 0
		}
	}
	return round
}
