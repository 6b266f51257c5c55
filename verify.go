package inbox

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
)

// Verify checks that the inbox table exists and has the shape the inbox
// relies on, reading only the catalog (no DDL, no lock on the table). It
// returns nil for a table made by InitializeSchema or from schema/, an error
// wrapping ErrTableNotFound for a missing table, and one wrapping
// ErrIncompatibleTable that names every problem and the DDL that fixes it
// for a table that could merge, truncate or reject message ids (see
// ErrIncompatibleTable). Other errors are the database's, wrapped.
//
// Call it at startup when your migrations own the table, before the router
// consumes (or add Inbox.RouterPlugin to the router), so that a missing or
// wrong table stops the process instead of nacking every message. The
// middleware runs the same check once before its first claim, and
// InitializeSchema runs it on a table that already exists. It is safe for
// concurrent use and works behind a transaction-mode connection pooler (on
// PostgreSQL it reads in one short transaction).
//
// With Config.OutboxTables it also checks that each of those tables exists
// (an error wrapping ErrTableNotFound that names the outbox table). A
// prepared-statement error that a transaction-mode pooler causes (SQLSTATE
// 42P05 or 26000, pgx's default statement cache behind PgBouncer) comes
// back with the fix.
func (ib *Inbox) Verify(ctx context.Context) error {
	if err := ib.verifyTables(ctx); err != nil {
		return err
	}
	ib.verified.Store(true) // the middleware need not check again
	return nil
}

// verifyTables checks the inbox table and Config.OutboxTables, in one
// read-only unit of work.
func (ib *Inbox) verifyTables(ctx context.Context) error {
	err := withReadTx(ctx, ib.db, ib.dialect, func(q sqlx.QueryerContext) error {
		if err := verifyTable(ctx, q, ib.dialect, ib.table); err != nil {
			return err
		}
		return verifyOutboxTables(ctx, q, ib.dialect, ib.outboxTables)
	})
	return poolerHint(err)
}

// VerifyTimeout bounds the check that Inbox.RouterPlugin runs.
const VerifyTimeout = 30 * time.Second

// RouterPlugin is a Watermill router plugin that runs Verify before the
// router subscribes to anything: add it with router.AddPlugin(ib.RouterPlugin),
// and router.Run returns Verify's error (errors.Is matches ErrTableNotFound
// and ErrIncompatibleTable through the router's wrapping; the outbox tables
// of Config.OutboxTables are checked too) instead of
// starting handlers that would nack every message. The check is bounded by
// VerifyTimeout. Router plugins run once, in router.Run, before its
// handlers start (a Watermill convention).
func (ib *Inbox) RouterPlugin(*message.Router) error {
	ctx, cancel := context.WithTimeout(context.Background(), VerifyTimeout)
	defer cancel()
	return ib.Verify(ctx)
}

// verifySchema runs verifyTable in a read-only unit of work.
func verifySchema(ctx context.Context, db *sqlx.DB, d Dialect, t qualifiedName) error {
	return withReadTx(ctx, db, d, func(q sqlx.QueryerContext) error {
		return verifyTable(ctx, q, d, t)
	})
}

// verifyTable checks table t through q (catalog reads only) with
// d.checkTable. A missing table gives an error wrapping ErrTableNotFound
// with the DDL that creates it; problems give one error wrapping
// ErrIncompatibleTable that lists each with its fix, then the canonical DDL.
func verifyTable(ctx context.Context, q sqlx.QueryerContext, d Dialect, t qualifiedName) error {
	problems, err := d.checkTable(ctx, q, t)
	canonical, _ := SchemaSQL(d, t.String()) // t passed the name pattern
	switch {
	case errors.Is(err, ErrTableNotFound):
		return fmt.Errorf("%w: run InitializeSchema, or apply the DDL of SchemaSQL:\n%s", err, canonical)
	case err != nil:
		return fmt.Errorf("inbox: verify table %q: %w", t.String(), err)
	case len(problems) == 0:
		return nil
	}
	var b strings.Builder
	plural := "s"
	if len(problems) == 1 {
		plural = ""
	}
	fmt.Fprintf(&b, "table %q (%s) has %d problem%s:", t.String(), d, len(problems), plural)
	// A fix of several lines (a table to recreate) is printed once, below
	// the list, however many problems it fixes.
	var scripts []string
	for _, p := range problems {
		if !strings.Contains(p.fix, "\n") {
			fmt.Fprintf(&b, "\n  - %s; fix: %s", p.what, p.fix)
			continue
		}
		n := slices.Index(scripts, p.fix)
		if n < 0 {
			scripts, n = append(scripts, p.fix), len(scripts)
		}
		fmt.Fprintf(&b, "\n  - %s; fix: script %d below", p.what, n+1)
	}
	for i, s := range scripts {
		fmt.Fprintf(&b, "\nscript %d:\n%s", i+1, s)
	}
	fmt.Fprintf(&b, "\ncanonical DDL for comparison:\n%s", canonical)
	return fmt.Errorf("%w: %s", ErrIncompatibleTable, b.String())
}

// nameList formats names for a message: ("consumer", "message_id").
func nameList(names []string) string {
	quoted := make([]string, len(names))
	for i, n := range names {
		quoted[i] = strconv.Quote(n)
	}
	return "(" + strings.Join(quoted, ", ") + ")"
}

// tableProblem is one thing wrong with an existing inbox table.
type tableProblem struct {
	what string // what is wrong, e.g. `column "message_id" has collation "utf8mb4_general_ci", which compares case-insensitively`
	fix  string // the DDL that fixes it, e.g. "ALTER TABLE ... MODIFY ..."; several lines for a table to recreate
}

// problems collects tableProblems.
type problems []tableProblem

func (ps *problems) add(fix, format string, args ...any) {
	*ps = append(*ps, tableProblem{what: fmt.Sprintf(format, args...), fix: fix})
}

// tableNotFound is checkTable's error for a missing table.
func tableNotFound(t qualifiedName) error {
	return fmt.Errorf("%w: %q", ErrTableNotFound, t.String())
}

// oldName is the name a recreate script renames t to: t's name with
// "_old", within 63 bytes.
func oldName(t qualifiedName) qualifiedName {
	name := t.name
	if len(name) > 59 {
		name = name[:59]
	}
	return qualifiedName{schema: t.schema, name: name + "_old"}
}

// keyColumns is the primary key, in order; partitionedKey that of a
// PostgreSQLPartitioned table.
var (
	keyColumns     = []string{"consumer", "message_id"}
	partitionedKey = []string{"consumer", "message_id", "processed_at"}
)

const processedAt = "processed_at"

// --- PostgreSQL ---

// --- MySQL / MariaDB ---

// --- SQLite ---
