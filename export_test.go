package inbox

import (
	"context"
	"database/sql"
	"testing"
	"time"

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

// PurgeLock takes the purge lock of p through db, as another instance
// would, and returns the function that releases it.
func PurgeLock(ctx context.Context, db *sqlx.DB, p *Purger) (release func() error, got bool, err error) {
	lease, got, err := acquirePurgeLock(ctx, db, p.dialect, p.table, false)
	return lease.release, got, err
}

// SetAfterBegin makes ib call f right after it began a message's
// transaction, before any statement in it (the key lock, the claim). Call it
// before ib handles messages.
func SetAfterBegin(ib *Inbox, f func()) { ib.hooks = &hooks{afterBegin: f} }

// SetClaimFunctionRecheck sets how often ib, having found no claim
// function, looks for it again (claimFunctionRecheck). Call it before ib
// handles messages.
func SetClaimFunctionRecheck(ib *Inbox, d time.Duration) { ib.recheckKeyLocking = d }

// WithAfterPurgeSelect returns cfg with f run between each MySQL purge
// batch's read of its keys and its DELETE.
func WithAfterPurgeSelect(cfg PurgeConfig, f func()) PurgeConfig {
	cfg.hooks = &hooks{afterPurgeSelect: f}
	return cfg
}

// PurgeRetryable is purgeRetryable, for the external tests.
var PurgeRetryable = purgeRetryable

// DriverTxEnded is the pre-commit check's read of a driver connection's
// transaction status (dc from database/sql's Conn.Raw).
func DriverTxEnded(dc any) bool { ended, _ := driverTxEnded(dc); return ended }

// DriverTxStatus is driverTxEnded: whether dc's transaction has ended, and
// whether dc can tell.
func DriverTxStatus(dc any) (ended, known bool) { return driverTxEnded(dc) }

// SetTableBackoffHook makes ib call f with the wait of each delivery that
// met a missing or incompatible table, before the wait. Call it before ib
// handles messages.
func SetTableBackoffHook(ib *Inbox, f func(wait time.Duration)) { ib.hooks = &hooks{onTableBackoff: f} }

// SQLiteWritersQueued returns how many of this process's SQLite write
// transactions on db hold or wait for their place in its writerQueue (at
// most 1 while none waits).
func SQLiteWritersQueued(db *sql.DB) int { return len(sqliteWriterQueue(db)) }

// RecentFingerprints is the inbox's memory of the fingerprints it committed
// last, for its tests.
type RecentFingerprints struct{ r recentFingerprints }

// RecentFingerprintsSize is how many keys it holds.
const RecentFingerprintsSize = recentFingerprintsSize

func (r *RecentFingerprints) Remember(consumer, id string, fp []byte) { r.r.remember(consumer, id, fp) }
func (r *RecentFingerprints) Matches(consumer, id string, fp []byte) bool {
	return r.r.matches(consumer, id, fp)
}
func (r *RecentFingerprints) Len() int { return len(r.r.ring.byKey) }

// OutboxRetryFirst is the relay's first backoff after a failed round.
const OutboxRetryFirst = outboxRetryFirst

// DetachedPartitionComment marks a partition DropPartitions detached to
// drop it, for tests that leave one as an interrupted call would.
const DetachedPartitionComment = detachedPartitionComment

// DetachedPartitionMark is the comment DropPartitions marks a partition of
// table (schema-qualified) for [start, end) with before its DETACH.
func DetachedPartitionMark(table string, start, end time.Time) string {
	t, err := parseTableName(table)
	if err != nil {
		panic(err)
	}
	return detachedMark(t, start, end)
}

// DetachedPartitionMarkWithoutRange is the mark of the version before
// DetachedPartitionMark's, which named the inbox table but not the range.
func DetachedPartitionMarkWithoutRange(table string) string {
	t, err := parseTableName(table)
	if err != nil {
		panic(err)
	}
	return detachedPartitionComment + " from " + t.String()
}

// SetDetachWait sets how long a DETACH PARTITION waits for older
// transactions (dropPartitions) and returns the previous bound.
func SetDetachWait(d time.Duration) time.Duration { return time.Duration(detachWait.Swap(int64(d))) }

// SetRouterStartWarning sets after how long a RouterPlugin logs that the
// router is not running yet, and returns the previous value.
func SetRouterStartWarning(d time.Duration) time.Duration {
	return time.Duration(routerStartWarning.Swap(int64(d)))
}

// RelayRoundWhileTopicsWait runs one relay round of Run's kind, with
// topics waiting for their next try (a minute from now), and returns its
// outcome.
func (o *Outbox) RelayRoundWhileTopicsWait(ctx context.Context, topics []string) OutboxRound {
	until := time.Now().Add(time.Minute)
	for _, topic := range topics {
		o.topics.waits[topic] = topicWait{until: until, wait: time.Minute}
	}
	return o.relayOnce(ctx, o.topics).OutboxRound
}

// RelayRoundOfRun runs one relay round of Run's kind (the waiting topics
// as they are) and returns its outcome.
func (o *Outbox) RelayRoundOfRun(ctx context.Context) OutboxRound {
	return o.relayOnce(ctx, o.topics).OutboxRound
}

// EndTopicWait makes topic's wait for its next try end now.
func (o *Outbox) EndTopicWait(topic string) {
	o.topics.mu.Lock()
	defer o.topics.mu.Unlock()
	if w, ok := o.topics.waits[topic]; ok {
		w.until = time.Now()
		o.topics.waits[topic] = w
	}
}

// SetOutboxFloorSweep sets how often a relay round's floor probe reads from
// the head of the table, until the test ends.
func SetOutboxFloorSweep(t testing.TB, every time.Duration) {
	old := outboxFloorSweep
	outboxFloorSweep = every
	t.Cleanup(func() { outboxFloorSweep = old })
}

// WaitingTopicsFloor returns the id from which the relay's rounds read
// while topics wait (0: from the head of the table; see outboxFloor).
func (o *Outbox) WaitingTopicsFloor() int64 {
	o.relaying <- struct{}{}
	defer func() { <-o.relaying }()
	return o.floor.from
}

// OutboxFactoryCalls returns how many transactions' outbox factory calls
// the registry of writers holds (setPublisher): none once they returned.
func OutboxFactoryCalls() int {
	n := 0
	factoryWriters.Range(func(_, _ any) bool { n++; return true })
	return n
}
