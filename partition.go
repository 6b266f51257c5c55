package inbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jmoiron/sqlx"
)

// DefaultPartitionsAhead is how many days of partitions, after today,
// InitializeSchema and a Purger keep created for a PostgreSQLPartitioned
// table.
const DefaultPartitionsAhead = 7

// partitionSuffix is "_p" followed by the partition's first day, YYYYMMDD.
const partitionSuffix = "_p20060102"

// partitionName returns the daily partition of t for day (UTC), or an error
// when the name would pass PostgreSQL's 63-byte identifier limit.
func partitionName(t qualifiedName, day time.Time) (qualifiedName, error) {
	if len(t.name)+len(partitionSuffix) > 63 {
		return qualifiedName{}, fmt.Errorf("%w: %q is too long for daily partitions (at most %d bytes)",
			ErrInvalidTableName, t.name, 63-len(partitionSuffix))
	}
	return qualifiedName{schema: t.schema, name: t.name + day.UTC().Format(partitionSuffix)}, nil
}

// CreatePartitions creates, for a PostgreSQLPartitioned inbox table, the
// daily partitions (UTC days) that cover from's day and the days-1 days
// after it, skipping those that exist. Each is created as a plain table and
// then attached, which locks the parent only in SHARE UPDATE EXCLUSIVE mode,
// so running handlers and claims are not blocked (CREATE TABLE ... PARTITION
// OF would take ACCESS EXCLUSIVE). It is safe to run from several processes
// at once (serialised by an advisory lock) and waits at most 10 s for a lock
// (lock_timeout), failing rather than stalling traffic. InitializeSchema and
// a Purger call it; call it yourself only if you run neither.
func CreatePartitions(ctx context.Context, db *sqlx.DB, table string, from time.Time, days int) error {
	t, err := parseTableName(table)
	if err != nil {
		return err
	}
	if days < 1 || days > 3660 {
		return fmt.Errorf("%w: days must be between 1 and 3660, got %d", ErrInvalidConfig, days)
	}
	return createPartitions(ctx, db, t, from, days)
}

// dbConn is what partition management needs: a pool or one connection.
type dbConn interface {
	sqlx.ExecerContext
	sqlx.QueryerContext
	BeginTxx(ctx context.Context, opts *sql.TxOptions) (*sqlx.Tx, error)
}

func createPartitions(ctx context.Context, db dbConn, t qualifiedName, from time.Time, days int) error {
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
	first := from.UTC().Truncate(24 * time.Hour)
	for i := range days {
		day := first.AddDate(0, 0, i)
		p, err := partitionName(t, day)
		if err != nil {
			return err
		}
		var exists bool
		if err := tx.GetContext(ctx, &exists, "SELECT to_regclass($1) IS NOT NULL", p.quoted(d)); err != nil {
			return fmt.Errorf("inbox: create partition %s: %w", p, err)
		}
		if exists {
			continue
		}
		// Bounds are formatted by us from a time.Time, never user input.
		lo, hi := day.Format("2006-01-02 15:04:05Z07:00"), day.AddDate(0, 0, 1).Format("2006-01-02 15:04:05Z07:00")
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
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("inbox: create partitions of %s: commit: %w", t, err)
	}
	return nil
}

// DroppedPartition is one partition DropPartitions removed.
type DroppedPartition struct {
	Name string // schema-qualified when the table is
	Rows int64  // rows it held
}

// DropPartitions removes, from a PostgreSQLPartitioned inbox table, every
// daily partition whose whole day ended more than olderThan ago by the
// database clock, and returns them. Each is first detached with DETACH
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
		if part.day.AddDate(0, 0, 1).After(cutoff) {
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

// partition is one daily partition table of an inbox table.
type partition struct {
	name qualifiedName
	day  time.Time // its first instant, UTC
}

// listPartitions returns the daily partition tables of t, oldest first:
// the attached ones and any an interrupted DropPartitions left detached.
func listPartitions(ctx context.Context, db sqlx.QueryerContext, t qualifiedName) ([]partition, error) {
	var names []string
	err := sqlx.SelectContext(ctx, db, &names, `
		SELECT c.relname FROM pg_class c
		WHERE c.relnamespace = (SELECT relnamespace FROM pg_class WHERE oid = to_regclass($1))
		  AND c.relkind IN ('r', 'p') AND c.relname LIKE $2 ESCAPE '!'
		ORDER BY c.relname`,
		t.quoted(PostgreSQLPartitioned), strings.ReplaceAll(t.name, "_", "!_")+"!_p________")
	if err != nil {
		return nil, fmt.Errorf("list partitions: %w", err)
	}
	var parts []partition
	for _, name := range names {
		day, err := time.Parse("20060102", strings.TrimPrefix(name, t.name+"_p"))
		if err != nil {
			continue // a table that only looks like ours
		}
		parts = append(parts, partition{name: qualifiedName{schema: t.schema, name: name}, day: day})
	}
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
				p.name.quoted(PostgreSQLPartitioned)+")", p.day)
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
