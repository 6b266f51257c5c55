package inbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/jmoiron/sqlx"
)

// EstimateRows returns an estimate of the rows in the inbox table, cheap on
// large tables: the planner's statistics on PostgreSQL (pg_class.reltuples,
// summed over the partitions of a partitioned table, whichever PostgreSQL
// dialect d is; before a table's first ANALYZE, the statistics system's
// count of its live rows), information_schema.tables.table_rows
// on MySQL/MariaDB (InnoDB's estimate, which can be off by 40-50 %), and an
// exact COUNT(*) on SQLite, which keeps no estimate (SQLite tables are
// expected to be small enough). A nil d is inferred from db's driver name.
// table "" is DefaultTable. A missing table is an error.
func EstimateRows(ctx context.Context, db *sqlx.DB, d Dialect, table string) (int64, error) {
	d, t, err := resolveTarget(db, d, table)
	if err != nil {
		return 0, err
	}
	query, args := d.estimateRowsSQL(t)
	var n int64
	err = withReadTx(ctx, db, d, func(q sqlx.QueryerContext) error {
		return q.QueryRowxContext(ctx, query, args...).Scan(&n)
	})
	if err != nil {
		if err == sql.ErrNoRows {
			return 0, fmt.Errorf("inbox: estimate rows of %s: no such table", t)
		}
		return 0, fmt.Errorf("inbox: estimate rows of %s: %w", t, err)
	}
	return n, nil
}

// TableStats describes an inbox table, for operators.
type TableStats struct {
	// Consumers maps each consumer to its number of rows (exact: a COUNT
	// grouped by consumer, which reads the whole primary key index).
	Consumers map[string]int64
	// Rows is the sum of Consumers.
	Rows int64
	// Oldest and Newest are the smallest and largest processed_at, in UTC;
	// zero when the table is empty.
	Oldest, Newest time.Time
	// ReadAt is the database clock's time of the read, in UTC: the ages of
	// Oldest and Newest are ReadAt minus them, by the clock processed_at
	// and the purge's cutoff go by (a host whose clock is off by hours
	// measured them by its own).
	ReadAt time.Time
	// SizeBytes is the table's size on disk with its indexes, where the
	// database tells (PostgreSQL: pg_total_relation_size, summed over
	// partitions; MySQL: information_schema data_length + index_length;
	// SQLite: the pages of its B-trees, from the dbstat virtual table,
	// which modernc.org/sqlite has); -1 if not.
	SizeBytes int64
}

// Stats reads TableStats of the inbox table. It scans the primary key index
// (COUNT per consumer), so on very large tables prefer EstimateRows for
// dashboards. d nil: inferred from db; table "": DefaultTable. A table that
// does not exist is an error wrapping ErrTableNotFound.
func Stats(ctx context.Context, db *sqlx.DB, d Dialect, table string) (TableStats, error) {
	d, t, err := resolveTarget(db, d, table)
	if err != nil {
		return TableStats{}, err
	}
	st := TableStats{Consumers: map[string]int64{}, SizeBytes: -1}
	if _, err := sessionProblem(ctx, db, d.server(), sessionReads, "Stats' DB"); err != nil {
		return st, fmt.Errorf("inbox: stats of %s: %w", t, err)
	}
	err = withReadTx(ctx, db, d, func(q sqlx.QueryerContext) error { return readStats(ctx, q, d, t, &st) })
	if err != nil {
		// The driver's "does not exist", as an error callers can match.
		if cerr := tableExists(ctx, db, d, t); errors.Is(cerr, ErrTableNotFound) {
			err = cerr
		}
		return st, fmt.Errorf("inbox: stats of %s: %w", t, err)
	}
	return st, nil
}

func readStats(ctx context.Context, q sqlx.QueryerContext, d Dialect, t qualifiedName, st *TableStats) error {
	var rows []struct {
		Consumer string `db:"consumer"`
		N        int64  `db:"n"`
	}
	if err := sqlx.SelectContext(ctx, q, &rows, "SELECT consumer, COUNT(*) AS n FROM "+t.quoted(d)+" GROUP BY consumer"); err != nil {
		return err
	}
	for _, r := range rows {
		st.Consumers[r.Consumer] = r.N
		st.Rows += r.N
	}
	// Oldest, newest and now, as Unix microseconds in every dialect.
	var lo, hi sql.NullInt64
	var now int64
	if err := q.QueryRowxContext(ctx, d.spanSQL(t)).Scan(&lo, &hi, &now); err != nil {
		return err
	}
	st.ReadAt = time.UnixMicro(now).UTC()
	if lo.Valid {
		st.Oldest, st.Newest = time.UnixMicro(lo.Int64).UTC(), time.UnixMicro(hi.Int64).UTC()
	}
	// The size is best effort, and read last (on PostgreSQL a failure
	// aborts the transaction): a failure leaves SizeBytes at -1.
	sizeSQL, args := d.sizeSQL(t)
	var size sql.NullInt64
	if err := q.QueryRowxContext(ctx, sizeSQL, args...).Scan(&size); err == nil && size.Valid {
		st.SizeBytes = size.Int64
	}
	return nil
}

// OldestRowAge returns how long ago the oldest row of the inbox table was
// processed, of consumer's rows when consumer is not "", by the database
// clock (the one processed_at and the purge's cutoff go by), and false when
// there is no such row: what a Purger round limited to that consumer
// (PurgeConfig.Consumer) measures as PurgeRound.OldestAge on a table that
// is not partitioned. It reads MIN(processed_at): on a table that consumers
// with different windows share, give it the index docs/purge.md names.
// Errors: an invalid consumer wraps ErrInvalidConsumer. d nil: inferred
// from db; table "": DefaultTable.
func OldestRowAge(ctx context.Context, db *sqlx.DB, d Dialect, table, consumer string) (time.Duration, bool, error) {
	if consumer != "" {
		if err := checkKey(consumer, ErrInvalidConsumer, nil, nil); err != nil {
			return 0, false, fmt.Errorf("inbox: oldest row: %w", err)
		}
	}
	d, t, err := resolveTarget(db, d, table)
	if err != nil {
		return 0, false, err
	}
	query, args := d.oldestAgeSQL(t, consumer)
	var us sql.NullInt64
	err = withReadTx(ctx, db, d, func(q sqlx.QueryerContext) error {
		return q.QueryRowxContext(ctx, query, args...).Scan(&us)
	})
	if err != nil {
		return 0, false, fmt.Errorf("inbox: oldest row of %s: %w", t, err)
	}
	if !us.Valid {
		return 0, false, nil
	}
	return time.Duration(max(us.Int64, 0)) * time.Microsecond, true, nil
}

// CountExpired returns how many rows Purge with cfg would delete now (a
// dry run): rows older than cfg.OlderThan by the database clock, of
// cfg.Consumer if set. cfg.Window is checked as Purge checks it.
func CountExpired(ctx context.Context, cfg PurgeConfig) (int64, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return 0, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	t, _ := parseTableName(cfg.Table)
	var err error
	if cfg.OlderThan, err = checkWindow(ctx, cfg.Window, cfg.OlderThan); err != nil {
		return 0, fmt.Errorf("inbox: count expired in %s: %w", t, err)
	}
	q := t.quoted(cfg.Dialect)
	where := cfg.Dialect.expiredSQL(cfg.Consumer != "")
	args := []any{cfg.OlderThan.Microseconds()}
	if cfg.Consumer != "" {
		args = append(args, cfg.Consumer)
	}
	var n int64
	err = withReadTx(ctx, cfg.DB, cfg.Dialect, func(tx sqlx.QueryerContext) error {
		return tx.QueryRowxContext(ctx, "SELECT COUNT(*) FROM "+q+" WHERE "+where, args...).Scan(&n)
	})
	if err != nil {
		if terr := purgeTableExists(ctx, cfg.DB, cfg.Dialect, t); errors.Is(terr, ErrTableNotFound) {
			return 0, fmt.Errorf("inbox: count expired: %w", terr) // names PurgeConfig.Table, as Purge's does
		}
		return 0, fmt.Errorf("inbox: count expired in %s: %w", t, err)
	}
	return n, nil
}
