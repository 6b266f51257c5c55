package inbox

import (
	"context"

	"github.com/jmoiron/sqlx"
)

// Test hooks into unexported code, for the external tests.

// SchemaExists reports whether table and its purge index both exist.
func SchemaExists(ctx context.Context, db *sqlx.DB, d Dialect, table string) (bool, error) {
	t, err := parseTableName(table)
	if err != nil {
		return false, err
	}
	n, err := schemaObjects(ctx, db, d, t)
	return n == 2, err
}

// CreateTableOnly creates table without its purge index.
func CreateTableOnly(ctx context.Context, db *sqlx.DB, d Dialect, table string) error {
	t, err := parseTableName(table)
	if err != nil {
		return err
	}
	if _, err := db.ExecContext(ctx, d.createSQL(t)[0]); err != nil {
		return err
	}
	if d == MySQL { // the index is inline in the CREATE TABLE
		_, err = db.ExecContext(ctx, "DROP INDEX "+d.quote(t.indexName())+" ON "+t.quoted(d))
	}
	return err
}

// PurgeLock takes the purge lock of p on conn, as another instance would.
func PurgeLock(ctx context.Context, conn *sqlx.Conn, p *Purger) (bool, error) {
	ct, err := canonicalTable(ctx, conn, p.dialect, p.table)
	if err != nil {
		return false, err
	}
	return p.lock(ctx, conn, purgeLockKey(ct))
}

// PurgeUnlock releases it.
func PurgeUnlock(conn *sqlx.Conn, p *Purger) error {
	ct, err := canonicalTable(context.Background(), conn, p.dialect, p.table)
	if err != nil {
		return err
	}
	return p.unlock(conn, purgeLockKey(ct))
}

// SetAfterBegin makes ib call f right after it began a message's
// transaction, before any statement in it (the key lock, the claim). Call it
// before ib handles messages.
func SetAfterBegin(ib *Inbox, f func()) { ib.afterBegin = f }

// SetAfterPurgeSelect sets the hook run between a MySQL purge batch's read
// of its keys and its DELETE; nil removes it. Not safe to use from parallel
// tests.
func SetAfterPurgeSelect(f func()) { afterPurgeSelect = f }
