package inbox

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/jmoiron/sqlx"
)

// EstimateRows returns an estimate of the rows in the inbox table, cheap on
// large tables: the planner's statistics on PostgreSQL (pg_class.reltuples,
// summed over the partitions for PostgreSQLPartitioned; -1 before the first
// ANALYZE or autovacuum, reported as 0), information_schema.tables.table_rows
// on MySQL/MariaDB (InnoDB's estimate, which can be off by 40-50 %), and an
// exact COUNT(*) on SQLite, which keeps no estimate (SQLite tables are
// expected to be small enough). A nil d is inferred from db's driver name.
// table "" is DefaultTable. A missing table is an error.
func EstimateRows(ctx context.Context, db *sqlx.DB, d Dialect, table string) (int64, error) {
	if d == nil {
		var err error
		if d, err = dialectForDriver(db.DriverName()); err != nil {
			return 0, err
		}
	}
	if table == "" {
		table = DefaultTable
	}
	t, err := parseTableName(table)
	if err != nil {
		return 0, err
	}
	var query string
	var args []any
	switch d {
	case PostgreSQL:
		query, args = "SELECT GREATEST(reltuples, 0)::bigint FROM pg_class WHERE oid = to_regclass($1)", []any{t.quoted(d)}
	case PostgreSQLPartitioned:
		query, args = `SELECT COALESCE(SUM(GREATEST(c.reltuples, 0)), 0)::bigint FROM pg_inherits i
			JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass($1)
			HAVING to_regclass($1) IS NOT NULL`, []any{t.quoted(d)}
	case MySQL:
		schema, where := "DATABASE()", []any{t.name}
		if t.schema != "" {
			schema, where = "?", []any{t.schema, t.name}
		}
		query, args = "SELECT COALESCE(table_rows, 0) FROM information_schema.tables WHERE table_schema = "+schema+" AND table_name = ?", where
	default:
		query = "SELECT COUNT(*) FROM " + t.quoted(d)
	}
	var n int64
	if err := db.QueryRowxContext(ctx, query, args...).Scan(&n); err != nil {
		if err == sql.ErrNoRows {
			return 0, fmt.Errorf("inbox: estimate rows of %s: no such table", t)
		}
		return 0, fmt.Errorf("inbox: estimate rows of %s: %w", t, err)
	}
	return n, nil
}
