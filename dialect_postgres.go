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

var _ Dialect = postgresDialect{}

// postgresDialect is PostgreSQL: every statement the inbox runs there, from
// the claim to the catalog checks, the purge batches and the purge lock.
// The partitioned dialect (dialect_postgres_partitioned.go) embeds it.
type postgresDialect struct{}

func (postgresDialect) String() string { return "postgres" }

func (postgresDialect) server() serverKind { return serverPostgreSQL }

// quote doubles a quote character, which a name read from the catalog (a
// partition made by hand) may hold.
func (postgresDialect) quote(ident string) string {
	return `"` + strings.ReplaceAll(ident, `"`, `""`) + `"`
}

func (d postgresDialect) claimSQL(t qualifiedName) string {
	return "INSERT INTO " + t.quoted(d) + " (consumer, message_id, processed_at) VALUES ($1, $2, now())" +
		" ON CONFLICT (consumer, message_id) DO NOTHING"
}

func (d postgresDialect) claimFingerprintSQL(t qualifiedName) string {
	return "INSERT INTO " + t.quoted(d) + " (consumer, message_id, processed_at, fingerprint) VALUES ($1, $2, now(), $3)" +
		" ON CONFLICT (consumer, message_id) DO NOTHING"
}

func (postgresDialect) claimFlagsOtherFingerprint() bool { return false }

func (d postgresDialect) storedFingerprintSQL(t qualifiedName) string {
	// bytea in hex for this transaction (a duplicate's, rolled back next):
	// a session's bytea_output 'escape', read as text (pgx's simple
	// protocol), could not be read, and the duplicate was nacked for good.
	return "SELECT fingerprint FROM " + t.quoted(d) + " WHERE consumer = $1 AND message_id = $2" +
		" AND (SELECT set_config('bytea_output', 'hex', true)) IS NOT NULL"
}

func (postgresDialect) fingerprintColumn() string { return "fingerprint  bytea" }

// The type, followed by fingerprintNotGranted when the session's user may
// not both read and write the column: a column-level GRANT made before the
// column was added does not cover it (a table-level one does). A user who
// may insert into no column of the table at all is not told of this one:
// the table's check refuses it for the table (permission denied), which a
// GRANT of this column alone would not fix.
func (d postgresDialect) fingerprintColumnSQL(t qualifiedName) (string, []any) {
	return "SELECT format_type(atttypid, atttypmod) || CASE WHEN has_column_privilege(attrelid, attnum, 'SELECT')" +
		" AND has_column_privilege(attrelid, attnum, 'INSERT') OR NOT has_any_column_privilege(attrelid, 'INSERT')" +
		" THEN '' ELSE '" + fingerprintNotGranted + "' END FROM pg_attribute" +
		" WHERE attrelid = to_regclass($1) AND attname = 'fingerprint' AND NOT attisdropped", []any{t.quoted(d)}
}

// bytea only: text would refuse the bytes (or, with another encoding,
// change them), uuid and other types refuse them.
func (d postgresDialect) fingerprintColumnFits(t qualifiedName, typ string) (string, bool) {
	return "ALTER TABLE " + t.quoted(d) + " ALTER COLUMN fingerprint TYPE bytea USING NULL", typ == "bytea"
}

func (postgresDialect) claimed(n int64) (bool, bool) { return n == 1, n == 0 || n == 1 }

func (d postgresDialect) createSQL(t qualifiedName) []string {
	return []string{
		"CREATE TABLE IF NOT EXISTS " + t.quoted(d) + " (\n" +
			"    consumer     text        NOT NULL,\n" +
			"    message_id   text        NOT NULL,\n" +
			"    processed_at timestamptz NOT NULL DEFAULT now(),\n" +
			"    " + d.fingerprintColumn() + ",\n" +
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

func (postgresDialect) lockedClaim(context.Context, sqlx.QueryerContext, qualifiedName, bool) (string, error) {
	return "", nil
}

func (postgresDialect) claimFunctionSQL(qualifiedName, bool) string { return "" }

// After an error PostgreSQL keeps the transaction open but aborted, and
// turns COMMIT into ROLLBACK, which the driver reports as an error.
func (postgresDialect) preCommitCheck(qualifiedName) (string, bool) { return "", false }

// The claim assigned the transaction an id; after the handler's ROLLBACK or
// COMMIT the statement runs in a transaction of its own, which has none. It
// reads no table: a handler's search_path or role (SET LOCAL) cannot make it
// fail, which would abort the transaction.
func (postgresDialect) statuslessCheck(qualifiedName) (string, bool) {
	return "SELECT 1 WHERE txid_current_if_assigned() IS NOT NULL", true
}

func (postgresDialect) uncodedBoundaryErrIsLostConn() bool { return false }

func (postgresDialect) preparesByDefault() bool { return false }

func (postgresDialect) expiredSQL(byConsumer bool) string {
	consumer := ""
	if byConsumer {
		consumer = "$2"
	}
	return pgExpired("$1", consumer)
}

// pgExpired is expiredSQL with the window (microseconds) and the consumer
// ("": any) given as SQL expressions: placeholders or constants.
func pgExpired(window, consumer string) string {
	where := "processed_at < now() - " + window + " * interval '1 microsecond'"
	if consumer != "" {
		where += " AND consumer = " + consumer
	}
	return where
}

// pgBeforeConstants is the condition of a purge batch: processed_at before
// cutoff (microseconds since the Unix epoch), and the consumer's rows only
// when it is not "", both written into the statement as constants.
func pgBeforeConstants(cutoff int64, consumer string) string {
	where := "processed_at < timestamptz 'epoch' + " + strconv.FormatInt(cutoff, 10) + " * interval '1 microsecond'"
	if consumer != "" {
		where += " AND consumer = " + pgStringConstant(consumer)
	}
	return where
}

func (postgresDialect) nowMicrosSQL() string { return "SELECT " + pgNowMicros }

// pgStringConstant quotes s as a PostgreSQL string constant with C-style
// escapes (E'...'), whose meaning, unlike a plain '...' constant's, does not
// depend on standard_conforming_strings: every backslash in s is escaped
// with a backslash and every quote written twice (not escaped with a
// backslash, which a server or role with backslash_quote = off refuses:
// 22P06). s must be valid UTF-8 without NUL bytes (checkKey), which every
// server encoding the inbox accepts can hold.
func pgStringConstant(s string) string {
	return "E'" + strings.NewReplacer(`\`, `\\`, `'`, `''`).Replace(s) + "'"
}

// One statement with no bind parameters, so that every driver sends it in
// one exchange and autocommits it (see purgeBatch). The batch's rows are
// chosen oldest first by the processed_at index and deleted by ctid (a TID
// scan): by primary key, every row would cost an index probe, two thirds of
// a 1,000-row batch's time (3.9 ms against 13 ms here, see BENCHMARKS.md).
//
// The rows are not locked first (no FOR UPDATE SKIP LOCKED): locking writes
// a WAL record for every row before its delete does (1,000 rows: 190 kB of
// WAL against 142 kB without, and 3.1 ms against 2.4 ms, pg_walinspect and
// psql on PostgreSQL 15), and the handlers' commits wait for that WAL to be
// flushed. A ctid read by the subquery names that row version until the
// statement ends: the statement's snapshot saw the version live, so VACUUM
// and pruning keep it (and its line pointer) while the statement runs, and
// inbox rows are never updated. A row that another purge deletes meanwhile
// is waited for and skipped (READ COMMITTED's recheck of a concurrently
// deleted row); two purges that chose the same rows thus delete them once,
// and the loser's batch comes up short (see purgeBatch).
//
// The batch commits asynchronously (synchronous_commit off for its own
// transaction, set_config's is_local): it does not wait for its WAL to be
// flushed, and its flush joins the next handler's commit instead of costing
// one of its own. A crash may lose the last batches' deletes (at most about
// three wal_writer_delay, PostgreSQL's asynchronous commit): the rows are
// still expired and the next purge deletes them; nothing else depends on
// the delete being durable.
//
// Each batch after one that deleted rows starts its scan of the
// processed_at index at that batch's newest row (purgeCursor), not at the oldest entry: a
// deleted row's index entry stays until VACUUM removes it, so a scan from
// the oldest entry steps over every row the purge deleted so far, a cost
// that grows with each batch (BENCHMARKS.md: a batch's scan read 1,160
// index pages and took 45 ms, paced, after 418,000 rows with autovacuum
// off; from the bound, 17 pages and 0.5 ms). The bound is the newest
// processed_at the batch deleted, floored to the millisecond and less one
// millisecond (the statement carries it as a constant, see purgeBatch), so
// no row at that instant or later is passed over; a row older than the
// bound that is still there (one that another purge chose and then rolled
// back) is found by a batch from the oldest row, which follows the first
// batch from the bound that deletes nothing, and by the next round.
//
// On a partitioned table ctids repeat across partitions, so
// postgresPartitionedDialect deletes by primary key. Both the DELETE and
// its subquery read ONLY the table itself: a ctid names a row only within
// one table, and the same ctid in an inheritance child or a partition is
// another row. Should the table be replaced by a partitioned one (or gain
// children) while a purge runs, a batch still touches only rows of the
// table itself (none, for a partitioned one, whose rows are all in its
// partitions: the batch comes back empty and the purge ends).
func (d postgresDialect) purgeStatement(t qualifiedName, cutoff int64, batch int, consumer string) purgeQuery {
	q, limit := t.quoted(d), strconv.Itoa(batch)
	expired := pgBeforeConstants(cutoff, consumer)
	batchSQL := func(where string) string {
		return "WITH batch AS (DELETE FROM ONLY " + q + " WHERE ctid = ANY(ARRAY(SELECT ctid FROM ONLY " + q + " WHERE " + where +
			" ORDER BY processed_at LIMIT " + limit + "))" +
			" AND (SELECT set_config('synchronous_commit', 'off', true)) IS NOT NULL RETURNING processed_at)" +
			" SELECT count(*), floor(extract(epoch FROM max(processed_at) FILTER (WHERE isfinite(processed_at))) * 1000)::bigint - 1 FROM batch"
	}
	return purgeQuery{
		sql:  batchSQL(expired),
		size: int64(batch),
		resume: func(fromMillis int64) string {
			return batchSQL(expired + " AND processed_at >= timestamptz 'epoch' + " +
				strconv.FormatInt(fromMillis, 10) + " * interval '1 millisecond'")
		},
		cursor:    &purgeCursor{},
		remaining: "SELECT count(*) FROM (SELECT FROM ONLY " + q + " WHERE " + expired + " LIMIT " + limit + ") AS expired",
		oldest: "SELECT (SELECT ctid::text FROM ONLY " + q + " WHERE " + expired + " ORDER BY processed_at, ctid LIMIT 1)," +
			" (SELECT count(*) FROM ONLY " + q + " WHERE " + expired + ")",
	}
}

// purgeDialect returns the dialect whose batches a purge of t must run: d,
// unless d is PostgreSQL (or PostgreSQLPartitioned) and t is a partitioned
// table (a PurgeConfig that left Dialect to be inferred from the driver,
// which never infers PostgreSQLPartitioned). Then PostgreSQLPartitioned's, which deletes by
// primary key: a ctid names a row in one table only, so PostgreSQL's batch
// reads and deletes ONLY the parent, which holds no rows of a partitioned
// table. A plain table with inheritance children is refused with
// ErrIncompatibleTable (as Verify refuses it): its children's rows are not
// the inbox's, and a purge that skips them (ONLY) would leave whatever
// relies on them. One catalog read, its name a constant (no bind
// parameters, as the batches).
func purgeDialect(ctx context.Context, db dbConn, d Dialect, t qualifiedName) (Dialect, error) {
	var pd postgresDialect
	switch x := d.(type) {
	case postgresDialect:
		pd = x
	case postgresPartitionedDialect:
		// Given for a plain table, its batches delete by primary key from
		// the table and its inheritance children alike: refused below as
		// PostgreSQL's are (a purge deleted a child's rows).
		pd = x.postgresDialect
	default:
		return d, nil
	}
	var kind struct {
		Partitioned bool           `db:"partitioned"`
		Child       sql.NullString `db:"child"`
	}
	table := pgStringConstant(t.quoted(d))
	err := sqlx.GetContext(ctx, db, &kind, "SELECT c.relkind = 'p' AS partitioned,"+
		" (SELECT i.inhrelid::regclass::text FROM pg_inherits i WHERE i.inhparent = c.oid LIMIT 1) AS child"+
		" FROM pg_class c WHERE c.oid = to_regclass("+table+")")
	switch {
	case errors.Is(err, sql.ErrNoRows): // no such table: the batch reports it
		return d, nil
	case err != nil:
		return nil, fmt.Errorf("read the table's kind: %w", err)
	case kind.Partitioned:
		return postgresPartitionedDialect{pd}, nil
	case kind.Child.Valid:
		// A partitioned table's children are its partitions; a plain
		// table's are not the inbox's.
		return nil, fmt.Errorf("%w: table %q inherits from the inbox table %s, whose purge deletes only its own rows;"+
			" detach it (ALTER TABLE %s NO INHERIT %s)", ErrIncompatibleTable, kind.Child.String, t, kind.Child.String, t.quoted(d))
	}
	return d, nil
}

// An INSERT of no row is still refused in a read-only transaction
// (SQLSTATE 25006), which a hot standby's always are; it needs only the
// privilege the claim needs.
func (d postgresDialect) writeProbeSQL(t qualifiedName) string {
	return "INSERT INTO " + t.quoted(d) + " (consumer, message_id) SELECT '', '' WHERE false"
}

func (postgresDialect) writeProbeLockTimeout() string { return "SET LOCAL lock_timeout = '2s'" }

func (postgresDialect) readOnlyTxSQL() string {
	return "SELECT current_setting('transaction_read_only') = 'on'"
}

// The consumer is a constant, as in purgeStatement: the query runs outside
// a transaction, in one exchange behind a transaction-mode pooler.
func (d postgresDialect) oldestAgeSQL(t qualifiedName, consumer string) (string, []any) {
	// Finite rows only: a hand-written '-infinity' (which the purge
	// deletes first) failed the subtraction, and with it every round.
	q := "SELECT CAST(EXTRACT(EPOCH FROM now() - MIN(processed_at) FILTER (WHERE isfinite(processed_at))) * 1000000 AS bigint) FROM " + t.quoted(d)
	if consumer == "" {
		return q, nil
	}
	return q + " WHERE consumer = " + pgStringConstant(consumer), nil
}

// The planner's estimate (reltuples; where it says none, -1 before a
// table's first ANALYZE on PostgreSQL 14+ or 0 after a VACUUM of the empty
// table, the statistics system's count of live rows, which inserts and
// deletes keep: with autovacuum off, or before it runs, the estimate said 0
// rows however many there were), summed over the table's partitions at
// every level when it has any (a partitioned table's own reltuples stays -1:
// autovacuum never analyzes it), read from the catalog without locking
// any of them: the table alone when it is not partitioned. Both PostgreSQL
// dialects, so that the one inferred from the driver, whatever the table,
// reads a partitioned inbox too (it read 0 rows for good).
func (d postgresDialect) estimateRowsSQL(t qualifiedName) (string, []any) {
	return `WITH RECURSIVE tree (relid) AS (
				SELECT to_regclass($1)::oid
				UNION ALL SELECT i.inhrelid FROM pg_inherits i JOIN tree ON i.inhparent = tree.relid)
			SELECT COALESCE(SUM(CASE WHEN c.reltuples > 0 THEN c.reltuples
					ELSE pg_stat_get_live_tuples(c.oid) END) FILTER (WHERE c.relkind <> 'p'), 0)::bigint
			FROM tree JOIN pg_class c ON c.oid = tree.relid HAVING count(*) > 0`, []any{t.quoted(d)}
}

// The time of the read is clock_timestamp(), the statement's own: now() is
// the transaction's start, before Stats' COUNT, and the span, read after it
// at READ COMMITTED, could hold rows newer than that.
func (d postgresDialect) spanSQL(t qualifiedName) string {
	// Finite rows only, as oldestAgeSQL: a hand-written '-infinity'
	// failed the cast.
	return "SELECT CAST(EXTRACT(EPOCH FROM MIN(processed_at) FILTER (WHERE isfinite(processed_at))) * 1000000 AS bigint), " +
		"CAST(EXTRACT(EPOCH FROM MAX(processed_at) FILTER (WHERE isfinite(processed_at))) * 1000000 AS bigint), " +
		"CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000 AS bigint) FROM " + t.quoted(d)
}

// The table's size with its indexes and TOAST, summed over its partitions
// when it has any (a partitioned table's own size is 0), as estimateRowsSQL.
func (d postgresDialect) sizeSQL(t qualifiedName) (string, []any) {
	return "SELECT COALESCE((SELECT SUM(pg_total_relation_size(relid)) FROM pg_partition_tree(to_regclass($1)))::bigint," +
		" pg_total_relation_size(to_regclass($1)))", []any{t.quoted(d)}
}

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

// A valid, non-partial btree index led by processed_at: one that serves the
// purge's batches, which take the oldest rows in order (ORDER BY
// processed_at LIMIT n). A BRIN index cannot give them in order: each batch
// read and sorted every expired row left, and a purge took time in the
// square of its rows.
const pgPurgeIndexSQL = `SELECT EXISTS (SELECT 1 FROM pg_index i
	JOIN pg_class ic ON ic.oid = i.indexrelid
	JOIN pg_am am ON am.oid = ic.relam
	JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
	WHERE i.indrelid = to_regclass($1) AND a.attname = 'processed_at'
		AND i.indisvalid AND i.indpred IS NULL AND am.amname = 'btree')`

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

// pgCopiedColumns is what a recreate script copies of a table's columns
// besides its key: the expression of its processed_at as a timestamptz,
// and whether it has a fingerprint column of Config.ReusedIDs.
type pgCopiedColumns struct {
	processedAt string
	fingerprint bool
}

// pgReadCopiedColumns reads the columns of t for pgCopiedColumnsOf.
func pgReadCopiedColumns(ctx context.Context, q sqlx.QueryerContext, d Dialect, t qualifiedName) (pgCopiedColumns, error) {
	var cols []pgColumn
	if err := sqlx.SelectContext(ctx, q, &cols, pgColumnsSQL, t.quoted(d)); err != nil {
		return pgCopiedColumns{}, err
	}
	byName := map[string]pgColumn{}
	for _, c := range cols {
		byName[c.Name] = c
	}
	return pgCopiedColumnsOf(ctx, q, byName)
}

// pgCopiedColumnsOf returns what a recreate script or a fix copies of the
// columns byName: processed_at as it is (timestamptz), read in the
// session's time zone (a timestamp without time zone, written in the
// inbox's sessions, which this one is), or now() when there is none, so
// that a row is kept a whole window; the fingerprint when it is a bytea.
func pgCopiedColumnsOf(ctx context.Context, q sqlx.QueryerContext, byName map[string]pgColumn) (pgCopiedColumns, error) {
	from := pgCopiedColumns{processedAt: processedAt}
	switch c, ok := byName[processedAt]; {
	case !ok:
		from.processedAt = "now()"
	case c.Kind == "timestamp":
		var tz string
		if err := sqlx.GetContext(ctx, q, &tz, "SELECT quote_literal(current_setting('TimeZone'))"); err != nil {
			return from, err
		}
		from.processedAt = processedAt + " AT TIME ZONE " + tz
	case c.Kind != "timestamptz":
		from.processedAt = processedAt + "::timestamptz" // text, date: what a cast makes of it, or an error that names the column
	}
	if c, ok := byName["fingerprint"]; ok && c.Kind == "bytea" {
		from.fingerprint = true
	}
	return from, nil
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
	from, err := pgCopiedColumnsOf(ctx, q, byName)
	if err != nil {
		return err
	}
	// A timestamp without time zone holds the wall time of the session
	// that wrote it: read in the checking session's time zone (the
	// inbox's), whoever runs the fix; converted in the runner's, a row
	// moved by the difference, and the purge deleted it early or late.
	fix := "ALTER TABLE " + tq + " ALTER COLUMN " + processedAt + " TYPE timestamptz USING " + from.processedAt
	if partitioned {
		fix = postgresPartitionedDialect{}.recreateScript(t, from)
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
		return pgCheckObjects(ctx, q, tq, ps, partitioned)
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
	return pgCheckObjects(ctx, q, tq, ps, partitioned)
}

// pgObjectsSQL lists what besides columns and the primary key can make a
// claim merge, drop or reject ids, or a purge fail or reach other rows, each
// as (what, the DDL that removes it). Its one parameter is the quoted table.
const pgObjectsSQL = `WITH t AS (SELECT to_regclass($1) AS oid),
tree AS (SELECT oid FROM t UNION SELECT relid FROM pg_partition_tree((SELECT oid FROM t)))
SELECT 'unique index ' || quote_ident(ic.relname) ||
       CASE WHEN i.indrelid = (SELECT oid FROM t)
            THEN ': a second arbiter of the claim''s ON CONFLICT, so ids it folds (or that a consumer shares) are taken for duplicates'
            ELSE ' on partition ' || i.indrelid::regclass::text || ': it rejects the ids it folds (or that a consumer shares), on every redelivery' END AS what,
       CASE WHEN con.conname IS NOT NULL THEN 'ALTER TABLE ' ||
                 CASE WHEN i.indrelid = (SELECT oid FROM t) THEN $1 ELSE i.indrelid::regclass::text END ||
                 ' DROP CONSTRAINT ' || quote_ident(con.conname)
            ELSE 'DROP INDEX ' || quote_ident(n.nspname) || '.' || quote_ident(ic.relname) END AS fix
  FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid JOIN pg_namespace n ON n.oid = ic.relnamespace
  LEFT JOIN pg_constraint con ON con.conindid = i.indexrelid AND con.conrelid = i.indrelid
 WHERE i.indrelid IN (SELECT oid FROM tree) AND i.indisunique AND NOT i.indisprimary
   AND NOT EXISTS (SELECT 1 FROM pg_inherits WHERE inhrelid = i.indexrelid)
UNION ALL
SELECT 'trigger ' || quote_ident(tgname) ||
       CASE WHEN tgrelid = (SELECT oid FROM t) THEN '' ELSE ' on partition ' || tgrelid::regclass::text END ||
       ': it can change, redirect or drop the claim''s row',
       'DROP TRIGGER ' || quote_ident(tgname) || ' ON ' ||
       CASE WHEN tgrelid = (SELECT oid FROM t) THEN $1 ELSE tgrelid::regclass::text END
  FROM pg_trigger tg WHERE tgrelid IN (SELECT oid FROM tree) AND NOT tgisinternal
   AND COALESCE((to_jsonb(tg) ->> 'tgparentid')::oid, 0) = 0
UNION ALL
SELECT 'exclusion constraint ' || quote_ident(conname) ||
       CASE WHEN conrelid = (SELECT oid FROM t) THEN '' ELSE ' on partition ' || conrelid::regclass::text END ||
       ': it rejects ids it takes for conflicting, on every redelivery',
       'ALTER TABLE ' || CASE WHEN conrelid = (SELECT oid FROM t) THEN $1 ELSE conrelid::regclass::text END ||
       ' DROP CONSTRAINT ' || quote_ident(conname)
  FROM pg_constraint WHERE contype = 'x' AND conrelid IN (SELECT oid FROM tree) AND conparentid = 0
UNION ALL
SELECT 'rule ' || quote_ident(rulename) || ': it can rewrite or drop the claim',
       'DROP RULE ' || quote_ident(rulename) || ' ON ' || $1
  FROM pg_rewrite WHERE ev_class = (SELECT oid FROM t) AND rulename <> '_RETURN'
UNION ALL
SELECT 'CHECK constraint ' || quote_ident(conname) ||
       CASE WHEN conrelid = (SELECT oid FROM t) THEN '' ELSE ' on partition ' || conrelid::regclass::text END ||
       ': it can reject a valid message id',
       'ALTER TABLE ' || CASE WHEN conrelid = (SELECT oid FROM t) THEN $1 ELSE conrelid::regclass::text END ||
       ' DROP CONSTRAINT ' || quote_ident(conname)
  FROM pg_constraint WHERE conrelid IN (SELECT oid FROM tree) AND contype = 'c' AND (conislocal OR conrelid = (SELECT oid FROM t))
UNION ALL
SELECT 'foreign key ' || quote_ident(conname) || ' of ' || conrelid::regclass::text ||
       CASE WHEN confrelid IN (SELECT oid FROM tree) THEN ' references the inbox table: a purge fails on it, or cascades into that table'
            ELSE ' from the inbox table: it can reject a claim' END,
       'ALTER TABLE ' || conrelid::regclass::text || ' DROP CONSTRAINT ' || quote_ident(conname)
  FROM pg_constraint WHERE contype = 'f' AND conparentid = 0
   AND (confrelid IN (SELECT oid FROM tree) OR conrelid IN (SELECT oid FROM tree))
UNION ALL
SELECT CASE WHEN oid = (SELECT oid FROM t) THEN 'the table is' ELSE 'partition ' || oid::regclass::text || ' is' END ||
       ' UNLOGGED: PostgreSQL empties it in crash recovery, and every message redelivered after a crash is processed again',
       'ALTER TABLE ' || CASE WHEN oid = (SELECT oid FROM t) THEN $1 ELSE oid::regclass::text END || ' SET LOGGED'
  FROM pg_class WHERE oid IN (SELECT oid FROM tree) AND relpersistence = 'u'
UNION ALL
SELECT 'row-level security is enabled for this session''s role: a policy can hide processed rows from the claim' ||
       ' (the partitioned dialect''s then takes each redelivery for a new message) or reject its row, and keep a purge from deleting',
       'ALTER TABLE ' || $1 || ' DISABLE ROW LEVEL SECURITY'
  FROM pg_class WHERE oid = (SELECT oid FROM t) AND relrowsecurity AND row_security_active(oid)
`

// pgInheritedSQL lists the tables that inherit from a plain (not
// partitioned) table: a purge deletes their rows, and Stats counts them.
const pgInheritedSQL = `SELECT inhrelid::regclass::text FROM pg_inherits WHERE inhparent = to_regclass($1)`

// pgCheckObjects adds the problems of pgObjectsSQL, and of child tables of a
// plain table, for the table quoted tq.
func pgCheckObjects(ctx context.Context, q sqlx.QueryerContext, tq string, ps *problems, partitioned bool) error {
	var objects []struct {
		What string `db:"what"`
		Fix  string `db:"fix"`
	}
	if err := sqlx.SelectContext(ctx, q, &objects, pgObjectsSQL, tq); err != nil {
		return err
	}
	for _, o := range objects {
		ps.add(o.Fix, "%s", o.What)
	}
	if partitioned {
		return nil
	}
	var children []string
	if err := sqlx.SelectContext(ctx, q, &children, pgInheritedSQL, tq); err != nil {
		return err
	}
	for _, child := range children {
		ps.add("ALTER TABLE "+child+" NO INHERIT "+tq,
			"table %q inherits from the inbox table: a purge deletes its rows, and Stats counts them", child)
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

// Reads outside a message's transaction run in one short transaction,
// rolled back when f returns (it only reads): behind a transaction-mode
// pooler (PgBouncer) only a transaction keeps one server connection, and
// lib/pq sends a statement with arguments in two exchanges (parse, then
// bind and execute) that the pooler may otherwise hand to two server
// connections. The rollback's own error is not returned: the reads are
// complete, and database/sql discards a connection whose rollback failed.
func (postgresDialect) readTx(ctx context.Context, db dbConn, f func(q sqlx.QueryerContext) error) error {
	tx, err := db.BeginTxx(ctx, nil)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	defer tx.Rollback() //nolint:errcheck // read only; see above
	return f(tx)
}

// The schema the table is in, or the one CREATE TABLE would use
// (current_schema()) when it does not exist yet.
func (d postgresDialect) resolveSchema(ctx context.Context, q sqlx.QueryerContext, t qualifiedName) (string, error) {
	var schema string
	err := sqlx.GetContext(ctx, q, &schema, `SELECT COALESCE(
		(SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = to_regclass($1)),
		current_schema())`, t.quoted(d))
	return schema, err
}

func (d postgresDialect) checkIsolation(l sql.IsolationLevel) error {
	if !standardIsolation(l) {
		return errIsolationRefused(l, d)
	}
	return nil
}

func (postgresDialect) txOptions(user *sql.TxOptions) *sql.TxOptions { return copyTxOptions(user) }

// nativeBegin renders opts as PostgreSQL's BEGIN (its SQL reference: BEGIN
// [ ISOLATION LEVEL level ] [ READ ONLY ]); checkIsolation has accepted the
// level.
func (postgresDialect) nativeBegin(opts *sql.TxOptions) (string, bool) {
	q := "BEGIN"
	if opts == nil {
		return q, true
	}
	switch opts.Isolation {
	case sql.LevelReadUncommitted:
		q += " ISOLATION LEVEL READ UNCOMMITTED"
	case sql.LevelReadCommitted:
		q += " ISOLATION LEVEL READ COMMITTED"
	case sql.LevelRepeatableRead:
		q += " ISOLATION LEVEL REPEATABLE READ"
	case sql.LevelSerializable:
		q += " ISOLATION LEVEL SERIALIZABLE"
	}
	if opts.ReadOnly {
		q += " READ ONLY"
	}
	return q, true
}

func (postgresDialect) schemaNotes(qualifiedName) string {
	return "-- Primary key (consumer, message_id): the claim. Index on processed_at: the purge.\n" +
		fingerprintNote +
		"-- processed_at: the database clock (now()), an absolute instant.\n"
}

// Concurrent CREATE TABLE IF NOT EXISTS of one name can fail with a unique
// violation on pg_type: starters are serialised on an advisory lock that
// ends with the transaction (so it holds behind a transaction-mode pooler),
// keyed by the name as resolved by the database. DDL is transactional here.
func (d postgresDialect) createSchema(ctx context.Context, db *sqlx.DB, t qualifiedName, _ int) error {
	return createSchemaLocked(ctx, db, d, t, d.createSQL(t))
}

// createSchemaLocked runs stmts in one transaction under the schema lock of
// t (see postgresDialect.createSchema).
func createSchemaLocked(ctx context.Context, db *sqlx.DB, d Dialect, t qualifiedName, stmts []string) error {
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
	if _, partitioned := d.(postgresPartitionedDialect); partitioned {
		// A plain table of that name: CREATE TABLE IF NOT EXISTS left it,
		// the claim functions were created beside it, and only the
		// partitions then failed, leaving the functions behind.
		var kind sql.NullString
		if err := tx.QueryRowxContext(ctx, "SELECT (SELECT relkind::text FROM pg_catalog.pg_class WHERE oid = to_regclass($1))",
			ct.quoted(d)).Scan(&kind); err != nil {
			return fmt.Errorf("inbox: initialize schema of %s: read the table's kind: %w", t, err)
		}
		if kind.Valid && kind.String != "p" {
			return fmt.Errorf("%w: initialize schema of %s: the table exists and is not partitioned, so PostgreSQLPartitioned"+
				" cannot use it (nothing was created): use the PostgreSQL dialect, or recreate it partitioned (inbox schema"+
				" -verify -dialect postgres-partitioned prints a migration script)", ErrIncompatibleTable, t)
		}
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

func (postgresDialect) maintainSchema(context.Context, dbConn, qualifiedName) error { return nil }

// One DELETE, autocommitted: its own transaction, one round trip. It has no
// bind parameters (purgeStatement), so lib/pq sends it in one exchange too
// (the simple query protocol) and a transaction-mode pooler (PgBouncer)
// runs it on one server connection; a statement with arguments, which
// lib/pq sends in two exchanges, would need an explicit transaction, and
// BEGIN and COMMIT would triple the round trips of every batch (on a busy
// database, every round trip is a wait for a core; see BENCHMARKS.md).
//
// A batch that deleted fewer rows than the batch size either ran out of
// expired rows or lost some to another purge that chose the same rows (the
// DELETE does not lock them first, see purgeStatement); the rows it found
// are then what it deleted plus the expired rows still there (counted up to
// the batch size by q.remaining), so the purge goes on while a full batch
// is left and stops, as before, once fewer are.
//
// With q.cursor (postgresDialect's batch), the batch returns its count and
// the bound for the next one (the newest finite processed_at it deleted, in Unix
// milliseconds, floored, less one): a batch that deleted rows moves
// q.cursor there, one that deleted none clears it, so that the batch after
// it scans from the oldest row, and a short batch that ran from a bound and
// left expired rows below it reports a full batch found, so that the purge
// runs that batch rather than stopping. A batch from the oldest row that
// deleted nothing reads the oldest expired row (q.oldest) instead of
// counting: see the code.
func (postgresDialect) purgeBatch(ctx context.Context, db dbConn, _ qualifiedName, q purgeQuery, _ *hooks) (deleted, found int64, err error) {
	bounded := q.cursor.set
	stmt := q.sql
	if bounded {
		stmt = q.resume(q.cursor.fromMillis)
	}
	var next sql.NullInt64
	if err := db.QueryRowxContext(ctx, stmt, q.args...).Scan(&deleted, &next); err != nil {
		return 0, 0, err
	}
	if !bounded && deleted == 0 && q.oldest != "" {
		// A batch from the oldest expired row deleted nothing: another
		// purge took its rows (see above), or this purge's DELETE keeps
		// them (a BEFORE DELETE trigger that skips them, a row security
		// policy), a batch or more of them. The oldest expired row and how
		// many are left tell: both stay the same when the rows are kept,
		// and another purge's deletes change the count, all of it (a count
		// up to a limit stayed at the limit on a large table). Unchanged through
		// two such batches, the purge ends, as a partitioned table's walk
		// that deleted nothing does: each batch chose the kept rows again,
		// for ever, holding the Purger's lock.
		var oldest sql.NullString
		var left int64
		if err := db.QueryRowxContext(ctx, q.oldest).Scan(&oldest, &left); err != nil {
			return 0, 0, fmt.Errorf("read the oldest expired row: %w", err)
		}
		if !oldest.Valid || q.cursor.fruitless && oldest.String == q.cursor.oldest && left == q.cursor.left {
			*q.cursor = purgeCursor{}
			return 0, 0, nil
		}
		*q.cursor = purgeCursor{fruitless: true, oldest: oldest.String, left: left}
		return 0, q.size, nil // once more from the oldest
	}
	// After a batch that deleted rows the next starts at its bound, short
	// or not: one from the oldest after each short batch crawled past
	// rows the DELETE keeps, one row a batch when they were one fewer
	// than a batch.
	*q.cursor = purgeCursor{fromMillis: next.Int64, set: deleted > 0 && next.Valid}
	found = deleted
	if q.remaining != "" && deleted < q.size {
		var left int64
		if err := db.QueryRowxContext(ctx, q.remaining).Scan(&left); err != nil {
			// The batch's delete has committed: its rows count.
			return deleted, 0, fmt.Errorf("count the expired rows left: %w", err)
		}
		if left > 0 {
			// Expired rows this batch did not delete: below its bound, lost
			// to another purge (part of the batch: another consumer's
			// rows behind them ended the purge), or kept by the DELETE.
			// The next batch takes them or, from the oldest, tells kept
			// ones (above).
			found = q.size
		}
	}
	return deleted, found, nil
}

// pg_try_advisory_xact_lock in a
// transaction of its own, held open for the round and rolled back to
// release. A transaction-scoped lock holds behind a transaction-mode pooler
// (PgBouncer), where a session lock would be taken on one server connection
// and released, or not, on another. The transaction only takes the lock and
// then keeps no snapshot (see below), so it holds back no vacuum, and the
// round's statements run on the pool, each in its own short transaction: a
// round needs two connections, and a pool limited to one is refused.
//
// With wait, it polls (pg_try_advisory_xact_lock, backing off from 50 ms to
// 1 s) rather than blocking in pg_advisory_xact_lock: a caller blocked on
// the lock would hold a server connection that the holder may need for its
// work, which behind a small transaction-mode pool deadlocks the pool.
func (d postgresDialect) purgeLock(ctx context.Context, db *sqlx.DB, t qualifiedName, wait bool) (purgeLease, bool, error) {
	if db.Stats().MaxOpenConnections == 1 {
		return purgeLease{}, false, fmt.Errorf("%w: on PostgreSQL the purge needs two connections (one holds the lock's transaction), and DB allows one (sql.DB.SetMaxOpenConns)", ErrInvalidConfig)
	}
	for backoff := 50 * time.Millisecond; ; backoff = min(2*backoff, time.Second) {
		lease, got, err := d.tryPurgeLock(ctx, db, t)
		if got || err != nil || !wait {
			return lease, got, err
		}
		select {
		case <-ctx.Done():
			return purgeLease{}, false, ctx.Err()
		case <-time.After(backoff):
		}
	}
}

// tryPurgeLock is one attempt of purgeLock.
func (d postgresDialect) tryPurgeLock(ctx context.Context, db *sqlx.DB, t qualifiedName) (purgeLease, bool, error) {
	tx, err := db.BeginTxx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return purgeLease{}, false, err
	}
	ct, err := canonicalTable(ctx, tx, d, t)
	if err != nil {
		tx.Rollback() //nolint:errcheck // the error above is the one to report
		return purgeLease{}, false, err
	}
	var got bool
	if err := tx.QueryRowxContext(ctx, "SELECT pg_try_advisory_xact_lock($1)", purgeLockKey(ct)).Scan(&got); err != nil || !got {
		tx.Rollback() //nolint:errcheck // nothing held; err is the one to report
		return purgeLease{}, false, err
	}
	// A statement without arguments goes by the simple protocol, which
	// drops the unnamed portal of the lock query: that portal keeps the
	// transaction's snapshot, and with it the session's xmin, which
	// would hold back vacuum and make DETACH PARTITION ... FINALIZE wait
	// on this very transaction. It also keeps a server-side
	// idle_in_transaction_session_timeout from ending the lock while
	// the round runs.
	if _, err := tx.ExecContext(ctx, "SET LOCAL idle_in_transaction_session_timeout = 0"); err != nil {
		tx.Rollback() //nolint:errcheck // the error above is the one to report
		return purgeLease{}, false, err
	}
	release := func() error {
		if err := tx.Rollback(); err != nil && !errors.Is(err, sql.ErrTxDone) {
			// ErrTxDone: ctx ended and database/sql rolled back already.
			return fmt.Errorf("the lock's transaction failed (the lock may have been lost during the round): %w", err)
		}
		return nil
	}
	return purgeLease{work: db, release: release}, true, nil
}

// A partitioned table gets PostgreSQLPartitioned's round whatever the
// configured dialect (one a PurgeConfig left to be inferred from the
// driver, which never infers PostgreSQLPartitioned): it creates the coming
// partitions and drops the old ones, which row batches never would.
func (d postgresDialect) purgeRound(ctx context.Context, db dbConn, cfg PurgeConfig, t qualifiedName) PurgeRound {
	pd, err := purgeDialect(ctx, db, d, t)
	if err != nil {
		return PurgeRound{Err: fmt.Errorf("inbox: purge %s: %w", t, err)}
	}
	if pd, ok := pd.(postgresPartitionedDialect); ok {
		return pd.purgeRound(ctx, db, cfg, t)
	}
	return purgeRows(ctx, d, db, cfg, t)
}

// fingerprintWriteProbeSQL: none, has_column_privilege in fingerprintColumnSQL tells.
func (postgresDialect) fingerprintWriteProbeSQL(qualifiedName) string { return "" }

// outboxDurability refuses an UNLOGGED table (crash recovery empties it,
// as PostgreSQL documents for unlogged tables: committed messages lost)
// and an outbox id narrower than bigint (an integer runs out after 2^31
// messages, and every handler's transaction then fails on its insert).
func (d postgresDialect) outboxDurability(ctx context.Context, q sqlx.QueryerContext, t qualifiedName, outbox bool) (problem, fix string, err error) {
	var kind struct {
		Persistence string `db:"persistence"`
		IDType      string `db:"id_type"`
		RowSecurity bool   `db:"row_security"`
	}
	err = sqlx.GetContext(ctx, q, &kind, `SELECT c.relpersistence::text AS persistence,
		COALESCE((SELECT format_type(a.atttypid, NULL) FROM pg_attribute a WHERE a.attrelid = c.oid AND a.attname = 'id'
			AND NOT a.attisdropped), '') AS id_type,
		c.relrowsecurity AND row_security_active(c.oid) AS row_security
		FROM pg_class c WHERE c.oid = to_regclass($1)`, t.quoted(d))
	switch {
	case err != nil:
		return "", "", err
	case kind.Persistence == "u":
		return "is UNLOGGED: crash recovery empties it, and committed messages are lost", "ALTER TABLE " + t.quoted(d) + " SET LOGGED", nil
	case kind.RowSecurity:
		// A SELECT policy that hid the service's rows let the handlers'
		// INSERTs commit and kept the relay from ever seeing them: no
		// message was sent, and Stats counted none pending.
		return "has row-level security that applies to this session's role: a policy can hide committed messages from the" +
				" relay (never sent, and not counted pending) or refuse the handlers' inserts",
			"ALTER TABLE " + t.quoted(d) + " DISABLE ROW LEVEL SECURITY", nil
	case outbox && kind.IDType != "" && kind.IDType != "bigint":
		return "has an id of type " + kind.IDType + ", which runs out (after 2^31 messages for an integer), and every" +
				" handler's transaction then fails on its insert", "ALTER TABLE " + t.quoted(d) + " ALTER COLUMN id TYPE bigint" +
				" (and ALTER SEQUENCE … AS bigint for the sequence of its default or identity)", nil
	}
	return "", "", nil
}
