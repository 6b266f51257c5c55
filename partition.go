package inbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sort"
	"strings"
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
// from its partitions' names: "<table>_pYYYYMMDD" is a UTC day (the only
// interval before weekly partitions existed), "<table>_wYYYYMMDD" a week
// starting on that Monday, 00:00 UTC. The newest partition decides; a table
// with no partitions gets DefaultPartitionInterval from InitializeSchema, a
// Purger or CreatePartitions, or the interval given to InitializePartitions.
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
	from, until, err := maintainedRange(ctx, db, t)
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
	from, until, err := maintainedRange(ctx, db, t)
	if err != nil {
		return err
	}
	return createPartitions(ctx, db, t, to, true, from, until)
}

// TablePartitionInterval returns the PartitionInterval of the
// PostgreSQLPartitioned table named table (that of its newest partition),
// and "" when it has no partitions. Errors wrap the driver's error, or
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
		parts, err := listPartitions(ctx, q, t)
		if len(parts) > 0 {
			iv = parts[len(parts)-1].interval
		}
		return err
	})
	if err != nil {
		return "", fmt.Errorf("inbox: partition interval of %s: %w", t, err)
	}
	return iv, nil
}

// maintainedRange returns the range InitializeSchema and a Purger keep
// covered: from the start of yesterday to the end of the
// DefaultPartitionsAhead-th day after today, by the database clock (UTC).
func maintainedRange(ctx context.Context, db sqlx.QueryerContext, t qualifiedName) (from, until time.Time, err error) {
	var now time.Time
	if err := sqlx.GetContext(ctx, db, &now, "SELECT now()"); err != nil {
		return from, until, fmt.Errorf("inbox: create partitions of %s: %w", t, err)
	}
	from = now.UTC().Truncate(oneDay).AddDate(0, 0, -1)
	return from, from.AddDate(0, 0, DefaultPartitionsAhead+2), nil
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
	parts, err := listPartitions(ctx, tx, t)
	if err != nil {
		return fmt.Errorf("inbox: create partitions of %s: %w", t, err)
	}
	iv := DefaultPartitionInterval
	if want != "" {
		iv = want
	}
	if len(parts) > 0 {
		newest := parts[len(parts)-1]
		switch {
		case want == "" || newest.interval == want:
			iv = newest.interval
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
			x = p.end
			continue
		}
		piv := iv
		start, end := iv.slot(x)
		if overlapping(parts, start, end) {
			piv = PartitionDay // a day is free: no partition covers x, all are whole days
			start, end = PartitionDay.slot(x)
		}
		p, err := partitionName(t, piv, start)
		if err != nil {
			return err
		}
		if err := attachPartition(ctx, tx, t, p, start, end); err != nil {
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

// attachPartition creates p as a plain table and attaches it to t for
// [start, end).
func attachPartition(ctx context.Context, tx *sqlx.Tx, t, p qualifiedName, start, end time.Time) error {
	d := PostgreSQLPartitioned
	// Bounds are formatted by us from a time.Time, never user input.
	lo, hi := start.Format("2006-01-02 15:04:05Z07:00"), end.Format("2006-01-02 15:04:05Z07:00")
	for _, stmt := range []string{
		"CREATE TABLE " + p.quoted(d) + " (LIKE " + t.quoted(d) + " INCLUDING DEFAULTS INCLUDING CONSTRAINTS)",
		// The CHECK lets ATTACH skip its validation scan.
		"ALTER TABLE " + p.quoted(d) + " ADD CONSTRAINT " + d.quote(p.name+"_range") +
			" CHECK (processed_at >= '" + lo + "' AND processed_at < '" + hi + "')",
		"ALTER TABLE " + t.quoted(d) + " ATTACH PARTITION " + p.quoted(d) +
			" FOR VALUES FROM ('" + lo + "') TO ('" + hi + "')",
		"ALTER TABLE " + p.quoted(d) + " DROP CONSTRAINT " + d.quote(p.name+"_range"),
	} {
		if _, err := tx.ExecContext(ctx, stmt); err != nil {
			return fmt.Errorf("inbox: create partition %s: %w", p, err)
		}
	}
	return nil
}

// covering returns the partition whose range holds x.
func covering(parts []partition, x time.Time) (partition, bool) {
	for _, p := range parts {
		if !x.Before(p.start) && x.Before(p.end) {
			return p, true
		}
	}
	return partition{}, false
}

// overlapping reports whether a partition's range meets [start, end).
func overlapping(parts []partition, start, end time.Time) bool {
	for _, p := range parts {
		if p.start.Before(end) && start.Before(p.end) {
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
// partition (daily or weekly, see PartitionInterval) whose whole range ended
// more than olderThan ago by the database clock, and returns them. Each is first detached with DETACH
// PARTITION ... CONCURRENTLY (PostgreSQL 14+), which waits for transactions
// that use it without blocking new claims, then counted and dropped. With a
// window, like PurgeConfig.Window, a shorter olderThan is refused with
// ErrWindowTooShort. olderThan must be positive even with a window (unlike
// PurgeConfig.OlderThan, 0 does not mean "the safe window"); a
// non-positive olderThan is an error wrapping ErrInvalidConfig, a bad table
// name one wrapping ErrInvalidTableName. When ctx ends or a step fails it returns what it
// dropped so far with the error; a partition left detached by an
// interruption is dropped by the next call.
//
// It is safe to run from several processes at once, and alongside Purger
// rounds, also behind a transaction-mode pooler: it takes the Purger's lock
// (a transaction-scoped advisory lock keyed by the table, in a transaction
// held open for the call; see Purger), waiting for a call or round that
// holds it, and then finds the partitions afresh, so a partition another
// call dropped is neither dropped again nor counted twice. It needs two
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
	return dropPartitions(ctx, lease.work, t, olderThan)
}

// dropPartitions drops the partitions of t past olderThan, under the purge
// lock. Its reads with arguments run in short transactions (withReadTx), so
// that they work behind a transaction-mode pooler with lib/pq; DETACH
// PARTITION CONCURRENTLY cannot run in a transaction block at all.
func dropPartitions(ctx context.Context, db dbConn, t qualifiedName, olderThan time.Duration) ([]DroppedPartition, error) {
	d := PostgreSQLPartitioned
	var cutoff time.Time
	var parts []partition
	err := withReadTx(ctx, db, d, func(q sqlx.QueryerContext) (err error) {
		if t, err = canonicalTable(ctx, q, d, t); err != nil {
			return err
		}
		if err := sqlx.GetContext(ctx, q, &cutoff, "SELECT now() - $1 * interval '1 microsecond'", olderThan.Microseconds()); err != nil {
			return err
		}
		parts, err = listPartitions(ctx, q, t)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("inbox: drop partitions of %s: %w", t, err)
	}
	var dropped []DroppedPartition
	for _, part := range parts {
		if part.end.After(cutoff) {
			continue // not entirely past the window
		}
		p := part.name
		// Attached, attached with a DETACH CONCURRENTLY interrupted half way
		// ("pending": only FINALIZE completes it), or already detached.
		var state sql.NullBool // NULL: detached; else inhdetachpending
		err := withReadTx(ctx, db, d, func(q sqlx.QueryerContext) error {
			return sqlx.GetContext(ctx, q, &state,
				"SELECT (SELECT inhdetachpending FROM pg_inherits WHERE inhrelid = to_regclass($1))", p.quoted(d))
		})
		if err != nil {
			return dropped, fmt.Errorf("inbox: drop partition %s: %w", p, err)
		}
		if state.Valid {
			detach := " CONCURRENTLY"
			if state.Bool {
				detach = " FINALIZE"
			}
			if _, err := db.ExecContext(ctx, "ALTER TABLE "+t.quoted(d)+" DETACH PARTITION "+p.quoted(d)+detach); err != nil {
				return dropped, fmt.Errorf("inbox: detach partition %s: %w", p, err)
			}
		}
		var rows int64
		if err := sqlx.GetContext(ctx, db, &rows, "SELECT count(*) FROM "+p.quoted(d)); err != nil {
			return dropped, fmt.Errorf("inbox: drop partition %s: count: %w", p, err)
		}
		if _, err := db.ExecContext(ctx, "DROP TABLE "+p.quoted(d)); err != nil {
			return dropped, fmt.Errorf("inbox: drop partition %s: %w", p, err)
		}
		dropped = append(dropped, DroppedPartition{Name: p.String(), Rows: rows})
	}
	return dropped, nil
}

// partition is one partition table of an inbox table.
type partition struct {
	name       qualifiedName
	start, end time.Time // its first instant and the first after it, UTC
	interval   PartitionInterval
}

// listPartitions returns the partition tables of t, oldest first: the
// attached ones and any an interrupted DropPartitions left detached. Their
// ranges come from their names (see PartitionInterval).
func listPartitions(ctx context.Context, db sqlx.QueryerContext, t qualifiedName) ([]partition, error) {
	var names []string
	err := sqlx.SelectContext(ctx, db, &names, `
		SELECT c.relname FROM pg_class c
		WHERE c.relnamespace = (SELECT relnamespace FROM pg_class WHERE oid = to_regclass($1))
		  AND c.relkind IN ('r', 'p') AND c.relname LIKE $2 ESCAPE '!'
		ORDER BY c.relname`,
		t.quoted(PostgreSQLPartitioned), strings.ReplaceAll(t.name, "_", "!_")+"!__________")
	if err != nil {
		return nil, fmt.Errorf("list partitions: %w", err)
	}
	var parts []partition
	for _, name := range names {
		rest := strings.TrimPrefix(name, t.name+"_")
		iv := map[byte]PartitionInterval{'p': PartitionDay, 'w': PartitionWeek}[rest[0]]
		start, err := time.Parse("20060102", rest[1:])
		if err != nil || iv == "" {
			continue // a table that only looks like ours
		}
		s, end := iv.slot(start)
		if !s.Equal(start) {
			continue // not a week's Monday: not ours
		}
		parts = append(parts, partition{name: qualifiedName{schema: t.schema, name: name}, start: start, end: end, interval: iv})
	}
	sort.Slice(parts, func(i, j int) bool { return parts[i].start.Before(parts[j].start) })
	return parts, nil
}

// oldestPartitionAge returns how long ago the oldest non-empty partition of
// t began: the age of the oldest row, to the day, without scanning rows
// (the table has no index on processed_at). 0 when every partition is empty.
func oldestPartitionAge(ctx context.Context, db sqlx.QueryerContext, t qualifiedName) (time.Duration, error) {
	t, err := canonicalTable(ctx, db, PostgreSQLPartitioned, t)
	if err != nil {
		return 0, err
	}
	parts, err := listPartitions(ctx, db, t)
	if err != nil {
		return 0, err
	}
	for _, p := range parts {
		var age sql.NullInt64
		err := sqlx.GetContext(ctx, db, &age,
			"SELECT CAST(EXTRACT(EPOCH FROM now() - $1::timestamptz) * 1000000 AS bigint) WHERE EXISTS (SELECT 1 FROM "+
				p.name.quoted(PostgreSQLPartitioned)+")", p.start)
		if errors.Is(err, sql.ErrNoRows) {
			continue // empty
		}
		if err != nil {
			return 0, err
		}
		return time.Duration(age.Int64) * time.Microsecond, nil
	}
	return 0, nil
}
