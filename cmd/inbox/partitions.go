package main

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/inbox"
)

// partitionsCmd lists the partitions of a PostgreSQLPartitioned table and
// its interval, gives a new table partitions of an interval (-interval),
// or switches an existing one to another (-interval with -migrate).
func partitionsCmd(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var c common
	fs := newFlags("partitions", stderr, &c, true)
	interval := fs.String("interval", "", "day or week: create the table if missing and its partitions at this interval"+
		" (refused when the table's partitions have another; see -migrate)")
	migrate := fs.Bool("migrate", false, "with -interval: switch the table's new partitions to it; the existing ones age out")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *migrate && *interval == "" {
		return fmt.Errorf("%w: -migrate needs -interval", errUsage)
	}
	var iv inbox.PartitionInterval
	if *interval != "" {
		var err error
		if iv, err = inbox.ParsePartitionInterval(*interval); err != nil {
			return fmt.Errorf("%w: -interval: %v", errUsage, err)
		}
	}
	if c.dialect == "" {
		c.dialect = "postgres-partitioned"
	}
	db, d, err := c.open(ctx, false)
	if err != nil {
		return err
	}
	defer db.Close()
	if d != inbox.PostgreSQLPartitioned || db.DriverName() != "pgx" {
		return fmt.Errorf("%w: partitions needs a PostgreSQL -db and -dialect postgres-partitioned", errUsage)
	}
	switch {
	case *migrate:
		err = inbox.MigratePartitionInterval(ctx, db, c.table, iv)
	case iv != "":
		err = inbox.InitializePartitions(ctx, db, c.table, iv)
	}
	if err != nil {
		return err
	}
	// A table that is missing or not partitioned was listed as one with
	// "none yet" and 0 partitions, exit 0: a mistyped -table went
	// unnoticed.
	// Quoted as the library quotes it: to_regclass folds an unquoted
	// Billing_Inbox to billing_inbox, another table.
	regclass := pgx.Identifier(strings.Split(c.table, ".")).Sanitize()
	var kind sql.NullString
	if err := db.QueryRowContext(ctx, "SELECT (SELECT relkind::text FROM pg_catalog.pg_class WHERE oid = to_regclass($1))", regclass).Scan(&kind); err != nil {
		return fmt.Errorf("inbox: partitions of %s: read the table's kind: %w", c.table, err)
	}
	switch {
	case !kind.Valid:
		return fmt.Errorf("%w: table %s does not exist: create it partitioned with -interval day (or week)", inbox.ErrTableNotFound, c.table)
	case kind.String != "p":
		return fmt.Errorf("%w: %s is not a partitioned table: inbox partitions lists and makes the partitions of a"+
			" postgres-partitioned table (inbox schema -verify -dialect postgres-partitioned -table %s prints a migration"+
			" script to one)", inbox.ErrIncompatibleTable, c.table, c.table)
	}
	got, err := inbox.TablePartitionInterval(ctx, db, c.table)
	if err != nil {
		return err
	}
	if got == "" {
		got = "none yet (new partitions: " + inbox.DefaultPartitionInterval + ")"
	}
	var parts []struct {
		Name  string `db:"name"`
		Bound string `db:"bound"`
	}
	err = db.SelectContext(ctx, &parts, `SELECT c.oid::regclass::text AS name, pg_get_expr(c.relpartbound, c.oid) AS bound
		FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass($1)
		ORDER BY pg_get_expr(c.relpartbound, c.oid)`, regclass)
	if err != nil {
		return fmt.Errorf("inbox: list partitions of %s: %w", c.table, err)
	}
	fmt.Fprintf(stdout, "%s: partition interval %s, %d partitions\n", c.table, got, len(parts))
	for _, p := range parts {
		fmt.Fprintf(stdout, "  %s  %s\n", p.Name, p.Bound)
	}
	return nil
}
