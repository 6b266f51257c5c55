package inbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jmoiron/sqlx"
)

var _ Dialect = postgresPartitionedDialect{}

// postgresPartitionedDialect is PostgreSQL with the inbox table
// range-partitioned on processed_at by week or day (PostgreSQLPartitioned,
// PartitionInterval): what differs from
// postgresDialect, which it embeds. The partition maintenance itself is in
// partition.go.
type postgresPartitionedDialect struct{ postgresDialect }

func (postgresPartitionedDialect) String() string { return "postgres-partitioned" }

func (d postgresPartitionedDialect) claimSQL(t qualifiedName) string { return d.claimInsert(t, "") }

func (d postgresPartitionedDialect) claimFingerprintSQL(t qualifiedName) string {
	return d.claimInsert(t, "$3")
}

func (postgresPartitionedDialect) claimFlagsOtherFingerprint() bool { return false }

// claimInsert is the claim's INSERT, storing the fingerprint given as the
// parameter fingerprint ("$3", "$4"), or none when it is "".
func (d postgresPartitionedDialect) claimInsert(t qualifiedName, fingerprint string) string {
	q := t.quoted(d)
	// Under the key lock (keyLockSQL), so the NOT EXISTS sees a concurrent
	// claim of the key once it committed, in whatever partition, and no
	// other claim of the key can insert until this transaction ends. No ON
	// CONFLICT clause: under the lock the primary key cannot conflict (a
	// row of the key is seen by the NOT EXISTS, in this transaction too),
	// and on a partitioned table the clause's speculative insertion made
	// the claim 13-16 % slower (pgbench, 8 clients, 4 weekly partitions); a
	// conflict from a row written without the lock fails the claim
	// (SQLSTATE 23505, a nack) instead of passing as a duplicate.
	columns, values := "consumer, message_id, processed_at", "$1, $2, now()"
	if fingerprint != "" {
		columns, values = columns+", fingerprint", values+", "+fingerprint
	}
	return "INSERT INTO " + q + " (" + columns + ") SELECT " + values +
		" WHERE NOT EXISTS (SELECT 1 FROM " + q + " WHERE consumer = $1 AND message_id = $2)"
}

func (postgresPartitionedDialect) keyLock() (string, bool) {
	return "SELECT pg_advisory_xact_lock($1)", true
}

// The claim function of a partitioned table: the key lock and the claim in
// one call, so a claim costs one round trip instead of two (BENCHMARKS.md:
// the partitioned claim at the Kafka-default window). It must be PL/pgSQL:
// at READ COMMITTED each of its statements takes a new snapshot, so the
// claim runs after the key lock is granted and sees a concurrent claim of
// the key that committed meanwhile, as the second of two statements does
// (one SQL statement would take its snapshot before it waits for the lock).
// It is created with the table (createSQL), or next to an existing table by
// InitializeSchema (existsSQL counts it); a table without it, or with a
// function of that name that is not exactly this one, claims in two
// statements.

// claimFunction returns the name of t's claim function, "<table>_claim" in
// t's schema (as t is spelled: unqualified, it resolves through search_path
// as t does).
func (d postgresPartitionedDialect) claimFunction(t qualifiedName) qualifiedName {
	return qualifiedName{schema: t.schema, name: t.derivedName("_claim")}
}

// claimFunctionBody is the function's source: the key lock, then claimSQL,
// whose $1 and $2 are the function's first two arguments, and with
// fingerprint the claim that stores its fourth (Config.ReusedIDs). One
// line, so that a migration tool that splits a script at line-ending
// semicolons keeps the function whole.
func (d postgresPartitionedDialect) claimFunctionBody(t qualifiedName, fingerprint bool) string {
	claim := d.claimSQL(t)
	if fingerprint {
		claim = d.claimInsert(t, "$4")
	}
	return "BEGIN PERFORM pg_advisory_xact_lock($3); " + claim + "; RETURN FOUND; END"
}

// claimFunctionArgs are the argument types of the claim function, with the
// fingerprint's or without: two overloads of one name.
func claimFunctionArgs(fingerprint bool) string {
	if fingerprint {
		return "(text, text, bigint, bytea)"
	}
	return "(text, text, bigint)"
}

func (d postgresPartitionedDialect) claimFunctionSQL(t qualifiedName, fingerprint bool) string {
	return "CREATE OR REPLACE FUNCTION " + d.claimFunction(t).quoted(d) + claimFunctionArgs(fingerprint) + " RETURNS boolean\n" +
		"    LANGUAGE plpgsql VOLATILE AS $$" + d.claimFunctionBody(t, fingerprint) + "$$"
}

// Only a function exactly as claimFunctionSQL makes it: the same
// source, signature, return type, volatility and language, no settings of
// its own (proconfig: a SET search_path would resolve the table's name
// elsewhere) and not SECURITY DEFINER.
// A zero-column row when the claim inserted the key, none when it was
// there: rows affected 1 or 0, as claimSQL's.
func (d postgresPartitionedDialect) lockedClaim(ctx context.Context, q sqlx.QueryerContext, t qualifiedName, fingerprint bool) (string, error) {
	fn := d.claimFunction(t).quoted(d)
	var n int
	err := sqlx.GetContext(ctx, q, &n, `SELECT count(*) FROM pg_proc WHERE oid = to_regprocedure($1) AND prosrc = $2
		AND provolatile = 'v' AND prorettype = 'boolean'::regtype AND proconfig IS NULL AND NOT prosecdef
		AND prolang = (SELECT oid FROM pg_language WHERE lanname = 'plpgsql')`,
		fn+claimFunctionArgs(fingerprint), d.claimFunctionBody(t, fingerprint))
	if err != nil || n == 0 {
		return "", err
	}
	if fingerprint {
		return "SELECT FROM " + fn + "($1, $2, $3, $4) AS claimed WHERE claimed", nil
	}
	return "SELECT FROM " + fn + "($1, $2, $3) AS claimed WHERE claimed", nil
}

func (d postgresPartitionedDialect) createSQL(t qualifiedName) []string {
	// No purge index: purging drops whole partitions. The primary key, led
	// by (consumer, message_id), serves the claim's lookup in every
	// partition. No DEFAULT partition: a claim with no partition for its
	// time fails loudly (nack) instead of landing where no drop reaches it.
	return []string{
		"CREATE TABLE IF NOT EXISTS " + t.quoted(d) + " (\n" +
			"    consumer     text        NOT NULL,\n" +
			"    message_id   text        NOT NULL,\n" +
			"    processed_at timestamptz NOT NULL DEFAULT now(),\n" +
			"    " + d.fingerprintColumn() + ",\n" +
			"    PRIMARY KEY (consumer, message_id, processed_at)\n" +
			") PARTITION BY RANGE (processed_at)",
		d.claimFunctionSQL(t, false),
		d.claimFunctionSQL(t, true),
	}
}

func (d postgresPartitionedDialect) existsSQL(t qualifiedName) (string, []any) {
	// The table and its claim functions (2: the table and both overloads),
	// whatever the functions' bodies (one made otherwise is left alone and
	// not called: lockedClaim); the partitions are managed by
	// CreatePartitions.
	fn := d.claimFunction(t).quoted(d)
	return "SELECT (to_regclass($1) IS NOT NULL)::int + (to_regprocedure($2) IS NOT NULL AND to_regprocedure($3) IS NOT NULL)::int",
		[]any{t.quoted(d), fn + claimFunctionArgs(false), fn + claimFunctionArgs(true)}
}

func (d postgresPartitionedDialect) checkTable(ctx context.Context, q sqlx.QueryerContext, t qualifiedName) ([]tableProblem, error) {
	rel, err := pgReadRelation(ctx, q, d, t)
	if err != nil {
		return nil, err
	}
	var ps problems
	from, err := pgReadCopiedColumns(ctx, q, d, t)
	if err != nil {
		return nil, err
	}
	recreate := d.recreateScript(t, from)
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
	// The partition key first: on another column, or a timestamp without
	// time zone, nothing below means what it would.
	tp, err := listPartitions(ctx, q, t)
	if err != nil {
		return nil, err
	}
	if what := tp.key.problem(); what != "" {
		ps.add(recreate, "%s", what)
		return ps, nil
	}
	if err := pgCheckCommon(ctx, q, d, t, rel, &ps, partitionedKey, true); err != nil {
		return nil, err
	}
	if what, fix := tp.problem(t); what != "" {
		ps.add(fix, "%s", what)
	}
	// A claim function with settings of its own (ALTER FUNCTION ... SET
	// search_path) could resolve the table's name to another table; the
	// inbox does not call it (lockedClaim), but nothing else should either.
	// Both overloads: with the fingerprint and without (Config.ReusedIDs).
	for _, fingerprint := range []bool{false, true} {
		fn := d.claimFunction(t).quoted(d) + claimFunctionArgs(fingerprint)
		var settings sql.NullString
		err = sqlx.GetContext(ctx, q, &settings, "SELECT array_to_string(proconfig, ', ') FROM pg_proc WHERE oid = to_regprocedure($1)", fn)
		if err != nil && !errors.Is(err, sql.ErrNoRows) {
			return nil, err
		}
		if settings.Valid && settings.String != "" {
			ps.add("ALTER FUNCTION "+fn+" RESET ALL",
				"the claim function %s has settings of its own (%s), under which its statements may reach another table;"+
					" the inbox claims in two statements instead of calling it", fn, settings.String)
		}
	}
	return ps, nil
}

// recreateScript returns the statements that replace t, whose columns are
// from, with a partitioned table of the canonical shape, keeping its rows:
// their key, the time each was processed (a timestamp without time zone
// read in the checking session's time zone, in which the inbox wrote it)
// and the fingerprint of Config.ReusedIDs (left out, a reused id with
// other content was acked as a duplicate after the move, its event lost).
// The old table is left for the operator to drop once the rows are
// checked: piped to psql without the step between (the partitioned table
// and its partitions), the INSERT failed and a DROP after it, outside a
// transaction, lost every processed row.
func (d postgresPartitionedDialect) recreateScript(t qualifiedName, from pgCopiedColumns) string {
	old := oldName(t)
	cols, values := "consumer, message_id, processed_at", "consumer, message_id, "+from.processedAt
	if from.fingerprint {
		cols, values = cols+", fingerprint", values+", fingerprint"
	}
	return "ALTER TABLE " + t.quoted(d) + " RENAME TO " + d.quote(old.name) + ";\n" +
		"-- Create the partitioned table (the canonical DDL below, or InitializeSchema) and the partitions\n" +
		"-- for the time of the existing rows (CreatePartitions), then copy the rows:\n" +
		"INSERT INTO " + t.quoted(d) + " (" + cols + ") SELECT " + values + " FROM " + old.quoted(d) + ";\n" +
		"-- then, once " + t.quoted(d) + " holds the rows of " + old.quoted(d) + ": DROP TABLE " + old.quoted(d) + ";"
}

func (postgresPartitionedDialect) checkIsolation(l sql.IsolationLevel) error {
	if l != sql.LevelDefault && l != sql.LevelReadCommitted {
		return fmt.Errorf("inbox: PostgreSQLPartitioned needs READ COMMITTED, got Config.TxOptions.Isolation %v", l)
	}
	return nil
}

// Pinned, never left to the server's default_transaction_isolation: at
// REPEATABLE READ the snapshot would be taken before the key lock is
// granted. Validate refused any other explicit level.
func (postgresPartitionedDialect) txOptions(user *sql.TxOptions) *sql.TxOptions {
	opts := sql.TxOptions{Isolation: sql.LevelReadCommitted}
	if user != nil {
		opts.ReadOnly = user.ReadOnly
	}
	return &opts
}

func (d postgresPartitionedDialect) schemaNotes(t qualifiedName) string {
	start := time.Date(2026, 11, 30, 0, 0, 0, 0, time.UTC) // a Monday
	p, _ := partitionName(t, PartitionWeek, start)
	return fingerprintNote +
		"-- Range-partitioned on processed_at, by ISO week (Monday 00:00 UTC) unless the table's partitions\n" +
		"-- say otherwise (see PartitionInterval); partitions are created ahead by InitializeSchema /\n" +
		"-- CreatePartitions (or a Purger) and dropped by DropPartitions.\n" +
		"-- The primary key must include the partition key, so it guards one partition only:\n" +
		"-- the claim serialises each key with pg_advisory_xact_lock and checks every partition,\n" +
		"-- both in one call of the function " + d.claimFunction(t).quoted(d) + " (without it, in two statements).\n" +
		"-- Partition of one week: CREATE TABLE " + p.quoted(d) + " PARTITION OF " + t.quoted(d) + "\n" +
		"--   FOR VALUES FROM ('2026-11-30 00:00:00Z') TO ('2026-12-07 00:00:00Z');\n" +
		"-- (daily partitions are named " + t.name + "_pYYYYMMDD and cover one UTC day.)\n"
}

func (d postgresPartitionedDialect) createSchema(ctx context.Context, db *sqlx.DB, t qualifiedName, _ int) error {
	return createSchemaLocked(ctx, db, d, t, d.createSQL(t))
}

// The partitions, at the table's interval, that cover yesterday (by the
// database clock) to DefaultPartitionsAhead days after today.
func (d postgresPartitionedDialect) maintainSchema(ctx context.Context, db dbConn, t qualifiedName) error {
	return d.maintainPartitions(ctx, db, t, 0, 0)
}

// maintainPartitions is maintainSchema for a Purger round whose window is
// window (0: none): no partition is made for days entirely past it
// (maintainedRange); and, for a Purger whose next round is nextRound away
// (0: none), partitions until after the round after it.
func (postgresPartitionedDialect) maintainPartitions(ctx context.Context, db dbConn, t qualifiedName, window, nextRound time.Duration) error {
	from, until, err := maintainedRange(ctx, db, t, window, nextRound)
	if err != nil {
		return err
	}
	return createPartitions(ctx, db, t, "", false, from, until)
}

// A purge of a partitioned table walks it partition by partition, oldest
// first (see purgeBatch): the table has no processed_at index to choose
// the oldest rows by (its partitions are its ranges), and a batch that
// chose them across the whole table sorted every expired row of every
// partition past the window, then matched its choice against all of them
// (a hash join): 74-79 ms a batch of 1,000 at 300,000 rows, growing with
// the rows left, so that a purge took time in the square of its rows and a
// large table's never caught up (BENCHMARKS.md). Its statements carry the
// cutoff, the partitions' bounds and the key as timestamp literals
// (pgTimestampConstant), so that the planner prunes the partitions when it
// plans: as expressions (timestamptz 'epoch' + N * interval), stable and
// not constant, every partition was planned, and the statement of the rows
// outside the range partitions took 0.8 s to plan at 100 partitions, 34 s
// at 365; a batch's plan also sorted the rest of its partition instead of
// reading its primary key's index in order.
func (d postgresPartitionedDialect) purgeStatement(t qualifiedName, cutoff int64, batch int, consumer string) purgeQuery {
	expired := "processed_at < " + pgTimestampConstant(cutoff)
	if consumer != "" {
		expired += " AND consumer = " + pgStringConstant(consumer)
	}
	return purgeQuery{
		size:      int64(batch),
		walk:      &partitionedPurge{table: t, cutoff: cutoff, expired: expired},
		remaining: "SELECT count(*) FROM (SELECT FROM " + t.quoted(d) + " WHERE " + expired + " LIMIT 1) AS expired",
	}
}

// partitionedPurge is where a purge of a partitioned table is in its walk:
// the slices of the table it deletes from, one at a time, and the last key
// the slice's batch before chose.
type partitionedPurge struct {
	table   qualifiedName
	cutoff  int64  // as purgeStatement's
	expired string // the rows the purge deletes
	slices  []string
	catalog string   // the leaves and when their partitions were attached: a walk's catalog, to compare
	at      int      // the slice the next batch reads; len(slices): the walk's end
	key     purgeKey // where in it, unless unset: its first key
	// deleted counts the rows the walk deleted: a walk that deleted none
	// is not walked again for expired rows left (rows that its DELETEs
	// do not remove: a trigger or a row security policy that keeps them).
	deleted int64
}

// purgeKey is the primary key of the last row a purge batch chose: where
// the next batch in its slice starts (set). micros is processed_at in
// microseconds since the Unix epoch, NULL for '-infinity' (the one value
// without them that a batch chooses: a row at 'infinity' is never expired).
type purgeKey struct {
	consumer, messageID string
	micros              sql.NullInt64
	set                 bool
}

// pgTimestampConstant is the instant us microseconds after the Unix epoch
// as a PostgreSQL timestamptz literal in ISO 8601 with its offset
// (timestamptz '2026-12-07 05:30:00.123456+00'), which reads the same under
// every DateStyle and TimeZone and is a constant when the statement is
// planned. An instant outside the years 1 to 9999, which ISO's four digits
// cannot write, is an expression instead: not a constant, but exact (whole
// seconds and microseconds apart, each below 2^53, as the float8 that
// multiplies an interval holds exactly).
func pgTimestampConstant(us int64) string {
	at := time.UnixMicro(us).UTC()
	if y := at.Year(); y < 1 || y > 9999 {
		return "(timestamptz 'epoch' + " + strconv.FormatInt(us/1_000_000, 10) + " * interval '1 second' + " +
			strconv.FormatInt(us%1_000_000, 10) + " * interval '1 microsecond')"
	}
	return "timestamptz '" + at.Format("2006-01-02 15:04:05.999999") + "+00'"
}

// pgPurgeLeavesSQL lists the leaf tables of the partitioned table $1 (a
// partition not partitioned itself is its own leaf) with the schema and
// name of the partition of $1 above them, and the transaction that attached
// that partition (its pg_inherits row's xmin, which a DETACH and ATTACH
// change).
const pgPurgeLeavesSQL = `SELECT l.relid::oid::bigint AS leaf, n.nspname::text AS schema, c.relname::text AS name, i.xmin::text AS attached
FROM pg_partition_tree(to_regclass($1)) AS l
JOIN pg_partition_ancestors(l.relid) AS a ON true
JOIN pg_inherits i ON i.inhrelid = a.relid AND i.inhparent = to_regclass($1)
JOIN pg_class c ON c.oid = a.relid JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE l.isleaf`

// purgeLeaf is a leaf table of a partitioned inbox table and the partition
// of the table above it (itself, unless that partition is partitioned).
type purgeLeaf struct {
	OID      int64  `db:"leaf"`
	Schema   string `db:"schema"`
	Name     string `db:"name"`
	Attached string `db:"attached"`
}

// partitionedPurgeSlices returns the slices of a purge with cutoff of a
// table whose partitions are tp and leaf tables leaves: one for each leaf
// of a range partition that starts before the cutoff, oldest first, then
// one for each leaf of the DEFAULT partition and of any other. A slice is
// the leaf's table (tableoid), so that a ctid names one row in it, and
// the bounds of its partition, by which the planner prunes the others
// when it plans (the rows outside every range partition for the DEFAULT
// one). A partition attached after the catalog was read is walked by the
// next walk, which the look for rows left at the end starts (see
// purgeBatch). A leaf under a partition partitioned by something else than
// processed_at shares its partition's bounds with its sibling leaves, whose
// indexes its batches read too.
func partitionedPurgeSlices(tp tablePartitions, leaves []purgeLeaf, cutoff int64) []string {
	type slice struct {
		start time.Time
		order int // 0: a range partition's, by start; 1: DEFAULT's; 2: another's
		cond  string
	}
	var slices []slice
	ranges := map[qualifiedName]partition{}
	// The ranges the partitions cover, those that touch merged (contiguous
	// daily or weekly partitions are one): the DEFAULT partition's slice
	// is outside all of them, and a condition for each partition took 0.1 s
	// to plan at 400 partitions, at every batch.
	type span struct{ start, end time.Time }
	var covered []span
	for _, p := range tp.ranges {
		ranges[p.name] = p
		if n := len(covered); n > 0 && !covered[n-1].end.IsZero() && !covered[n-1].end.Before(p.start) {
			if p.end.IsZero() || (!covered[n-1].end.IsZero() && p.end.After(covered[n-1].end)) {
				covered[n-1].end = p.end
			}
			continue
		}
		covered = append(covered, span{p.start, p.end})
	}
	var outside []string
	for _, c := range covered {
		var in []string
		if !c.start.IsZero() {
			in = append(in, "processed_at >= "+pgTimestampConstant(c.start.UnixMicro()))
		}
		if !c.end.IsZero() {
			in = append(in, "processed_at < "+pgTimestampConstant(c.end.UnixMicro()))
		}
		if len(in) > 0 {
			outside = append(outside, "NOT ("+strings.Join(in, " AND ")+")")
		}
	}
	for _, l := range leaves {
		top, leaf := qualifiedName{schema: l.Schema, name: l.Name}, "tableoid = "+strconv.FormatInt(l.OID, 10)
		switch p, ok := ranges[top]; {
		case ok && !p.start.IsZero() && p.start.UnixMicro() >= cutoff:
			// Not a row of it is expired.
		case ok:
			cond := leaf
			if !p.start.IsZero() {
				cond += " AND processed_at >= " + pgTimestampConstant(p.start.UnixMicro())
			}
			if !p.end.IsZero() {
				cond += " AND processed_at < " + pgTimestampConstant(p.end.UnixMicro())
			}
			slices = append(slices, slice{start: p.start, cond: cond})
		case top == tp.defaults && len(outside) > 0:
			slices = append(slices, slice{order: 1, cond: leaf + " AND " + strings.Join(outside, " AND ")})
		default:
			slices = append(slices, slice{order: 2, cond: leaf})
		}
	}
	sort.SliceStable(slices, func(i, j int) bool {
		if slices[i].order != slices[j].order {
			return slices[i].order < slices[j].order
		}
		return slices[i].start.Before(slices[j].start)
	})
	conds := make([]string, len(slices))
	for i, sl := range slices {
		conds[i] = "(" + sl.cond + ")"
	}
	return conds
}

// purgeBatch runs the next batch of a partitioned table's purge: in the
// slice it is at (the first batch reads the partitions and their leaf
// tables from the catalog and makes the slices, partitionedPurgeSlices),
// up to q.size expired rows, chosen in the primary key's order after the
// last key the slice's batch before chose (the key's index of one leaf,
// read from where the batch before stopped: each batch costs about the
// same, whatever the table's size) and deleted by ctid in that leaf (a TID
// scan; a ctid names a row in one table only, and the slice's tableoid
// keeps the others out). The statement carries the key and the bounds as
// constants, without
// bind parameters, as every purge batch. A row that another purge deletes
// meanwhile is waited for and skipped (READ COMMITTED's recheck), so two
// purges that chose the same rows delete them once; rows are not locked
// first, for the reason given on postgresDialect.purgeStatement (a WAL
// record for every row).
//
// found is the rows chosen, so that a batch that lost some of its rows to
// another purge does not end the purge while its slice holds more; a short
// batch ends its slice, and the purge goes on with the next (found is
// q.size); slices with nothing to delete are passed in the same call,
// unpaced. At the end of the walk (and again when that check failed and is
// retried) it looks for expired rows left (written expired behind the walk
// while it ran, chosen by another purge that rolled back, or in a partition
// attached meanwhile) and, if there are any, walks the table once more when
// the walk deleted rows or the catalog changed since it began; else the
// purge ends (rows that the walk's DELETEs do not remove, which a trigger or
// a row security policy keeps, walked again and again until ctx ended).
func (d postgresPartitionedDialect) purgeBatch(ctx context.Context, db dbConn, _ qualifiedName, q purgeQuery, _ *hooks) (deleted, found int64, err error) {
	w := q.walk
	if w.slices == nil {
		fresh, catalog, err := d.purgeSlices(ctx, db, w)
		if err != nil {
			return 0, 0, err
		}
		w.slices, w.catalog, w.at, w.key, w.deleted = fresh, catalog, 0, purgeKey{}, 0
	}
	for w.at < len(w.slices) {
		n, chosen, err := d.purgeSliceBatch(ctx, db, w, q.size)
		deleted += n
		switch {
		case err != nil:
			return deleted, 0, err
		case chosen >= q.size:
			return deleted, chosen, nil
		case chosen > 0 && w.at < len(w.slices):
			return deleted, q.size, nil // its slice is done: the next one
		}
		// A slice with nothing to delete: the next one in this call, not
		// paced as a batch (365 daily partitions and one expired row took
		// 4.8 s at the default DutyCycle).
	}
	// The end of the walk.
	var left int64
	if err := db.QueryRowxContext(ctx, q.remaining).Scan(&left); err != nil {
		// The batch's delete has committed: its rows count.
		return deleted, 0, fmt.Errorf("look for expired rows left: %w", err)
	}
	if left == 0 {
		return deleted, 0, nil
	}
	if w.deleted > 0 {
		w.slices = nil
		return deleted, q.size, nil
	}
	// A walk that deleted nothing walks again only where the catalog
	// changed since it began (a partition attached, a leaf dropped and made
	// again): rows that its DELETEs do not remove (a trigger or a row
	// security policy keeps them) kept it walking for ever.
	fresh, catalog, err := d.purgeSlices(ctx, db, w)
	if err != nil {
		return deleted, 0, err
	}
	if catalog == w.catalog && slices.Equal(fresh, w.slices) {
		return deleted, 0, nil
	}
	w.slices, w.catalog, w.at, w.key, w.deleted = fresh, catalog, 0, purgeKey{}, 0
	return deleted, q.size, nil
}

// purgeSlices reads w's table's partitions and leaf tables from the
// catalog, in a read-only transaction, and returns its walk's slices
// (partitionedPurgeSlices) and what tells that catalog from a later one:
// the leaves and when their partitions were attached (a partition detached
// and attached again meanwhile has the same slice).
func (d postgresPartitionedDialect) purgeSlices(ctx context.Context, db dbConn, w *partitionedPurge) ([]string, string, error) {
	var (
		tp     tablePartitions
		leaves []purgeLeaf
	)
	err := withReadTx(ctx, db, d, func(rq sqlx.QueryerContext) error {
		t, err := canonicalTable(ctx, rq, d, w.table)
		if err != nil {
			return err
		}
		if tp, err = listPartitions(ctx, rq, t); err != nil || !tp.partitioned {
			return err
		}
		return sqlx.SelectContext(ctx, rq, &leaves, pgPurgeLeavesSQL, t.quoted(d))
	})
	if err != nil || !tp.partitioned {
		return []string{"true"}, "", err // not partitioned (any more): one table, ctids its own
	}
	catalog := make([]string, len(leaves))
	for i, l := range leaves {
		catalog[i] = strconv.FormatInt(l.OID, 10) + "@" + l.Attached
	}
	sort.Strings(catalog)
	return partitionedPurgeSlices(tp, leaves, w.cutoff), strings.Join(catalog, ","), nil
}

// purgeSliceBatch runs one batch in w's slice, up to size expired rows after
// w's key, and moves w on: to the last key it chose after a full batch, to
// the next slice after a short one. It returns the rows it deleted and the
// rows it chose; on an error w stays where it was.
func (d postgresPartitionedDialect) purgeSliceBatch(ctx context.Context, db dbConn, w *partitionedPurge, size int64) (deleted, chosen int64, err error) {
	where := w.slices[w.at] + " AND " + w.expired
	if k := w.key; k.set {
		at := "timestamptz '-infinity'"
		if k.micros.Valid {
			at = pgTimestampConstant(k.micros.Int64)
		}
		where += " AND (consumer, message_id, processed_at) > (" + pgStringConstant(k.consumer) + ", " + pgStringConstant(k.messageID) + ", " + at + ")"
	}
	tq := w.table.quoted(d)
	stmt := "WITH chosen AS MATERIALIZED (SELECT ctid, consumer, message_id, processed_at FROM " + tq + " WHERE " + where +
		" ORDER BY consumer, message_id, processed_at LIMIT " + strconv.FormatInt(size, 10) + ")," +
		" deleted AS (DELETE FROM " + tq + " WHERE " + w.slices[w.at] + " AND " + w.expired +
		" AND ctid = ANY(ARRAY(SELECT ctid FROM chosen))" +
		" AND (SELECT set_config('synchronous_commit', 'off', true)) IS NOT NULL RETURNING 1)" +
		" SELECT (SELECT count(*) FROM deleted), (SELECT count(*) FROM chosen), last.consumer, last.message_id, last.micros" +
		" FROM (SELECT) AS one LEFT JOIN (SELECT consumer, message_id," +
		" CASE WHEN isfinite(processed_at) THEN (extract(epoch FROM processed_at) * 1000000)::bigint END AS micros" +
		" FROM chosen ORDER BY consumer DESC, message_id DESC, processed_at DESC LIMIT 1) AS last ON true"
	var last struct {
		consumer, messageID sql.NullString
		micros              sql.NullInt64
	}
	if err := db.QueryRowxContext(ctx, stmt).Scan(&deleted, &chosen, &last.consumer, &last.messageID, &last.micros); err != nil {
		return 0, 0, err
	}
	w.deleted += deleted
	if chosen >= size {
		w.key = purgeKey{consumer: last.consumer.String, messageID: last.messageID.String, micros: last.micros, set: true}
	} else {
		w.at, w.key = w.at+1, purgeKey{}
	}
	return deleted, chosen, nil
}

// Whole partitions: create the coming days', drop those past the window
// (checked as Purge checks it), and report the oldest partition's age.
// With a PurgeConfig.Consumer, a partition that also holds other
// consumers' rows is not dropped (their window may be longer); the
// consumer's own expired rows in it are deleted in batches, by primary key,
// as Purge does.
func (d postgresPartitionedDialect) purgeRound(ctx context.Context, db dbConn, cfg PurgeConfig, t qualifiedName) (round PurgeRound) {
	checked := time.Now() // before the source is asked: its window holds from then
	olderThan, err := checkWindow(ctx, cfg.Window, cfg.OlderThan)
	// The coming partitions, whatever the window: a window refused (a
	// topic kept for ever, a broker that cannot be reached, a retention
	// raised past OlderThan) pauses the deletes, but claims need the
	// partitions all the same, and a long-running process gets them only
	// from its rounds; they ran out after DefaultPartitionsAhead days and
	// every claim failed. None for days entirely past a window the round
	// has, which dropPartitions would drop at once (maintainedRange).
	var keepFor time.Duration
	if err == nil {
		keepFor = olderThan
	}
	schemaErr := d.maintainPartitions(ctx, db, t, keepFor, cfg.nextRound)
	if err != nil {
		round.Err = errors.Join(fmt.Errorf("inbox: purge %s: %w", t, err), schemaErr)
		return round
	}
	round.Window = olderThan
	if round.Err = schemaErr; round.Err != nil {
		return round
	}
	dropped, err := dropPartitions(ctx, db, t, olderThan, checked, cfg.Consumer)
	for _, p := range dropped {
		round.Deleted += p.Rows
		round.DroppedPartitions = append(round.DroppedPartitions, p.Name)
	}
	if round.Err = err; err != nil {
		return round
	}
	if cfg.Consumer != "" {
		cfg.OlderThan, cfg.Window, cfg.Dialect, cfg.windowChecked = olderThan, nil, d, checked
		n, err := purge(ctx, db, cfg)
		round.Deleted += n
		if round.Err = err; err != nil {
			return round
		}
	}
	err = d.readTx(ctx, db, func(q sqlx.QueryerContext) (err error) {
		if round.OldestAge, err = oldestPartitionAge(ctx, q, t, cfg.Consumer); err != nil || cfg.Consumer == "" {
			round.TableOldestAge = round.OldestAge
			return err
		}
		round.TableOldestAge, err = oldestPartitionAge(ctx, q, t, "")
		return err
	})
	if err != nil {
		round.OldestAge, round.TableOldestAge = 0, 0
		round.Err = fmt.Errorf("inbox: oldest row age of %s: %w", t, err)
	}
	return round
}
