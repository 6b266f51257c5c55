package inbox

import (
	"context"
	"errors"

	"github.com/jmoiron/sqlx"
)

// Table returns the outbox table's name as configured: OutboxConfig.Table,
// or DefaultOutboxTable when that was empty. The metrics module labels the
// outbox's series with it. Safe for concurrent use.
func (o *Outbox) Table() string { return o.cfg.Table }

// DeadLetterTable returns the dead-letter table's name, in the schema of
// the outbox table and qualified as Table is: "<table>_dead", or, when that
// would pass 63 bytes (PostgreSQL's identifier limit; the same name on
// every database), the table's name cut short with "_<FNV-1a hash of the
// name>_dead" (8 hex digits). Use it in the SQL that moves a set-aside
// message back (docs/operations.md). Safe for concurrent use.
func (o *Outbox) DeadLetterTable() string {
	if o.configured.table.schema == "" {
		return o.configured.dead.name
	}
	return o.configured.table.schema + "." + o.configured.dead.name
}

// ReadOutboxStats reads the OutboxStats of the outbox table and its
// dead-letter table ("<table>_dead") on db, as Outbox.Stats does, without an
// Outbox (which needs a Publisher): for tools that watch an outbox they do
// not relay, such as the inbox command. d nil: inferred from db's driver
// name; table "": DefaultOutboxTable. When the outbox or its dead-letter
// table does not exist, the error wraps ErrTableNotFound and names it
// (create both with Outbox.InitializeSchema or Outbox.SchemaSQL); an
// invalid table name wraps ErrInvalidTableName; a dialect for another
// database server than db's wraps ErrDialectMismatch; other errors wrap the
// driver's. It identifies the server (SELECT version() or
// sqlite_version()) and runs Outbox.Stats's three read-only statements
// (and, only after an error, reads the catalog to tell a missing table);
// safe for concurrent use. As Outbox.Stats, on the error of a count it
// returns what it read before, with -1 for what it could not count.
func ReadOutboxStats(ctx context.Context, db *sqlx.DB, d Dialect, table string) (OutboxStats, error) {
	if db == nil {
		return OutboxStats{}, errors.New("inbox: ReadOutboxStats needs a DB")
	}
	if table == "" {
		table = DefaultOutboxTable
	}
	inferred := d == nil
	d, t, err := resolveTarget(db, d, table)
	if err != nil {
		return OutboxStats{}, err
	}
	o := newOutbox(OutboxConfig{DB: db, Dialect: d, Table: table}, t)
	o.dialectInferred = inferred
	st, err := o.Stats(ctx)
	if errors.Is(err, ErrDialectMismatch) {
		return st, err
	}
	if err == nil {
		return st, nil
	}
	// Tell a missing table from the catalog (Outbox.Verify), never from
	// the error's text.
	if verr := o.Verify(ctx); errors.Is(verr, ErrTableNotFound) {
		return OutboxStats{}, verr
	}
	return st, err
}
