package inbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jmoiron/sqlx"
)

// DefaultPartitionsAhead is how many days after today InitializeSchema and
// a Purger keep covered by partitions of a PostgreSQLPartitioned table (at
// the table's PartitionInterval, so with weekly partitions up to the end of
// the week that holds the 7th day).
const DefaultPartitionsAhead = 7

// PartitionInterval is the span of processed_at one partition of a
// PostgreSQLPartitioned table covers. It is a property of the table, read
// from its newest partition's bounds in the catalog (never from a name): one
// UTC day, or one week starting on a Monday, 00:00 UTC. The library names
// them "<table>_pYYYYMMDD" and "<table>_wYYYYMMDD". A table whose newest
// partition is neither (made by hand or by another tool), or that has no
// partitions, gets DefaultPartitionInterval from InitializeSchema, a Purger
// or CreatePartitions (only for ranges no partition covers), or the
// interval given to InitializePartitions.
// Only MigratePartitionInterval changes the interval of a table that has
// partitions; every other call refuses to mix intervals.
//
// The claim probes the primary key of every partition, so its cost grows
// with the number of partitions: a window of W days needs about W/7 + 2
// weekly partitions, W + 8 daily ones.
type PartitionInterval string

const (
	// PartitionDay is one partition per UTC day.
	PartitionDay PartitionInterval = "day"
	// PartitionWeek is one partition per ISO week, Monday 00:00 UTC to the
	// next Monday.
	PartitionWeek PartitionInterval = "week"
)

// DefaultPartitionInterval is the interval a PostgreSQLPartitioned table
// without partitions gets: weekly, so that Kafka's default window (7 days'
// retention + 7 days' segments + a day's margin = 15 days) needs 4 or 5
// partitions, not 24.
const DefaultPartitionInterval = PartitionWeek

// ParsePartitionInterval returns the PartitionInterval named s ("day" or
// "week"), or an error wrapping ErrInvalidConfig.
func ParsePartitionInterval(s string) (PartitionInterval, error) {
	switch iv := PartitionInterval(s); iv {
	case PartitionDay, PartitionWeek:
		return iv, nil
	}
	return "", fmt.Errorf("%w: partition interval %q (day or week)", ErrInvalidConfig, s)
}

const oneDay = 24 * time.Hour

// slot returns the partition of interval iv that holds instant x: its first
// instant and the first instant after it, UTC.
func (iv PartitionInterval) slot(x time.Time) (start, end time.Time) {
	start = x.UTC().Truncate(oneDay)
	if iv == PartitionWeek {
		start = start.AddDate(0, 0, -((int(start.Weekday()) + 6) % 7)) // back to Monday
		return start, start.AddDate(0, 0, 7)
	}
	return start, start.AddDate(0, 0, 1)
}

// letter is the partition name's kind letter: p for days (unchanged since
// daily partitions were the only kind), w for weeks.
func (iv PartitionInterval) letter() string {
	if iv == PartitionWeek {
		return "w"
	}
	return "p"
}

// partitionName returns the partition of t of interval iv that starts at
// start (UTC), or an error when the name would pass PostgreSQL's 63-byte
// identifier limit.
func partitionName(t qualifiedName, iv PartitionInterval, start time.Time) (qualifiedName, error) {
	const suffix = len("_p20060102")
	if len(t.name)+suffix > 63 {
		return qualifiedName{}, fmt.Errorf("%w: %q is too long for a partitioned table (at most %d bytes)",
			ErrInvalidTableName, t.name, 63-suffix)
	}
	return qualifiedName{schema: t.schema, name: t.name + "_" + iv.letter() + start.UTC().Format("20060102")}, nil
}

// CreatePartitions creates, for a PostgreSQLPartitioned inbox table, the
// partitions that cover from's UTC day and the days-1 days after it, at the
// table's PartitionInterval (DefaultPartitionInterval, weekly, when it has
// none), skipping the ranges that existing partitions cover; a range the
// table's interval cannot fill because an older partition overlaps it (after
// MigratePartitionInterval) is filled with daily partitions. Each is created
// as a plain table and then attached, which locks the parent only in SHARE
// UPDATE EXCLUSIVE mode, so running handlers and claims are not blocked
// (CREATE TABLE ... PARTITION OF would take ACCESS EXCLUSIVE). It is safe to
// run from several processes at once (serialised by an advisory lock) and
// waits at most 10 s for a lock (lock_timeout), failing rather than stalling
// traffic. days must be between 1 and 3660 (else an error wrapping
// ErrInvalidConfig). InitializeSchema and a Purger call it; call it yourself
// only if you run neither.
func CreatePartitions(ctx context.Context, db *sqlx.DB, table string, from time.Time, days int) error {
	t, err := parseTableName(table)
	if err != nil {
		return err
	}
	if days < 1 || days > 3660 {
		return fmt.Errorf("%w: days must be between 1 and 3660, got %d", ErrInvalidConfig, days)
	}
	start := from.UTC().Truncate(oneDay)
	return createPartitions(ctx, db, t, "", false, start, start.AddDate(0, 0, days))
}

// InitializePartitions creates the PostgreSQLPartitioned inbox table named
// table if it does not exist (as InitializeSchema does) and the partitions
// of interval that cover yesterday to DefaultPartitionsAhead days after today
// (UTC, by the database clock): the way to give a new table an interval other
// than DefaultPartitionInterval. Call it before InitializeSchema, which then
// follows the table's interval (the CLI: inbox partitions -interval day).
// On a table whose partitions already have another interval it creates
// nothing and returns an error wrapping ErrIncompatibleTable (switch with
// MigratePartitionInterval); an unknown interval is an error wrapping
// ErrInvalidConfig. Safe to run concurrently, like CreatePartitions.
func InitializePartitions(ctx context.Context, db *sqlx.DB, table string, interval PartitionInterval) error {
	t, err := parseTableName(table)
	if err != nil {
		return err
	}
	if _, err := ParsePartitionInterval(string(interval)); err != nil {
		return err
	}
	d := postgresPartitionedDialect{}
	if err := d.createSchema(ctx, db, t, 0); err != nil {
		return err
	}
	from, until, err := maintainedRange(ctx, db, t, 0, 0)
	if err != nil {
		return err
	}
	return createPartitions(ctx, db, t, interval, false, from, until)
}

// MigratePartitionInterval switches a PostgreSQLPartitioned table to
// partitions of interval to: after its newest partition it creates daily
// partitions up to the next start of a partition of to (none when the
// newest ends on one), then one partition of to. From then on
// InitializeSchema, a Purger and CreatePartitions create partitions of to.
// The existing partitions stay; DropPartitions drops each once its own range
// is past the window, so the old interval ages out within one window and no
// row moves. Claims keep deduplicating across all of them, whatever their
// interval. Nothing happens when the newest partition already is of to; on a
// table with no partitions it does what InitializePartitions does. An
// unknown interval is an error wrapping ErrInvalidConfig. Safe to run
// concurrently, like CreatePartitions, and with live traffic.
func MigratePartitionInterval(ctx context.Context, db *sqlx.DB, table string, to PartitionInterval) error {
	t, err := parseTableName(table)
	if err != nil {
		return err
	}
	if _, err := ParsePartitionInterval(string(to)); err != nil {
		return err
	}
	from, until, err := maintainedRange(ctx, db, t, 0, 0)
	if err != nil {
		return err
	}
	return createPartitions(ctx, db, t, to, true, from, until)
}

// TablePartitionInterval returns the PartitionInterval of the
// PostgreSQLPartitioned table named table: that of its newest partition, by
// the partition's bounds in the catalog (not its name), and "" when it has
// no partitions or its newest partition is not exactly one UTC day or one
// ISO week (a partition made by hand or by another tool, such as
// pg_partman's monthly ones). Errors wrap the driver's error, or
// ErrInvalidTableName.
func TablePartitionInterval(ctx context.Context, db *sqlx.DB, table string) (PartitionInterval, error) {
	t, err := parseTableName(table)
	if err != nil {
		return "", err
	}
	var iv PartitionInterval
	err = withReadTx(ctx, db, PostgreSQLPartitioned, func(q sqlx.QueryerContext) error {
		t, err := canonicalTable(ctx, q, PostgreSQLPartitioned, t)
		if err != nil {
			return err
		}
		tp, err := listPartitions(ctx, q, t)
		if newest, ok := tp.newest(); ok {
			iv = newest.interval
		}
		return err
	})
	if err != nil {
		return "", fmt.Errorf("inbox: partition interval of %s: %w", t, err)
	}
	return iv, nil
}

// pgNowMicros is PostgreSQL's clock as Unix microseconds: read so rather
// than as a timestamptz, which pgx's exec and simple_protocol modes (those
// a pooler needs) parse from its text, and only DateStyle ISO gives text
// they can parse.
const pgNowMicros = "CAST(EXTRACT(EPOCH FROM now()) * 1000000 AS bigint)"

// maintainedRange returns the range InitializeSchema and a Purger keep
// covered: from the start of yesterday to the end of the
// DefaultPartitionsAhead-th day after today, by the database clock (UTC).
// With a window (a Purger round's; 0 for none) the range starts no earlier
// than the day the window's cutoff falls on: a window shorter than a day
// has all of yesterday past it, and a round that made yesterday's
// partition again dropped it at once, every round, each DETACH ...
// CONCURRENTLY waiting for every transaction older than it (one left open
// failed every round, with nothing to purge).
func maintainedRange(ctx context.Context, db sqlx.QueryerContext, t qualifiedName, window, nextRound time.Duration) (from, until time.Time, err error) {
	// pgNowMicros: a role or server with DateStyle 'SQL, DMY' failed every
	// Purger round here, and the claims once the partitions ran out.
	var nowMicros int64
	if err := sqlx.GetContext(ctx, db, &nowMicros, "SELECT "+pgNowMicros); err != nil {
		return from, until, fmt.Errorf("inbox: create partitions of %s: %w", t, err)
	}
	now := time.UnixMicro(nowMicros).UTC()
	from = now.Truncate(oneDay).AddDate(0, 0, -1)
	until = from.AddDate(0, 0, DefaultPartitionsAhead+2)
	// A Purger whose rounds are further apart than that: until the day
	// after its next round, and the one after (a round may fail), so that
	// the claims never run out of partitions in between.
	if need := now.Add(2*nextRound).Truncate(oneDay).AddDate(0, 0, 2); need.After(until) {
		until = need
	}
	if window > 0 {
		if cutoffDay := now.Add(-window).Truncate(oneDay); cutoffDay.After(from) {
			from = cutoffDay
		}
	}
	return from, until, nil
}

// dbConn is what partition management needs: a pool or one connection.
type dbConn interface {
	sqlx.ExecerContext
	sqlx.QueryerContext
	BeginTxx(ctx context.Context, opts *sql.TxOptions) (*sqlx.Tx, error)
}

// createPartitions covers [from, until) with partitions of t, under the
// schema lock. want "" follows the table's interval (the default for a
// table without partitions); otherwise a table of another interval is
// refused, unless migrate, which starts want after the newest partition.
func createPartitions(ctx context.Context, db dbConn, t qualifiedName, want PartitionInterval, migrate bool, from, until time.Time) error {
	d := PostgreSQLPartitioned
	tx, err := db.BeginTxx(ctx, nil)
	if err != nil {
		return fmt.Errorf("inbox: create partitions of %s: %w", t, err)
	}
	defer tx.Rollback() //nolint:errcheck // no-op after Commit
	// Partitions go into the parent's schema, whatever search_path says,
	// and the lock is keyed by the resolved name.
	if t, err = canonicalTable(ctx, tx, d, t); err != nil {
		return fmt.Errorf("inbox: create partitions: %w", err)
	}
	for _, stmt := range []string{"SET LOCAL lock_timeout = '10s'", "SELECT pg_advisory_xact_lock($1)"} {
		args := []any{}
		if strings.Contains(stmt, "$1") {
			args = append(args, schemaLockKey(t))
		}
		if _, err := tx.ExecContext(ctx, stmt, args...); err != nil {
			return fmt.Errorf("inbox: create partitions of %s: %w", t, err)
		}
	}
	tp, err := listPartitions(ctx, tx, t)
	if err == nil {
		err = tp.check(t)
	}
	if err != nil {
		return fmt.Errorf("inbox: create partitions of %s: %w", t, err)
	}
	parts := tp.ranges
	iv := DefaultPartitionInterval
	if want != "" {
		iv = want
	}
	if newest, ok := tp.newest(); ok {
		switch {
		case newest.interval == "":
			// A range made by hand or by another tool: its interval says
			// nothing about ours; only the ranges no partition covers are
			// filled below.
		case want == "" || newest.interval == want:
			iv = newest.interval
		case migrate && newest.end.IsZero():
			// Unbounded above: there is nothing to create after it.
		case migrate:
			// Daily partitions up to the first boundary of want at or
			// after the newest partition's end, then one of want.
			from = newest.end
			if s, e := want.slot(from); s.Equal(from) {
				until = e
			} else {
				until = e.Add(time.Microsecond)
			}
		default:
			return fmt.Errorf("%w: %s is partitioned by %s (newest partition %s), not by %s; partition intervals are"+
				" never mixed: switch with inbox.MigratePartitionInterval (inbox partitions -interval %s -migrate), or keep %s",
				ErrIncompatibleTable, t, newest.interval, newest.name, want, want, newest.interval)
		}
	}
	for x := from; x.Before(until); {
		if p, ok := covering(parts, x); ok {
			if p.end.IsZero() {
				break // MAXVALUE: everything after x is covered
			}
			x = p.end
			continue
		}
		piv := iv
		start, end := iv.slot(x)
		if overlapping(parts, start, end) {
			piv = PartitionDay
			start, end = PartitionDay.slot(x)
		}
		// Partitions made otherwise need not fall on whole days: the new
		// one fills only the free range around x.
		start, end = freeRange(parts, x, start, end)
		p, err := attachFreeName(ctx, tx, t, piv, start, end)
		if err != nil {
			return err
		}
		parts = append(parts, partition{name: p, start: start, end: end, interval: piv})
		sort.Slice(parts, func(i, j int) bool { return parts[i].start.Before(parts[j].start) })
		x = end
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("inbox: create partitions of %s: commit: %w", t, err)
	}
	return nil
}

// attachFreeName attaches a partition of t for [start, end) under the
// library's name for it (partitionName), or, when a table of that name is
// there already and is not one an interrupted DropPartitions left (a
// partition of another range: renamed by an operator, made by hand under
// that name, or the first of two free ranges of one day around a
// partition made by hand), under that name with "_2" to "_9" appended,
// the first that is free (with the year in two digits when the table's
// name is too long for that: "<table>_p261208_2"). It returned ErrIncompatibleTable before, in
// every round, and no partition was created for any day any more. Names go
// by nothing else: the catalog's bounds are what counts (see
// DropPartitions).
func attachFreeName(ctx context.Context, tx *sqlx.Tx, t qualifiedName, iv PartitionInterval, start, end time.Time) (qualifiedName, error) {
	p, err := partitionName(t, iv, start)
	if err != nil {
		return qualifiedName{}, err
	}
	taken := []string{}
	for n := 1; ; n++ {
		candidate := p
		if n > 1 {
			candidate.name = p.name + "_" + strconv.Itoa(n)
			if len(candidate.name) > 63 {
				// A table name of 52 or 53 bytes: the year in two digits
				// leaves room (PostgreSQL would cut the name at 63 bytes).
				candidate.name = t.name + "_" + iv.letter() + start.UTC().Format("060102") + "_" + strconv.Itoa(n)
			}
		}
		err := attachPartition(ctx, tx, t, candidate, start, end)
		if !errors.Is(err, errPartitionNameTaken) {
			return candidate, err
		}
		taken = append(taken, candidate.name)
		if n == 9 {
			return qualifiedName{}, fmt.Errorf("%w: inbox: create partition of %s for [%s, %s): the tables %s exist and"+
				" none is a partition of %s for that range; rename or drop one of them", ErrIncompatibleTable, t,
				markBound(start), markBound(end), strings.Join(taken, ", "), t)
		}
	}
}

// errPartitionNameTaken is attachPartition's error for a name another
// table has.
var errPartitionNameTaken = errors.New("partition name taken")

// attachPartition creates p as a plain table, or takes the table of that
// name that an interrupted DropPartitions left detached (marked with
// detachedPartitionComment), and attaches it to t for [start, end). Another
// table of that name is errPartitionNameTaken, and nothing is changed.
func attachPartition(ctx context.Context, tx *sqlx.Tx, t, p qualifiedName, start, end time.Time) error {
	d := PostgreSQLPartitioned
	// Bounds are formatted by us from a time.Time, never user input.
	lo, hi := start.Format("2006-01-02 15:04:05.999999Z07:00"), end.Format("2006-01-02 15:04:05.999999Z07:00")
	var kind struct {
		Exists   bool `db:"exists"`
		Detached bool `db:"detached"`
	}
	err := sqlx.GetContext(ctx, tx, &kind, `SELECT c.oid IS NOT NULL AS exists,
		COALESCE(c.relkind IN ('r', 'p') AND NOT c.relispartition AND NOT EXISTS (SELECT 1 FROM pg_inherits WHERE inhrelid = c.oid)
			AND `+markedFor("c", "$2", "$3")+`, false) AS detached
		FROM (SELECT to_regclass($1) AS oid) r LEFT JOIN pg_class c ON c.oid = r.oid`, p.quoted(d), t.quoted(d), detachedMarkPattern(t))
	if err != nil {
		return fmt.Errorf("inbox: create partition %s: %w", p, err)
	}
	create := "CREATE TABLE " + p.quoted(d) + " (LIKE " + t.quoted(d) + " INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING GENERATED)"
	switch {
	case kind.Detached:
		// Left detached by a DropPartitions interrupted before its DROP
		// (its range is one maintainedRange covers again: yesterday's,
		// with a window under a day): CREATE failed with 42P07 in every
		// round and InitializeSchema, and no partition ahead was made any
		// more. It is attached again (its rows checked against the range),
		// and the round's DropPartitions drops it once past the window.
		// One that cannot be (a column added to the table since, 42804)
		// is left as it is, its range without a partition: it lies in the
		// past, which no claim's clock reaches again, and DropPartitions
		// drops the table once past the window.
		if _, err := tx.ExecContext(ctx, "SAVEPOINT inbox_reattach"); err != nil {
			return fmt.Errorf("inbox: attach partition %s again: %w", p, err)
		}
		err := attachStatements(ctx, tx, t, p, lo, hi, "", "COMMENT ON TABLE "+p.quoted(d)+" IS NULL")
		if err == nil {
			err = dropDetachChecks(ctx, tx, p)
		}
		if err != nil {
			if _, rerr := tx.ExecContext(ctx, "ROLLBACK TO SAVEPOINT inbox_reattach"); rerr != nil {
				return fmt.Errorf("inbox: attach partition %s again: %w (and roll back to its savepoint: %w)", p, err, rerr)
			}
		}
		_, err = tx.ExecContext(ctx, "RELEASE SAVEPOINT inbox_reattach")
		return err
	case kind.Exists:
		return errPartitionNameTaken
	}
	return attachStatements(ctx, tx, t, p, lo, hi, create, "")
}

// dropDetachChecks drops the CHECK constraints of p, attached again, that
// are its own (not inherited): DETACH PARTITION ... CONCURRENTLY adds one
// that copies the partition's bound, which Verify then refused as a CHECK
// on a partition, and the router did not start.
func dropDetachChecks(ctx context.Context, tx *sqlx.Tx, p qualifiedName) error {
	d := PostgreSQLPartitioned
	var names []string
	if err := sqlx.SelectContext(ctx, tx, &names, `SELECT conname::text FROM pg_constraint
		WHERE conrelid = to_regclass($1) AND contype = 'c' AND conislocal AND coninhcount = 0`, p.quoted(d)); err != nil {
		return err
	}
	for _, name := range names {
		if _, err := tx.ExecContext(ctx, "ALTER TABLE "+p.quoted(d)+" DROP CONSTRAINT "+d.quote(name)); err != nil {
			return err
		}
	}
	return nil
}

// attachStatements runs create (unless "") and then attaches p to t for
// [lo, hi), then runs after (unless "").
func attachStatements(ctx context.Context, tx *sqlx.Tx, t, p qualifiedName, lo, hi, create, after string) error {
	d := PostgreSQLPartitioned
	for _, stmt := range []string{
		create,
		// The CHECK lets ATTACH skip its validation scan.
		"ALTER TABLE " + p.quoted(d) + " ADD CONSTRAINT " + d.quote(p.name+"_range") +
			" CHECK (processed_at >= '" + lo + "' AND processed_at < '" + hi + "')",
		"ALTER TABLE " + t.quoted(d) + " ATTACH PARTITION " + p.quoted(d) +
			" FOR VALUES FROM ('" + lo + "') TO ('" + hi + "')",
		"ALTER TABLE " + p.quoted(d) + " DROP CONSTRAINT " + d.quote(p.name+"_range"),
		after,
	} {
		if stmt == "" {
			continue
		}
		if _, err := tx.ExecContext(ctx, stmt); err != nil {
			return fmt.Errorf("inbox: create partition %s: %w", p, err)
		}
	}
	return nil
}

// freeRange returns [start, end) narrowed to the range around x that no
// partition covers (x itself is not covered).
func freeRange(parts []partition, x, start, end time.Time) (time.Time, time.Time) {
	for _, p := range parts {
		if !p.end.IsZero() && !p.end.After(x) && p.end.After(start) {
			start = p.end
		}
		if p.start.After(x) && p.start.Before(end) {
			end = p.start
		}
	}
	return start, end
}

// covering returns the partition whose range holds x.
func covering(parts []partition, x time.Time) (partition, bool) {
	for _, p := range parts {
		if !x.Before(p.start) && (p.end.IsZero() || x.Before(p.end)) {
			return p, true
		}
	}
	return partition{}, false
}

// overlapping reports whether a partition's range meets [start, end).
func overlapping(parts []partition, start, end time.Time) bool {
	for _, p := range parts {
		if p.start.Before(end) && (p.end.IsZero() || start.Before(p.end)) {
			return true
		}
	}
	return false
}

// DroppedPartition is one partition DropPartitions removed.
type DroppedPartition struct {
	Name string // schema-qualified when the table is
	Rows int64  // rows it held
}

// DropPartitions removes, from a PostgreSQLPartitioned inbox table, every
// partition whose upper bound, as the catalog holds it (never as its name
// suggests), is at least olderThan ago by the database clock, whoever made
// it, and returns them. A partition unbounded above is never dropped. A
// table with a DEFAULT partition, with partitions that are not ranges of
// processed_at, or that is not partitioned, is refused with an error
// wrapping ErrIncompatibleTable that says how to fix it (see
// docs/purge.md); nothing is dropped then. Each is first detached with DETACH
// PARTITION ... CONCURRENTLY (PostgreSQL 14+), which waits for transactions
// that use it without blocking new claims, then counted and dropped. With a
// window, like PurgeConfig.Window, a shorter olderThan is refused with
// ErrWindowTooShort. olderThan must be positive even with a window (unlike
// PurgeConfig.OlderThan, 0 does not mean "the safe window"); a
// non-positive olderThan is an error wrapping ErrInvalidConfig, a bad table
// name one wrapping ErrInvalidTableName. When ctx ends or a step fails it returns what it
// dropped so far with the error; a partition left detached by an
// interruption (each is marked with a comment before its DETACH) is dropped
// by the next call, once none of its rows is inside the window. A table
// detached by anyone else is never dropped, whatever its name.
//
// It is safe to run from several processes at once, and alongside Purger
// rounds, also behind a transaction-mode pooler: it takes the Purger's lock
// (a transaction-scoped advisory lock keyed by the table, in a transaction
// held open for the call; see Purger), waiting for a call or round that
// holds it, and then finds the partitions afresh, so a partition another
// call dropped is neither dropped again nor counted twice. Its cutoff is
// the database's time when it checked the window, less olderThan, however
// long it waits for that lock. It needs two
// connections of db (a pool limited to one is refused with
// ErrInvalidConfig).
func DropPartitions(ctx context.Context, db *sqlx.DB, table string, olderThan time.Duration, window WindowSource) (dropped []DroppedPartition, err error) {
	t, err := parseTableName(table)
	if err != nil {
		return nil, err
	}
	if olderThan <= 0 {
		return nil, fmt.Errorf("%w: olderThan must be positive, got %v", ErrInvalidConfig, olderThan)
	}
	// The cutoff is the database's time at the check less olderThan,
	// however long the lock takes (another instance's round holds it): a
	// cutoff read once the lock was granted moved forward with the wait,
	// past a window the source may have raised meanwhile.
	checked := time.Now() // before the source is asked: its window holds from then
	if _, err := checkWindow(ctx, window, olderThan); err != nil {
		return nil, fmt.Errorf("inbox: drop partitions of %s: %w", t, err)
	}
	lease, got, err := acquirePurgeLock(ctx, db, PostgreSQLPartitioned, t, true)
	if err == nil && !got {
		err = errors.New("not granted") // cannot happen: it waits
	}
	if err != nil {
		return nil, fmt.Errorf("inbox: drop partitions of %s: lock: %w", t, err)
	}
	defer func() {
		if rerr := lease.release(); rerr != nil && err == nil {
			err = fmt.Errorf("inbox: drop partitions of %s: lock: %w", t, rerr)
		}
	}()
	return dropPartitions(ctx, lease.work, t, olderThan, checked, "")
}

// dropPartitions drops the partitions of t whose upper bound (from the
// catalog) is at or before the cutoff olderThan ago (and, when checked is
// not zero, the time since the window was checked then: see purgeCutoff),
// under the purge lock,
// and the partitions an interrupted call left detached once all their rows
// are past it. With a consumer, a partition that holds a row of another
// consumer is kept: those rows may have a longer window (their own
// consumer's purge deletes them). Its reads with arguments run in short
// transactions (withReadTx), so that they work behind a transaction-mode
// pooler with lib/pq; DETACH PARTITION CONCURRENTLY cannot run in a
// transaction block at all.
func dropPartitions(ctx context.Context, db dbConn, t qualifiedName, olderThan time.Duration, checked time.Time, consumer string) ([]DroppedPartition, error) {
	d := PostgreSQLPartitioned
	var cutoffMicros int64 // pgNowMicros, whatever the DateStyle
	var tp tablePartitions
	var detached []detachedTable
	err := withReadTx(ctx, db, d, func(q sqlx.QueryerContext) (err error) {
		if t, err = canonicalTable(ctx, q, d, t); err != nil {
			return err
		}
		if err := sqlx.GetContext(ctx, q, &cutoffMicros, "SELECT "+pgNowMicros+" - $1", olderThan.Microseconds()); err != nil {
			return err
		}
		if tp, err = listPartitions(ctx, q, t); err != nil {
			return err
		}
		if err := tp.check(t); err != nil {
			return err
		}
		detached, err = detachedPartitions(ctx, q, t)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("inbox: drop partitions of %s: %w", t, err)
	}
	if !checked.IsZero() {
		cutoffMicros -= time.Since(checked).Microseconds() // after the read: at or before the check's cutoff
	}
	cutoff := time.UnixMicro(cutoffMicros).UTC()
	var dropped []DroppedPartition
	drop := func(p qualifiedName) error {
		var rows int64
		if err := sqlx.GetContext(ctx, db, &rows, "SELECT count(*) FROM "+p.quoted(d)); err != nil {
			return fmt.Errorf("inbox: drop partition %s: count: %w", p, err)
		}
		if _, err := db.ExecContext(ctx, "DROP TABLE "+p.quoted(d)); err != nil {
			return fmt.Errorf("inbox: drop partition %s: %w", p, err)
		}
		dropped = append(dropped, DroppedPartition{Name: p.String(), Rows: rows})
		return nil
	}
	for _, part := range tp.ranges {
		if part.end.IsZero() || part.end.After(cutoff) {
			if part.pending {
				// A DETACH interrupted half way while the partition was
				// past the window, which has grown since: its rows are
				// inside it again, and a pending partition's rows are not
				// seen through t (duplicates of them would be processed
				// again). Attached back.
				if err := reattachPending(ctx, db, t, part); err != nil {
					return dropped, err
				}
			}
			continue // not entirely past the window (or unbounded above)
		}
		p := part.name
		if keep, err := holdsOtherConsumers(ctx, db, p, consumer); err != nil || keep {
			if err != nil {
				return dropped, fmt.Errorf("inbox: drop partition %s: %w", p, err)
			}
			if part.pending {
				// A DETACH of ours that stopped waiting half way (a claim
				// of another consumer wrote here after the look and held
				// it): finished and attached back. Left pending, its rows
				// were unseen by claims, and every later DETACH of the
				// table failed (one pending detach at a time, 55000).
				if err := reattachPending(ctx, db, t, part); err != nil {
					return dropped, err
				}
			}
			continue
		}
		detach := " CONCURRENTLY"
		if part.pending {
			detach = " FINALIZE"
		}
		// Marked first, so that a call interrupted between the DETACH and
		// the DROP leaves a table the next call knows for its own.
		var mark string // quoted by the server: t's schema is the catalog's
		if err := withReadTx(ctx, db, d, func(q sqlx.QueryerContext) error {
			return sqlx.GetContext(ctx, q, &mark, "SELECT quote_literal($1)", detachedMark(t, part.start, part.end))
		}); err != nil {
			return dropped, fmt.Errorf("inbox: mark partition %s for its drop: %w", p, err)
		}
		if _, err := db.ExecContext(ctx, "COMMENT ON TABLE "+p.quoted(d)+" IS "+mark); err != nil {
			return dropped, fmt.Errorf("inbox: mark partition %s for its drop: %w", p, err)
		}
		if err := detachPartition(ctx, db, t, p, detach); err != nil {
			return dropped, err
		}
		if consumer != "" {
			// The look's lock ends with its transaction: a claim of another
			// consumer whose transaction began inside the partition's range
			// and that waited (on its key's lock, behind a delivery the look
			// waited for) wrote its row after the look, the DETACH waited
			// for it to commit, and the partition was dropped with it. The
			// DETACH waited for every transaction writing to the partition,
			// so this look sees them all.
			keep, err := holdsOtherConsumers(ctx, db, p, consumer)
			if err != nil {
				// Left detached and marked: the next round looks again.
				return dropped, fmt.Errorf("inbox: drop partition %s: %w", p, err)
			}
			if keep {
				if err := attachBack(ctx, db, t, p, part.start, part.end); err != nil {
					return dropped, err
				}
				continue
			}
		}
		if err := drop(p); err != nil {
			return dropped, err
		}
	}
	var detachedErr error
	for _, left := range detached {
		// Left detached by an interrupted call: the catalog no longer
		// holds its range, so its rows decide.
		p := left.name
		var recent int64
		err := withReadTx(ctx, db, d, func(q sqlx.QueryerContext) error {
			return sqlx.GetContext(ctx, q, &recent,
				"SELECT count(*) FROM "+p.quoted(d)+" WHERE processed_at >= $1", cutoff)
		})
		if err != nil {
			return dropped, fmt.Errorf("inbox: drop detached partition %s: %w", p, err)
		}
		if recent > 0 {
			// Past the window when it was detached; the window has grown
			// since, and its rows are not seen through t (duplicates of
			// them would be processed again): attached back.
			detachedErr = errors.Join(detachedErr, reattachDetached(ctx, db, t, left))
			continue
		}
		if keep, err := holdsOtherConsumers(ctx, db, p, consumer); err != nil || keep {
			if err != nil {
				return dropped, fmt.Errorf("inbox: drop detached partition %s: %w", p, err)
			}
			// Another consumer's rows, whose window may be longer: seen
			// through t again (they were left detached, unseen by claims).
			detachedErr = errors.Join(detachedErr, reattachDetached(ctx, db, t, left))
			continue
		}
		if err := drop(p); err != nil {
			return dropped, err
		}
	}
	return dropped, detachedErr
}

// detachPartition runs ALTER TABLE t DETACH PARTITION p with how
// (" CONCURRENTLY" or " FINALIZE"). It waits for every transaction that
// started before it, and one left open (idle in transaction, a stuck
// report) would hold the round, and with it the purge lock, for as long:
// no round of any instance would run, and none would create the coming
// partitions. Bounded by detachWait, the DETACH is cancelled half way
// (pending), the error says why, and the next round finishes it
// (FINALIZE).
func detachPartition(ctx context.Context, db dbConn, t, p qualifiedName, how string) error {
	d := PostgreSQLPartitioned
	wait := time.Duration(detachWait.Load())
	dctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	_, err := db.ExecContext(dctx, "ALTER TABLE "+t.quoted(d)+" DETACH PARTITION "+p.quoted(d)+how)
	switch {
	case err != nil && dctx.Err() != nil && ctx.Err() == nil:
		return fmt.Errorf("inbox: detach partition %s: waited %v for the transactions that started before the"+
			" DETACH (one left open that read %s? see pg_stat_activity's xact_start): the next round finishes it: %w",
			p, wait, t, err)
	case err != nil:
		return fmt.Errorf("inbox: detach partition %s: %w", p, err)
	}
	return nil
}

// reattachPending finishes the DETACH of part, a partition a round of ours
// left pending (interrupted half way; marked with detachedPartitionComment)
// that is no longer entirely past the window, and
// attaches its table back to t for its range, under the schema lock as
// createPartitions does. A failure is the round's error: its rows stay
// unseen until a round attaches it.
func reattachPending(ctx context.Context, db dbConn, t qualifiedName, part partition) error {
	d := PostgreSQLPartitioned
	var ours bool
	err := withReadTx(ctx, db, d, func(q sqlx.QueryerContext) error {
		return sqlx.GetContext(ctx, q, &ours, "SELECT COALESCE((SELECT "+markedFor("c", "$2", "$3")+
			" FROM pg_class c WHERE c.oid = to_regclass($1)), false)", part.name.quoted(d), t.quoted(d), detachedMarkPattern(t))
	})
	if err != nil {
		return fmt.Errorf("inbox: attach partition %s again: %w", part.name, err)
	}
	if !ours {
		return nil // a DETACH someone else began: theirs to finish
	}
	if err := detachPartition(ctx, db, t, part.name, " FINALIZE"); err != nil {
		return err
	}
	return attachBack(ctx, db, t, part.name, part.start, part.end)
}

// reattachDetached attaches back left, a table an interrupted
// DropPartitions detached whole (its DETACH went on on the server after the
// round stopped waiting), that holds rows inside the window (grown since)
// or another consumer's: for the range its mark holds, or, marked by an
// earlier version without it, for the slot of its interval (its name's
// kind letter) holding its oldest row, which must hold its newest too.
// PostgreSQL checks every row against the range. A table whose range
// cannot be told (an earlier version's mark on a name not of the library)
// is ErrIncompatibleTable, with the statements that attach it by hand.
func reattachDetached(ctx context.Context, db dbConn, t qualifiedName, left detachedTable) error {
	d := PostgreSQLPartitioned
	p := left.name
	if left.ranged {
		return attachBack(ctx, db, t, p, left.start, left.end)
	}
	var oldest, newest sql.NullTime
	err := withReadTx(ctx, db, d, func(q sqlx.QueryerContext) error {
		return q.QueryRowxContext(ctx, "SELECT min(processed_at), max(processed_at) FROM "+p.quoted(d)).Scan(&oldest, &newest)
	})
	if err != nil {
		return fmt.Errorf("inbox: attach partition %s again: %w", p, err)
	}
	var iv PartitionInterval
	switch {
	case libraryPartitionName(t, p, PartitionDay):
		iv = PartitionDay
	case libraryPartitionName(t, p, PartitionWeek):
		iv = PartitionWeek
	}
	var start, end time.Time
	if iv != "" {
		start, end = iv.slot(oldest.Time)
	}
	if iv == "" || !oldest.Valid || !newest.Time.Before(end) {
		return fmt.Errorf("%w: %s was detached by an interrupted DropPartitions and holds rows inside the window (it has grown"+
			" since) or another consumer's, which claims do not see, but its range cannot be told from its mark or its name"+
			" (one day or week holding them all): attach it back to %s by hand (ALTER TABLE %s ATTACH"+
			" PARTITION %s FOR VALUES FROM (…) TO (…); COMMENT ON TABLE %s IS NULL)",
			ErrIncompatibleTable, p, t, t.quoted(d), p.quoted(d), p.quoted(d))
	}
	return attachBack(ctx, db, t, p, start, end)
}

// libraryPartitionName reports whether p is named as the library names t's
// partitions of interval iv ("<table>_pYYYYMMDD", "<table>_wYYYYMMDD").
func libraryPartitionName(t, p qualifiedName, iv PartitionInterval) bool {
	rest, ok := strings.CutPrefix(p.name, t.name+"_"+iv.letter())
	if !ok || len(rest) != len("20060102") {
		return false
	}
	_, err := time.Parse("20060102", rest)
	return err == nil
}

// attachBack attaches p, a table DropPartitions detached and marked, back
// to t for [start, end), under the schema lock as createPartitions does,
// and checks that it is.
func attachBack(ctx context.Context, db dbConn, t, p qualifiedName, start, end time.Time) error {
	part := partition{name: p, start: start, end: end}
	tx, err := db.BeginTxx(ctx, nil)
	if err != nil {
		return fmt.Errorf("inbox: attach partition %s again: %w", part.name, err)
	}
	defer tx.Rollback() //nolint:errcheck // no-op after Commit
	for _, stmt := range []string{"SET LOCAL lock_timeout = '10s'", "SELECT pg_advisory_xact_lock($1)"} {
		args := []any{}
		if strings.Contains(stmt, "$1") {
			args = append(args, schemaLockKey(t))
		}
		if _, err := tx.ExecContext(ctx, stmt, args...); err != nil {
			return fmt.Errorf("inbox: attach partition %s again: %w", part.name, err)
		}
	}
	if err := attachPartition(ctx, tx, t, part.name, part.start, part.end); err != nil {
		return err
	}
	var attached bool
	if err := sqlx.GetContext(ctx, tx, &attached, "SELECT EXISTS (SELECT 1 FROM pg_inherits WHERE inhrelid = to_regclass($1)"+
		" AND inhparent = to_regclass($2))", part.name.quoted(PostgreSQLPartitioned), t.quoted(PostgreSQLPartitioned)); err != nil {
		return fmt.Errorf("inbox: attach partition %s again: %w", part.name, err)
	}
	if !attached {
		return fmt.Errorf("%w: inbox: attach partition %s again to %s: it holds rows inside the window (which has grown since its"+
			" DETACH began) and could not be attached back; attach it by hand", ErrIncompatibleTable, part.name, t)
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("inbox: attach partition %s again: %w", part.name, err)
	}
	return nil
}

// detachWait bounds how long a DETACH PARTITION waits for the transactions
// that started before it (dropPartitions), in nanoseconds: ten minutes,
// so that a report of some minutes does not fail the round, while one left
// open for hours or days does not hold the purge lock for as long.
var detachWait atomic.Int64

func init() { detachWait.Store(int64(10 * time.Minute)) }

// holdsOtherConsumers reports whether partition p holds a row of a consumer
// other than consumer; false without a consumer. It first takes p's SHARE
// lock, which waits for the transactions that are writing to p (a claim
// whose transaction began before p's end: processed_at is the
// transaction's start) and keeps new ones out while it looks, so that a row
// committed after the look cannot be dropped with p. Only committed rows
// were looked at before, and DETACH PARTITION CONCURRENTLY waited for such a
// claim to commit and then dropped its row (another consumer's, inside its
// own window). The wait is bounded by detachWait, as the DETACH's is. Then
// two probes of the primary key, which starts with the consumer.
func holdsOtherConsumers(ctx context.Context, db dbConn, p qualifiedName, consumer string) (bool, error) {
	if consumer == "" {
		return false, nil
	}
	var others bool
	q := p.quoted(PostgreSQLPartitioned)
	wait := time.Duration(detachWait.Load())
	look := func() error {
		tx, err := db.BeginTxx(ctx, nil)
		if err != nil {
			return err
		}
		defer tx.Rollback() //nolint:errcheck // it only reads, under its lock
		// SET LOCAL takes no parameter: the value is ours, in milliseconds.
		if _, err := tx.ExecContext(ctx, "SET LOCAL lock_timeout = "+strconv.FormatInt(max(wait.Milliseconds(), 1), 10)); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, "LOCK TABLE "+q+" IN SHARE MODE"); err != nil {
			return fmt.Errorf("waited up to %v for the transactions writing to it (one left open? see pg_stat_activity's xact_start): %w", wait, err)
		}
		return sqlx.GetContext(ctx, tx, &others, "SELECT EXISTS (SELECT 1 FROM "+q+" WHERE consumer < $1)"+
			" OR EXISTS (SELECT 1 FROM "+q+" WHERE consumer > $1)", consumer)
	}
	if err := look(); err != nil {
		return false, fmt.Errorf("look for other consumers' rows: %w", err)
	}
	return others, nil
}

// detachedPartitionComment marks a partition of an inbox table that
// dropPartitions detaches to drop it (COMMENT ON TABLE, before the DETACH),
// followed by the partition's range and the inbox table's name
// (detachedMark): a table left detached by an interrupted call carries it,
// and is the only kind of detached table the library drops or attaches
// again, whatever its name (the library's, pg_partman's, a hand-made one)
// and whether or not it is partitioned itself. A table detached by anyone
// else (pg_partman's retention with retention_keep_table keeps them as
// archives, under names like the library's) is never touched. The comment
// alone, as earlier versions wrote it, is taken for a partition of the
// inbox table of that name in the table's own schema.
const detachedPartitionComment = "inbox: detached by DropPartitions to be dropped"

// detachedMark returns the comment dropPartitions marks a partition of t
// (resolved: canonicalTable) for [start, end) with before its DETACH. It
// names t, so that a partition that was moved to another schema and left
// detached there is known for t's, and for no other inbox table's of the
// same name in another schema (only tables in t's schema were looked at
// before, and such a partition's rows stayed unseen by claims for good).
// It holds the range, which the catalog forgets with the DETACH, so that
// the table can be attached back for exactly it whatever its name says
// (only names of the library's were found again before, by their kind
// letter: a pg_partman or hand-made partition left detached stayed so,
// its rows unseen by claims).
func detachedMark(t qualifiedName, start, end time.Time) string {
	return detachedPartitionComment + ", range [" + markBound(start) + ", " + markBound(end) + ") from " + t.String()
}

// markBound formats a bound of a partition's range for detachedMark (UTC,
// RFC 3339; MINVALUE's zero time is year 1, below any processed_at).
func markBound(x time.Time) string { return x.UTC().Format(time.RFC3339Nano) }

// detachedMarkPattern returns a regular expression (PostgreSQL's ~ and
// Go's regexp alike) that matches the marks of t's partitions: with their
// range (detachedMark) or without it ("… from <schema>.<table>", as the
// version before wrote them); submatches 1 and 2 are the range's bounds.
func detachedMarkPattern(t qualifiedName) string {
	const bound = `([0-9]{4,6}-[0-9]{2}-[0-9]{2}T[0-9:.]+Z)`
	return "^" + regexp.QuoteMeta(detachedPartitionComment) + `(?:, range \[` + bound + `, ` + bound + `\))? from ` +
		regexp.QuoteMeta(t.String()) + "$"
}

// markedFor returns an SQL condition on pg_class row c: it carries the mark
// of a partition of the inbox table whose name (quoted, to_regclass's
// input) is the parameter table, the parameter pattern being
// detachedMarkPattern's, or the comment alone (detachedPartitionComment,
// written by earlier versions), which does not say whose it is, on a table
// in that table's schema named as the library names its partitions
// ("<table>_pYYYYMMDD", "<table>_wYYYYMMDD"): another inbox table's
// leftover in the same schema carries the same comment.
func markedFor(c, table, pattern string) string {
	desc := "obj_description(" + c + ".oid, 'pg_class')"
	parent := "(SELECT %s FROM pg_class WHERE oid = to_regclass(" + table + "))"
	return "(" + desc + " ~ " + pattern + " OR (" + desc + " = '" + detachedPartitionComment + "' AND " +
		c + ".relnamespace = " + fmt.Sprintf(parent, "relnamespace") + " AND " +
		c + ".relname ~ '_[pw][0-9]{8}$' AND left(" + c + ".relname, -10) = " + fmt.Sprintf(parent, "relname::text") + "))"
}

// detachedTable is a table an interrupted DropPartitions left detached,
// with the range it had as a partition when its mark holds it.
type detachedTable struct {
	name       qualifiedName
	start, end time.Time
	ranged     bool
}

// detachedPartitions returns the tables, plain or partitioned, in any
// schema, that carry t's mark (markedFor), have a processed_at column and
// are attached to no table: what a DropPartitions interrupted between its
// DETACH and its DROP leaves behind.
func detachedPartitions(ctx context.Context, q sqlx.QueryerContext, t qualifiedName) ([]detachedTable, error) {
	var rows []struct {
		Schema  string `db:"schema"`
		Name    string `db:"name"`
		Comment string `db:"comment"`
	}
	pattern := detachedMarkPattern(t)
	err := sqlx.SelectContext(ctx, q, &rows, `
		SELECT n.nspname::text AS schema, c.relname::text AS name, obj_description(c.oid, 'pg_class') AS comment
		FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		WHERE c.relkind IN ('r', 'p') AND NOT c.relispartition
		  AND `+markedFor("c", "$1", "$2")+`
		  AND NOT EXISTS (SELECT 1 FROM pg_inherits WHERE inhrelid = c.oid)
		  AND EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = c.oid AND attname = 'processed_at' AND NOT attisdropped)
		ORDER BY n.nspname, c.relname`,
		t.quoted(PostgreSQLPartitioned), pattern)
	if err != nil {
		return nil, fmt.Errorf("list detached partitions: %w", err)
	}
	re := regexp.MustCompile(pattern)
	parts := make([]detachedTable, len(rows))
	for i, r := range rows {
		parts[i].name = qualifiedName{schema: r.Schema, name: r.Name}
		m := re.FindStringSubmatch(r.Comment)
		if m == nil || m[1] == "" {
			continue // marked without its range (an earlier version)
		}
		start, err1 := time.Parse(time.RFC3339Nano, m[1])
		end, err2 := time.Parse(time.RFC3339Nano, m[2])
		if err1 == nil && err2 == nil && start.Before(end) {
			parts[i].start, parts[i].end, parts[i].ranged = start, end, true
		}
	}
	return parts, nil
}

// partition is one partition table of an inbox table.
type partition struct {
	name qualifiedName
	// start and end are its bounds as the catalog holds them (UTC), never
	// as its name suggests: the first instant it accepts and the first it
	// does not. A zero start is MINVALUE (or -infinity), a zero end
	// MAXVALUE (or infinity): unbounded on that side.
	start, end time.Time
	// interval is PartitionDay or PartitionWeek when its bounds are
	// exactly one such slot, "" for any other range (a hand-made or
	// pg_partman partition, an unbounded side).
	interval PartitionInterval
	// pending is a DETACH PARTITION ... CONCURRENTLY interrupted half way
	// (pg_inherits.inhdetachpending): only FINALIZE completes it.
	pending bool
}

// bounded reports whether p has both bounds.
func (p partition) bounded() bool { return !p.start.IsZero() && !p.end.IsZero() }

// tablePartitions is what the catalog says about the partitions of an
// inbox table.
type tablePartitions struct {
	// ranges are the attached range partitions, by start (an unbounded
	// start first).
	ranges []partition
	// defaults names a DEFAULT partition ("" when there is none).
	defaults qualifiedName
	// other names the attached partitions whose bound is neither a range
	// of one processed_at value nor DEFAULT (a table partitioned
	// otherwise, which Verify refuses): never dropped, never trusted.
	other []qualifiedName
	// partitioned is whether the table itself is partitioned (relkind p).
	partitioned bool
	// key is the table's partition key, as pg_partitioned_table holds it.
	key partitionKey
}

// partitionKey is how a partitioned table is partitioned.
type partitionKey struct {
	// Strategy is "r" (range), "l" (list) or "h" (hash).
	Strategy string `db:"strategy"`
	// Columns is how many columns or expressions the key has.
	Columns int `db:"columns"`
	// Column is the key's first column, "" when it is an expression.
	Column string `db:"key"`
	// Type is that column's type, as format_type writes it.
	Type string `db:"key_type"`
	// Timestamptz is whether that type is timestamptz itself.
	Timestamptz bool `db:"key_timestamptz"`
	// DefaultOrder is whether the key orders by timestamptz's default
	// btree operator class: with another (one that sorts backwards), a
	// partition's TO bound is not its latest instant.
	DefaultOrder bool `db:"key_default_order"`
}

// pgPartitionKeySQL reads the partition key of $1 (partitionKey); no row
// when $1 is not a partitioned table.
const pgPartitionKeySQL = `SELECT pt.partstrat::text AS strategy, pt.partnatts AS columns,
	COALESCE(a.attname::text, '') AS key, COALESCE(format_type(a.atttypid, a.atttypmod), '') AS key_type,
	COALESCE(a.atttypid = 'timestamptz'::regtype, false) AS key_timestamptz,
	COALESCE(pt.partclass[0] = (SELECT oc.oid FROM pg_opclass oc JOIN pg_am am ON am.oid = oc.opcmethod
		WHERE am.amname = 'btree' AND oc.opcintype = 'timestamptz'::regtype AND oc.opcdefault), false) AS key_default_order
FROM pg_partitioned_table pt
LEFT JOIN pg_attribute a ON a.attrelid = pt.partrelid AND a.attnum = pt.partattrs[0]
WHERE pt.partrelid = to_regclass($1)`

// problem says why partitions of this key cannot be maintained by their
// bounds, "" when they can: a range of processed_at alone, of type
// timestamptz. On any other column the bounds say nothing of the rows'
// processed_at (a table keyed by another timestamp had its partitions of
// rows processed a moment ago dropped), and a bound of a timestamp
// without time zone is a wall-clock time that the catalog read, in UTC,
// would take hours off or add hours to.
func (k partitionKey) problem() string {
	if k.Strategy != "r" || k.Columns != 1 || k.Column != processedAt {
		strategy := map[string]string{"r": "range", "l": "list", "h": "hash"}[k.Strategy]
		what := fmt.Sprintf("the column %q", k.Column)
		if k.Column == "" {
			what = "an expression"
		}
		return fmt.Sprintf("the table is partitioned by %s on %d column(s), the first %s, not by range on %q alone,"+
			" so its partitions' bounds say nothing of when their rows were processed", strategy, k.Columns, what, processedAt)
	}
	switch {
	case !k.Timestamptz && strings.HasPrefix(k.Type, "timestamp without time zone"):
		return fmt.Sprintf("its partition key %q has type %q, not timestamptz: the bounds are wall-clock times of"+
			" no time zone, which the session's time zone would move by hours", processedAt, k.Type)
	case !k.Timestamptz:
		return fmt.Sprintf("its partition key %q has type %q, not timestamptz itself", processedAt, k.Type)
	case !k.DefaultOrder:
		return fmt.Sprintf("its partition key %q orders by an operator class other than timestamptz's default,"+
			" so a partition's upper bound need not be the latest time it holds", processedAt)
	}
	return ""
}

// newest returns the attached range partition that starts last.
func (tp tablePartitions) newest() (partition, bool) {
	if len(tp.ranges) == 0 {
		return partition{}, false
	}
	return tp.ranges[len(tp.ranges)-1], true
}

// pgPartitionsSQL lists the partitions attached to $1, each with its own
// schema, and their bounds. A range bound's values are cast back to
// timestamptz in the statement and returned as Unix microseconds; NULL for
// MINVALUE, MAXVALUE and infinity. pg_get_expr writes them in the session's
// DateStyle and TimeZone, and only ISO's numeric offsets read back as they
// were written: with DateStyle 'SQL' or 'Postgres' a zone abbreviation is
// read through timezone_abbreviations (Irish summer time's "IST" as
// Israel's +02, Guam's "ChST" not at all), so that DropPartitions dropped a
// partition an hour before its bound, and partitions were created with
// gaps. A one-time condition of the read, evaluated before its first row,
// sets both for the statement's transaction only (set_config(…, true)).
// bound_kind: "range" for FROM (x) TO (y) on one column, "default", or
// "other".
const pgPartitionsSQL = `
WITH parts AS (
	SELECT n.nspname::text AS schema, c.relname::text AS name, pg_get_expr(c.relpartbound, c.oid) AS bound,
		i.inhdetachpending AS pending
	FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_namespace n ON n.oid = c.relnamespace
	WHERE i.inhparent = to_regclass($1)
	  AND (SELECT set_config('DateStyle', 'ISO', true) || set_config('TimeZone', 'UTC', true)) IS NOT NULL
), parsed AS MATERIALIZED (
	SELECT schema, name, pending, bound,
		regexp_match(bound, E'^FOR VALUES FROM \\((MINVALUE|''[^'']*'')\\) TO \\((MAXVALUE|''[^'']*'')\\)$') AS m
	FROM parts
), cast_ AS (
	SELECT schema, name, pending, bound, m,
		CASE WHEN m[1] <> 'MINVALUE' THEN btrim(m[1], '''')::timestamptz END AS lo,
		CASE WHEN m[2] <> 'MAXVALUE' THEN btrim(m[2], '''')::timestamptz END AS hi
	FROM parsed
)
SELECT schema, name, pending,
	CASE WHEN bound = 'DEFAULT' THEN 'default' WHEN m IS NOT NULL THEN 'range' ELSE 'other' END AS bound_kind,
	CASE WHEN isfinite(lo) THEN CAST(EXTRACT(EPOCH FROM lo) * 1000000 AS bigint) END AS lo_us,
	CASE WHEN isfinite(hi) THEN CAST(EXTRACT(EPOCH FROM hi) * 1000000 AS bigint) END AS hi_us,
	COALESCE(lo = '-infinity' OR m[1] = 'MINVALUE', false) AS lo_unbounded
FROM cast_`

// listPartitions returns what the catalog says of the partitions attached
// to t (resolved: canonicalTable), by their real bounds: a partition's name
// says nothing, since other tools (pg_partman names its partitions
// <parent>_pYYYYMMDD whatever their interval) and hand-made DDL may use
// names like ours for other ranges.
func listPartitions(ctx context.Context, db sqlx.QueryerContext, t qualifiedName) (tablePartitions, error) {
	var rows []struct {
		Schema      string        `db:"schema"`
		Name        string        `db:"name"`
		Pending     bool          `db:"pending"`
		Kind        string        `db:"bound_kind"`
		Lo          sql.NullInt64 `db:"lo_us"`
		Hi          sql.NullInt64 `db:"hi_us"`
		LoUnbounded bool          `db:"lo_unbounded"`
	}
	var tp tablePartitions
	err := sqlx.GetContext(ctx, db, &tp.key, pgPartitionKeySQL, t.quoted(PostgreSQLPartitioned))
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return tp, nil // not partitioned: no partitions
	case err != nil:
		return tp, fmt.Errorf("read the table's partition key: %w", err)
	}
	tp.partitioned = true
	if err := sqlx.SelectContext(ctx, db, &rows, pgPartitionsSQL, t.quoted(PostgreSQLPartitioned)); err != nil {
		return tp, fmt.Errorf("list partitions: %w", err)
	}
	for _, r := range rows {
		// Its own schema: a partition moved to another (an archive) was
		// addressed in the parent's, where a table of the same name, a
		// partition for other days, was dropped in its place.
		name := qualifiedName{schema: r.Schema, name: r.Name}
		switch {
		case r.Kind == "default":
			tp.defaults = name
			continue
		case r.Kind != "range" || (!r.Lo.Valid && !r.LoUnbounded):
			// A start of +infinity: a range no row can be in; or not a
			// range at all.
			tp.other = append(tp.other, name)
			continue
		}
		p := partition{name: name, pending: r.Pending}
		if r.Lo.Valid {
			p.start = time.UnixMicro(r.Lo.Int64).UTC()
		}
		if r.Hi.Valid {
			p.end = time.UnixMicro(r.Hi.Int64).UTC()
		}
		for _, iv := range []PartitionInterval{PartitionDay, PartitionWeek} {
			if s, e := iv.slot(p.start); p.bounded() && s.Equal(p.start) && e.Equal(p.end) {
				p.interval = iv
			}
		}
		tp.ranges = append(tp.ranges, p)
	}
	sort.Slice(tp.ranges, func(i, j int) bool { return tp.ranges[i].start.Before(tp.ranges[j].start) })
	return tp, nil
}

// OldestPartitionAge returns how long ago the oldest partition of the
// PostgreSQLPartitioned table named table that holds rows (of consumer's
// when consumer is not "") ended, by the database clock, and true; false,
// with no error, when the table is not partitioned. It is what a Purger
// round reports as PurgeRound.OldestAge (and, with consumer "",
// TableOldestAge): a partition is dropped once all of it is past the
// window, so this age, unlike the oldest row's, passes the window only
// while the purge is behind, whatever the partitions' widths (the
// library's days or weeks, pg_partman's months, one made by hand). 0 when
// no partition holds such rows or the oldest has not ended yet; a DEFAULT
// partition and one unbounded above count with their oldest row's age.
// Reads the catalog and, through the table (so that SELECT on it is the
// only privilege needed, as for Stats), one row of each partition's range
// in a read-only transaction; a DEFAULT partition is read directly. Safe
// for concurrent use. Errors: an invalid consumer wraps
// ErrInvalidConsumer, a bad name ErrInvalidTableName, others the driver's.
// table "": DefaultTable.
func OldestPartitionAge(ctx context.Context, db *sqlx.DB, table, consumer string) (time.Duration, bool, error) {
	if consumer != "" {
		if err := checkKey(consumer, ErrInvalidConsumer, nil, nil); err != nil {
			return 0, false, fmt.Errorf("inbox: oldest partition: %w", err)
		}
	}
	if table == "" {
		table = DefaultTable
	}
	t, err := parseTableName(table)
	if err != nil {
		return 0, false, err
	}
	var age time.Duration
	var partitioned bool
	err = withReadTx(ctx, db, PostgreSQLPartitioned, func(q sqlx.QueryerContext) error {
		t, err := canonicalTable(ctx, q, PostgreSQLPartitioned, t)
		if err != nil {
			return err
		}
		tp, err := listPartitions(ctx, q, t)
		if partitioned = tp.partitioned; err != nil || !partitioned {
			return err
		}
		age, err = oldestPartitionAgeThroughParent(ctx, q, t, tp, consumer)
		return err
	})
	if err != nil {
		return 0, false, fmt.Errorf("inbox: oldest partition of %s: %w", t, err)
	}
	return age, partitioned, nil
}

// oldestPartitionAgeThroughParent is oldestPartitionAge read through t
// rather than from each partition (OldestPartitionAge: a role granted
// SELECT on the table may not read its partitions), each range a
// statement whose bounds are literals, so that the planner prunes the
// other partitions. A partition whose DETACH is pending is not seen
// through t, and not counted (the purge finishes and drops it).
func oldestPartitionAgeThroughParent(ctx context.Context, q sqlx.QueryerContext, t qualifiedName, tp tablePartitions, consumer string) (time.Duration, error) {
	d := PostgreSQLPartitioned
	var args []any
	where := ""
	if consumer != "" {
		where, args = " AND consumer = $1", []any{consumer}
	}
	var oldest time.Duration
	if tp.defaults.name != "" {
		var age sql.NullInt64
		query := "SELECT CAST(EXTRACT(EPOCH FROM now() - MIN(processed_at)) * 1000000 AS bigint) FROM " +
			tp.defaults.quoted(d) + " WHERE true" + where
		if err := sqlx.GetContext(ctx, q, &age, query, args...); err != nil {
			return 0, err
		}
		oldest = time.Duration(age.Int64) * time.Microsecond
	}
	for _, p := range tp.ranges {
		inRange := "true"
		if !p.start.IsZero() {
			inRange = "processed_at >= " + pgTimestampConstant(p.start.UnixMicro())
		}
		var query string
		if p.end.IsZero() { // MAXVALUE: no end to go by
			query = "SELECT CAST(EXTRACT(EPOCH FROM now() - MIN(processed_at)) * 1000000 AS bigint) FROM " + t.quoted(d) +
				" WHERE " + inRange + where
		} else {
			end := pgTimestampConstant(p.end.UnixMicro())
			query = "SELECT GREATEST(CAST(EXTRACT(EPOCH FROM now() - " + end + ") * 1000000 AS bigint), 0) WHERE EXISTS (SELECT 1 FROM " +
				t.quoted(d) + " WHERE " + inRange + " AND processed_at < " + end + where + ")"
		}
		var age sql.NullInt64
		err := sqlx.GetContext(ctx, q, &age, query, args...)
		if errors.Is(err, sql.ErrNoRows) || (err == nil && !age.Valid) {
			continue // empty
		}
		if err != nil {
			return 0, err
		}
		return max(oldest, time.Duration(age.Int64)*time.Microsecond), nil
	}
	return oldest, nil
}

// oldestPartitionAge returns how long ago the oldest non-empty partition of
// t ended (its upper bound; 0 while it has not): the age that every one of
// its rows has passed, without scanning rows (the table has no index on
// processed_at). The purge drops that partition once it passes the window,
// so, as a deleting round's oldest row age does, it exceeds the window only
// while the purge is behind: the start, which a partition's oldest row may
// be as old as, exceeded the window by up to a partition interval (a
// week) on every healthy table, and the falling-behind alert fired on
// them. A partition unbounded above, and a DEFAULT partition, have no
// such bound to go by: their oldest row is read (one from MINVALUE is
// dropped once its end passes the window, as any other). 0 when every
// partition is empty. With consumer not "", only that consumer's rows count
// (a purge limited to it; the primary key, led by consumer, finds them).
// Read as OldestPartitionAge reads it (oldestPartitionAgeThroughParent).
func oldestPartitionAge(ctx context.Context, db sqlx.QueryerContext, t qualifiedName, consumer string) (time.Duration, error) {
	t, err := canonicalTable(ctx, db, PostgreSQLPartitioned, t)
	if err != nil {
		return 0, err
	}
	tp, err := listPartitions(ctx, db, t)
	if err != nil {
		return 0, err
	}
	return oldestPartitionAgeThroughParent(ctx, db, t, tp, consumer)
}

// check returns an error wrapping ErrIncompatibleTable, with the fix, when
// the partitions of t cannot be maintained by their bounds (problem).
func (tp tablePartitions) check(t qualifiedName) error {
	if what, fix := tp.problem(t); what != "" {
		return fmt.Errorf("%w: %s: %s; fix: %s", ErrIncompatibleTable, t, what, fix)
	}
	return nil
}

// problem says what keeps the partitions of t from being maintained by
// their bounds, and how to fix it; "" when nothing does. t is not
// partitioned; it is not partitioned by range on processed_at timestamptz
// alone (partitionKey.problem); a partition is not a range; or t has a
// DEFAULT partition, which makes every DETACH PARTITION ... CONCURRENTLY
// fail (SQLSTATE 55000, a restriction PostgreSQL documents) and, once it
// holds a row of a time that has no partition, makes attaching that time's
// partition fail (23514): no partition would ever be dropped or created
// again, so the table is refused instead of left to grow.
func (tp tablePartitions) problem(t qualifiedName) (what, fix string) {
	switch {
	case !tp.partitioned:
		return "the table is not partitioned, so partitions cannot be created or dropped on it",
			"use the PostgreSQL dialect, or recreate it partitioned (inbox schema -verify -dialect postgres-partitioned prints a migration script)"
	case tp.key.problem() != "":
		return tp.key.problem(),
			"recreate the table partitioned by range on " + processedAt + " timestamptz alone (inbox schema -verify -dialect postgres-partitioned)"
	case len(tp.other) > 0:
		return fmt.Sprintf("partition %s is not a range of %s alone", tp.other[0], processedAt),
			"recreate the table partitioned by range on " + processedAt + " alone (inbox schema -verify -dialect postgres-partitioned)"
	case tp.defaults.name != "":
		return fmt.Sprintf("it has the DEFAULT partition %s, with which PostgreSQL can neither detach a partition"+
			" concurrently nor attach one for a time the DEFAULT partition holds rows of", tp.defaults), defaultPartitionFix(t, tp.defaults)
	}
	return "", ""
}

// defaultPartitionFix returns the script that replaces the DEFAULT
// partition def of t by daily partitions for the days it holds rows of
// (where no partition covers them yet) and moves its rows there. It is one
// transaction: a row no partition takes (a day that a hand-made partition
// covers in part) fails the INSERT, and nothing is changed, where psql,
// which goes on after an error, ran the DROP TABLE and every row of the
// DEFAULT partition was lost. The day bounds are written in UTC and ISO
// whatever the operator's session's TimeZone and DateStyle ('15/07/2026
// 01:00:00 IST' was read back as Israel's time).
func defaultPartitionFix(t, def qualifiedName) string {
	d := PostgreSQLPartitioned
	schema := "current_schema()"
	if t.schema != "" {
		schema = pgStringConstant(t.schema)
	}
	return "BEGIN;\n" +
		"SET LOCAL TimeZone = 'UTC';\n" +
		"SET LOCAL DateStyle = 'ISO';\n" +
		"ALTER TABLE " + t.quoted(d) + " DETACH PARTITION " + def.quoted(d) + ";\n" +
		"-- A daily partition for each day its rows are of, unless one covers it already (42P17, 42P07):\n" +
		"DO $$DECLARE day date; BEGIN FOR day IN SELECT DISTINCT (processed_at AT TIME ZONE 'UTC')::date FROM " + def.quoted(d) +
		" LOOP BEGIN EXECUTE format('CREATE TABLE %I.%I PARTITION OF " + strings.ReplaceAll(t.quoted(d), "'", "''") +
		" FOR VALUES FROM (%L) TO (%L)', " + schema + ", " + pgStringConstant(t.name+"_p") + " || to_char(day, 'YYYYMMDD')," +
		" day::timestamp AT TIME ZONE 'UTC', (day + 1)::timestamp AT TIME ZONE 'UTC');" +
		" EXCEPTION WHEN invalid_object_definition OR duplicate_table THEN NULL; END; END LOOP; END$$;\n" +
		"INSERT INTO " + t.quoted(d) + " SELECT * FROM " + def.quoted(d) + ";\n" +
		"DROP TABLE " + def.quoted(d) + ";\n" +
		"COMMIT;"
}
