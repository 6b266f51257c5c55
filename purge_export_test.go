package inbox

import (
	"context"
	"time"

	"github.com/jmoiron/sqlx"
)

// Test hooks into the purge's pacing, for the external tests.

// WithPurgeBatchHooks returns cfg with before run before each purge batch
// and onPause run after each full batch with the batch's duration and the
// pause the pacing chose. Either may be nil.
func WithPurgeBatchHooks(cfg PurgeConfig, before func(), onPause func(batch, pause time.Duration)) PurgeConfig {
	h := &hooks{beforePurgeBatch: before, onPurgePause: onPause}
	if cfg.hooks != nil {
		h.afterPurgeSelect = cfg.hooks.afterPurgeSelect
	}
	cfg.hooks = h
	return cfg
}

// WithPurgerBatchHooks is WithPurgeBatchHooks for the purge of a Purger's
// rounds; call it before the first round.
func WithPurgerBatchHooks(p *Purger, before func(), onPause func(batch, pause time.Duration)) {
	p.cfg.Purge = WithPurgeBatchHooks(p.cfg.Purge, before, onPause)
}

// PurgeLockKey is the purge lock key of p's table, as the database
// resolves its name: on PostgreSQL the 64-bit advisory lock key, on MySQL
// the key in the GET_LOCK name (MySQLPurgeLockName).
func PurgeLockKey(ctx context.Context, db *sqlx.DB, p *Purger) (int64, error) {
	ct, err := canonicalTable(ctx, db, p.dialect, p.table)
	if err != nil {
		return 0, err
	}
	return purgeLockKey(ct), nil
}

// MySQLPurgeLockName is the GET_LOCK name of a purge lock key.
var MySQLPurgeLockName = mysqlLockName
