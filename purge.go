package inbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jmoiron/sqlx"
)

// DefaultPurgeBatchSize is PurgeConfig.BatchSize when it is zero.
const DefaultPurgeBatchSize = 1000

// DefaultPurgeDutyCycle is PurgeConfig.DutyCycle when it is zero.
const DefaultPurgeDutyCycle = 0.1

// DefaultPurgeMaxPause is PurgeConfig.MaxPause when it is zero.
const DefaultPurgeMaxPause = time.Second

// purgeBackOffLimit is the most the back-off multiplies the pacing pause by.
const purgeBackOffLimit = 8

// purgeCostWindow is how many of the latest full batches the pacer looks at
// for a batch's cost: the shortest of their durations (see purgePacer).
const purgeCostWindow = 8

// purgeSlowdown is how much the cost must rise above the recent baseline to
// count as a slowdown: 1.5 times.
const purgeSlowdown = 1.5

// purgeBaselineWeight is the weight of the newest cost in the baseline's
// moving average (an exponentially weighted mean over about the last 8
// batches).
const purgeBaselineWeight = 0.125

// MaxPurgeBatchSize bounds PurgeConfig.BatchSize, so that no single DELETE
// holds locks long enough to stall live handlers.
const MaxPurgeBatchSize = 100_000

// PurgeConfig configures Purge.
type PurgeConfig struct {
	// DB is the database that holds the inbox table. Required.
	DB *sqlx.DB

	// Dialect is the SQL dialect of DB. A PostgreSQL purge of a
	// partitioned table runs PostgreSQLPartitioned's batches (by primary
	// key) even when Dialect says PostgreSQL. Default: inferred from
	// DB.DriverName(), as in Config.
	Dialect Dialect

	// Table is the inbox table. Default: "watermill_inbox" (DefaultTable).
	// The same pattern as Config.Table applies (ErrInvalidTableName).
	Table string

	// OlderThan is the window: rows whose processed_at is more than
	// OlderThan before the database's current time are deleted, counted in
	// whole microseconds (a remainder below 1µs is dropped). Required: at
	// least 1µs, unless Window is set, where 0 means "use the safe window"
	// that Window reports, and a positive OlderThan shorter than that is
	// refused (ErrWindowTooShort). Negative, below 1µs, or 0 without a
	// Window: ErrInvalidConfig. Choose it longer than the broker can
	// still redeliver a message (for Kafka: the topic's retention.ms, plus
	// the time a segment may outlive it, plus a margin): a message
	// redelivered after its row was purged is processed again.
	OlderThan time.Duration

	// BatchSize is the most rows one DELETE statement removes; each batch
	// is its own short transaction. Default: 1000 (DefaultPurgeBatchSize);
	// at most MaxPurgeBatchSize. Latency-sensitive consumers that purge
	// while they run do better with 100.
	BatchSize int

	// DutyCycle paces the purge: the share of its wall time spent on the
	// batches' own work, the rest left to the live handlers. After a batch,
	// the purge pauses cost×(1−DutyCycle)/DutyCycle before the next one (at
	// 0.1, nine times the cost), where a batch's cost is the shortest of the
	// last 8 full batches' durations: a batch that waits for a core or a
	// lock behind busy handlers takes longer without costing the database
	// more (see purgePacer), so the effective duty cycle
	// (PurgePacing.DutyCycle, wall time in batches) is above DutyCycle on a
	// busy database. When the cost rises above 1.5 times its moving average
	// (all of the last 8 batches were slow: the database is busier), the
	// pause is doubled for every such batch, up to 8 times, and halves back
	// once a batch is fast again; each doubling is counted in
	// PurgePacing.BackOffs. The pacing pause is capped by MaxPause. Between
	// 0 and 1; 1 runs the batches back to back with no pacing pause and no
	// back-off (flat out, the behaviour before pacing existed; combine with
	// Pause 0 for no pause at all); NaN is refused.
	// Default: 0.1 (DefaultPurgeDutyCycle); the effective duty cycle is
	// then 0.15 to 0.4. Measured on 2 cores shared with 4 handlers
	// claiming back to back (BenchmarkPurgeUnderLoad, 1,000,000 rows, one
	// run of every mode, BENCHMARKS.md): PostgreSQL removed 14,700 rows/s
	// with the handlers' p99 at 1.10 times idle, MariaDB 4,200 at 1.11,
	// SQLite 2,600 at 1.27. Flat out takes SQLite's write lock from the
	// handlers for seconds under a light load.
	// See docs/purge.md for the trade-off curve (BenchmarkPurgePacingCurve)
	// and which setting suits which volume.
	DutyCycle float64

	// MaxPause caps one pacing pause (DutyCycle's pause, back-off
	// included), so that a single slow batch (a checkpoint, a lock wait)
	// does not stall the purge for long. It does not cap Pause. Must not be
	// negative. Default: 1 s (DefaultPurgeMaxPause).
	MaxPause time.Duration

	// Pause is a fixed sleep between two batches, added to DutyCycle's
	// pacing pause (DutyCycle 1 with a Pause is a fixed pause alone). For
	// the handlers' tail latency a smaller BatchSize and a lower DutyCycle
	// matter more; see docs/purge.md for measured numbers. Must not be
	// negative. Default: 0 (none besides the pacing).
	Pause time.Duration

	// Consumer, if set, restricts the purge to that consumer's rows. A
	// Purger round on a partitioned table then drops only the partitions
	// that hold no other consumer's row (consumers sharing a table may have
	// longer windows) and deletes the consumer's expired rows from the
	// others by primary key. Default: all consumers, every one by the one
	// window: Window (or OlderThan) must then cover every topic of every
	// consumer in the table, so give another service's consumers a table
	// of their own, or each a purge with its Consumer and its window.
	Consumer string

	// Window, if set, tells the shortest safe window: how long the broker
	// can still redeliver a message (see the kafkaretention package, which
	// reads it from the topics' retention.ms and segment.ms, the
	// jetstreamretention package, which reads a JetStream stream's MaxAge,
	// or FixedWindow for a window you state). Purge asks it
	// first: an OlderThan shorter than the safe window is refused with
	// ErrWindowTooShort and nothing is deleted; a zero OlderThan means "use
	// the safe window". Its errors are returned wrapped, and a safe window
	// below 1µs or above MaxSafeWindow is refused with ErrWindowOutOfRange;
	// either stops the purge before anything is deleted.
	Window WindowSource

	hooks  *hooks       // test seams; nil outside tests
	pacing *PurgePacing // where purge reports its pacing; nil: not reported
	// windowChecked is when a round began checking Window itself before
	// purge (then nil): the purge's cutoff is the database's time then less
	// OlderThan (purgeCutoff). Zero: the time purge starts.
	windowChecked time.Time
	// nextRound is how long until a Purger's next round (its Interval): a
	// partitioned table's partitions are made to outlast it. Zero: none.
	nextRound time.Duration
}

// PurgePacing is how a purge paced its batches (see PurgeConfig.DutyCycle):
// the totals of one Purge call or Purger round.
type PurgePacing struct {
	// Batches is the number of batches run, the last, short one included:
	// each a DELETE transaction of at most BatchSize rows (on a
	// partitioned table, a batch also passes the partitions with nothing
	// expired before it, and the last one looks for rows left).
	Batches int
	// BatchTime is the total time spent in batches, retries included.
	BatchTime time.Duration
	// Paused is the total time slept between batches: the pacing pauses,
	// back-off and Pause included. Every pause ends early when the
	// context ends.
	Paused time.Duration
	// BackOffs is how many batches found the cost (the shortest of the
	// last 8 full batches) above 1.5 times its recent baseline, that is all
	// 8 slow, each doubling the pacing pause that follows (up to 8 times);
	// always 0 at DutyCycle 1.
	BackOffs int
	// DutyCycle is the effective duty cycle, BatchTime / (BatchTime +
	// Paused): 1 when nothing paused, 0 when no batch ran. It is above the
	// configured DutyCycle by the share of the last batch, which no pause
	// follows, and when MaxPause capped a pause; below it after back-offs.
	DutyCycle float64
}

// add adds q's totals to p.
func (p *PurgePacing) add(q PurgePacing) {
	p.Batches += q.Batches
	p.BatchTime += q.BatchTime
	p.Paused += q.Paused
	p.BackOffs += q.BackOffs
	p.DutyCycle = 0
	if p.Batches > 0 {
		p.DutyCycle = float64(p.BatchTime) / float64(p.BatchTime+p.Paused)
	}
}

// WindowSource reports the shortest window after which the inbox rows of a
// consumer can no longer be needed, because the broker can no longer
// redeliver their messages. Implementations must be safe for concurrent use.
//
// Every purge checks what SafeWindow returns: an error stops the purge and
// is returned wrapped; a window below 1µs or above MaxSafeWindow stops it
// with ErrWindowOutOfRange. In both cases nothing is deleted. A broker that
// keeps messages without a time limit (or longer than MaxSafeWindow) has no
// safe window: report it with an error of your own, as kafkaretention and
// jetstreamretention do with their ErrNoSafeWindow, rather than a very
// long duration. Compute the window with arithmetic that cannot wrap: a sum
// that overflows time.Duration comes back short or negative.
type WindowSource interface {
	SafeWindow(ctx context.Context) (time.Duration, error)
}

// MaxSafeWindow is the longest safe window a WindowSource may report: 100
// years (36,500 days). A longer one stops the purge with
// ErrWindowOutOfRange. A time.Duration holds at most about 292 years, so a
// window near that is what arithmetic that saturated (or a retention meant
// as "forever", such as Kafka's retention.ms=9223372036854775807) produces;
// no broker redelivers a message after a century and no inbox row is that
// old, so a purge under such a window could delete nothing and would only
// hide a broken source. The bound also leaves a time.Duration room for a
// margin added to any window below it.
const MaxSafeWindow = 100 * 365 * 24 * time.Hour

func (c *PurgeConfig) setDefaults() {
	if c.Dialect == nil && c.DB != nil {
		c.Dialect, _ = dialectForDriver(c.DB.DriverName())
	}
	if c.Table == "" {
		c.Table = DefaultTable
	}
	if c.BatchSize == 0 {
		c.BatchSize = DefaultPurgeBatchSize
	}
	if c.DutyCycle == 0 {
		c.DutyCycle = DefaultPurgeDutyCycle
	}
	if c.MaxPause == 0 {
		c.MaxPause = DefaultPurgeMaxPause
	}
}

// Validate reports every problem of the configuration at once, joined with
// errors.Join; nil means valid. Zero optional fields are accepted as their
// defaults.
func (c PurgeConfig) Validate() error {
	errs := validateTarget("PurgeConfig", c.DB, c.Dialect, c.Table)
	if c.OlderThan < time.Microsecond && !(c.OlderThan == 0 && c.Window != nil) {
		errs = append(errs, fmt.Errorf("inbox: PurgeConfig.OlderThan must be at least 1µs (or 0 with a Window), got %v", c.OlderThan))
	}
	if c.Pause < 0 {
		errs = append(errs, fmt.Errorf("inbox: PurgeConfig.Pause must not be negative, got %v", c.Pause))
	}
	if !(c.DutyCycle >= 0 && c.DutyCycle <= 1) { // NaN fails both
		errs = append(errs, fmt.Errorf("inbox: PurgeConfig.DutyCycle must be between 0 (default) and 1 (flat out), got %v", c.DutyCycle))
	}
	if c.MaxPause < 0 {
		errs = append(errs, fmt.Errorf("inbox: PurgeConfig.MaxPause must not be negative, got %v", c.MaxPause))
	}
	if c.BatchSize < 0 || c.BatchSize > MaxPurgeBatchSize {
		errs = append(errs, fmt.Errorf("inbox: PurgeConfig.BatchSize must be between 1 and %d, got %d", MaxPurgeBatchSize, c.BatchSize))
	}
	if c.Consumer != "" {
		if err := checkKey(c.Consumer, ErrInvalidConsumer, nil, nil); err != nil {
			errs = append(errs, &wrapped{msg: "inbox: PurgeConfig.Consumer", err: err})
		}
	}
	return errors.Join(errs...)
}

// Purge deletes the inbox rows processed more than cfg.OlderThan ago, by the
// database's clock in UTC (neither the process's nor the session's time zone
// changes which rows go), and returns how many it deleted.
//
// It deletes in batches of at most cfg.BatchSize rows, oldest first, each one
// DELETE in its own transaction that uses the processed_at index, until a
// batch comes back short or ctx ends (on a PostgreSQL partitioned table,
// which has no such index: the oldest partition first, each in its primary
// key's order, until the last partition's batch comes back short). Between two batches it pauses as
// cfg.DutyCycle, cfg.MaxPause and cfg.Pause say (by default 9 times the
// shortest of the last 8 batches, at most 1 s, longer when they all slow down); no transaction,
// row lock or connection of the purge is held while it pauses. On PostgreSQL a batch is one
// DELETE that commits asynchronously (a crash may lose its last batches,
// which the next purge deletes again) and locks no row before deleting it:
// a handler's claim never holds an expired row, so the batch waits for no
// handler, only for another purge that chose the same rows, and a batch
// that lost rows that way counts the expired rows left to decide whether
// to go on. On MySQL/MariaDB and SQLite a batch holds its locks only for
// its own short statement.
//
// The cutoff is fixed when the purge starts: the database's time when it
// began its window check, less the window (one read of the database clock),
// and every batch deletes by it, however long it waits for a connection or
// a lock. Rows that pass it while the purge runs are left for the next
// purge, which checks cfg.Window again: a retention raised during a long
// purge counts from its next one, and a purge under steady inflow ends.
//
// With a cfg.Window, the window is checked first: a cfg.OlderThan of 0
// takes the safe window; one shorter than the safe window gives
// ErrWindowTooShort, a safe window out of range (below 1µs, above
// MaxSafeWindow) ErrWindowOutOfRange, and the source's own error (such as
// kafkaretention.ErrNoSafeWindow) is returned wrapped: each deletes nothing.
//
// A batch that fails because it lost a race with other transactions (a
// deadlock, a lock wait timeout, a serialization failure, SQLITE_BUSY; told
// by the driver's error code) changed nothing and is run again, up to 5
// attempts with a short backoff (10 to 80 ms).
//
// An invalid cfg gives an error wrapping ErrInvalidConfig. When ctx ends, or a
// batch fails for another reason or on its last attempt, Purge returns the
// rows deleted so far with the error (wrapping ctx.Err() or the driver's
// error); the batches that completed stay deleted.
// It is safe to run from several processes at once: the batches may then
// delete fewer rows each, never the wrong ones.
func Purge(ctx context.Context, cfg PurgeConfig) (deleted int64, err error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return 0, invalidConfig(err)
	}
	deleted, err = purge(ctx, cfg.DB, cfg)
	return deleted, poolerHint(err)
}

// purge runs a validated purge through db: the pool, or the one connection
// a Purger holds its lock on.
func purge(ctx context.Context, db dbConn, cfg PurgeConfig) (deleted int64, err error) {
	table, _ := parseTableName(cfg.Table)
	checked := cfg.windowChecked
	if checked.IsZero() {
		checked = time.Now() // before the source is asked: its window holds from then
	}
	if cfg.OlderThan, err = checkWindow(ctx, cfg.Window, cfg.OlderThan); err != nil {
		return 0, fmt.Errorf("inbox: purge %s: %w", table, err)
	}
	if cfg.Dialect, err = purgeDialect(ctx, db, cfg.Dialect, table); err != nil {
		return 0, fmt.Errorf("inbox: purge %s: %w", table, err)
	}
	if _, err := sessionProblem(ctx, db, cfg.Dialect.server(), sessionReads, "PurgeConfig.DB"); err != nil {
		return 0, fmt.Errorf("inbox: purge %s: %w", table, err)
	}
	cutoff, err := purgeCutoff(ctx, db, cfg.Dialect, cfg.OlderThan, checked)
	if err != nil {
		return 0, fmt.Errorf("inbox: purge %s: %w", table, err)
	}
	batch := cfg.Dialect.purgeStatement(table, cutoff, cfg.BatchSize, cfg.Consumer)
	pace := newPurgePacer(cfg)
	if cfg.pacing != nil {
		defer func() { cfg.pacing.add(pace.stats) }()
	}
	for {
		if err := ctx.Err(); err != nil {
			return deleted, fmt.Errorf("inbox: purge %s: %w", table, err)
		}
		start := time.Now()
		cfg.hooks.purgeBatchStarting()
		n, found, err := purgeBatchRetrying(ctx, db, cfg.Dialect, table, batch, cfg.hooks)
		took := time.Since(start)
		pace.stats.Batches++
		pace.stats.BatchTime += took
		deleted += n // a batch can fail after its delete committed (PostgreSQL's count of the rows left)
		if err != nil {
			if terr := purgeTableExists(ctx, db, cfg.Dialect, table); errors.Is(terr, ErrTableNotFound) {
				return deleted, terr // the driver's "does not exist" says nothing of PurgeConfig.Table
			}
			return deleted, fmt.Errorf("inbox: purge %s: delete batch: %w", table, err)
		}
		if found < int64(cfg.BatchSize) {
			return deleted, nil
		}
		pause := pace.next(took)
		cfg.hooks.purgePausing(took, pause)
		if pause > 0 {
			// The batch's transaction has ended: nothing of the purge is
			// held while it sleeps (a Purger's lock aside, see Purger).
			slept := time.Now()
			timer := time.NewTimer(pause)
			select {
			case <-ctx.Done():
				timer.Stop()
				pace.stats.Paused += time.Since(slept)
				return deleted, fmt.Errorf("inbox: purge %s: %w", table, ctx.Err())
			case <-timer.C:
			}
			pace.stats.Paused += time.Since(slept)
		}
	}
}

// purgeCutoff returns the cutoff of a purge whose window olderThan was
// checked at checked, in microseconds since the Unix epoch on the database
// clock: the database's time now less olderThan and the time since checked,
// measured once the read has returned, so that the cutoff is at or before
// the database's time at the check less the window. Every batch deletes by
// it. A cutoff that followed the clock (each batch's now() less the window)
// went on deleting rows as they aged past a window the source no longer
// gave (a retention raised while a long purge ran, a batch that waited for a
// pool connection or a lock: those messages were processed again when
// replayed); rows that pass the cutoff meanwhile wait for the next purge,
// which asks the source again. It also ends a purge that inflow would keep
// going.
func purgeCutoff(ctx context.Context, db dbConn, d Dialect, olderThan time.Duration, checked time.Time) (int64, error) {
	var now int64
	if err := db.QueryRowxContext(ctx, d.nowMicrosSQL()).Scan(&now); err != nil {
		return 0, fmt.Errorf("read the database clock: %w", err)
	}
	return now - olderThan.Microseconds() - time.Since(checked).Microseconds(), nil
}

// purgePacer computes the pauses between purge batches (see
// PurgeConfig.DutyCycle) and keeps the totals. Not safe for concurrent use:
// one per purge.
//
// A batch's cost is the shortest duration among the last purgeCostWindow
// full batches, not the latest batch's own: on a database kept busy by the
// handlers, a batch woken from its pause first waits for a core (and on
// SQLite and MariaDB, for a lock) behind them, which makes most batches take
// several times what the same work takes when it gets a core at once
// (PostgreSQL, 1,000 rows: 40 ms against 12 ms, BENCHMARKS.md). That wait
// is the handlers' work, not the purge's, and pacing by it would slow the
// purge to a fraction of its duty cycle while taking nothing more from the
// handlers. The shortest recent batch is the work itself; a slowdown of the
// database shows as a rise of that shortest batch, which needs every batch
// of the window to be slow: one slow batch (a checkpoint, a lock wait, a
// scheduler hiccup) changes nothing.
type purgePacer struct {
	ratio    float64       // pause per unit of cost: (1-duty)/duty
	maxPause time.Duration // cap of the pacing pause
	fixed    time.Duration // PurgeConfig.Pause, added uncapped
	recent   [purgeCostWindow]time.Duration
	n        int     // full batches seen
	baseline float64 // moving average of the cost, ns; 0: none yet
	backOff  float64 // multiplier of the pacing pause, 1 to purgeBackOffLimit
	stats    PurgePacing
}

func newPurgePacer(cfg PurgeConfig) *purgePacer {
	return &purgePacer{
		ratio:    (1 - cfg.DutyCycle) / cfg.DutyCycle,
		maxPause: cfg.MaxPause,
		fixed:    cfg.Pause,
		backOff:  1,
	}
}

// next returns the pause after a full batch that took took.
func (p *purgePacer) next(took time.Duration) time.Duration {
	if p.ratio == 0 { // DutyCycle 1: flat out, no pacing and no back-off
		return p.fixed
	}
	p.recent[p.n%purgeCostWindow] = took
	p.n++
	cost := took
	for _, d := range p.recent[:min(p.n, purgeCostWindow)] {
		cost = min(cost, d)
	}
	c := float64(cost)
	switch {
	case p.baseline > 0 && c > purgeSlowdown*p.baseline:
		p.backOff = min(2*p.backOff, purgeBackOffLimit)
		p.stats.BackOffs++
	default:
		p.backOff = max(1, p.backOff/2)
	}
	if p.baseline == 0 {
		p.baseline = c
	} else {
		p.baseline += purgeBaselineWeight * (c - p.baseline)
	}
	pause := time.Duration(min(c*p.ratio*p.backOff, float64(p.maxPause)))
	return pause + p.fixed
}

// purgeBatchAttempts is how many times a batch runs before its error is
// returned, when every attempt fails with an error purgeRetryable accepts.
const purgeBatchAttempts = 5

// purgeRetryBackoff is the sleep before the second attempt of a batch; it
// doubles for every further one (10, 20, 40, 80 ms).
const purgeRetryBackoff = 10 * time.Millisecond

// purgeBatchRetrying runs one batch and runs it again, up to
// purgeBatchAttempts in all, when it lost a race with other transactions
// (purgeRetryable): a failed batch's delete was rolled back, or, when it
// had committed (PostgreSQL: the count of the rows left failed), is counted
// in deleted; the next attempt picks its rows afresh. Any other error, and
// the last attempt's, is returned at once, with the rows deleted so far.
func purgeBatchRetrying(ctx context.Context, db dbConn, d Dialect, t qualifiedName, q purgeQuery, h *hooks) (deleted, found int64, err error) {
	backoff := purgeRetryBackoff
	for attempt := 1; ; attempt++ {
		var n int64
		n, found, err = d.purgeBatch(ctx, db, t, q, h)
		deleted += n
		if err == nil || attempt == purgeBatchAttempts || !purgeRetryable(err) || ctx.Err() != nil {
			if err != nil && attempt > 1 {
				err = fmt.Errorf("attempt %d of %d: %w", attempt, purgeBatchAttempts, err)
			}
			return deleted, found, err
		}
		select {
		case <-ctx.Done():
			// The context's error first, so errors.Is(err, context.Canceled)
			// holds as after any other stop; the conflict is kept too.
			return deleted, 0, errors.Join(ctx.Err(), err)
		case <-time.After(backoff):
		}
		backoff *= 2
	}
}

// purgeRetryable reports whether err says that a purge batch lost a race
// with other transactions and may simply run again: a deadlock, a lock wait
// timeout or a serialization failure (or, on SQLite, a database still busy
// after its busy_timeout), decided by driver error code (isConflict), never
// by the error's text. It looks through wrapping (errors.Unwrap,
// errors.Join).
func purgeRetryable(err error) bool { return isConflict(err) }

// checkWindow returns the window a purge of olderThan may use under the
// window source w: olderThan itself when it is at least w's safe window, the
// safe window when olderThan is 0, and an error wrapping ErrWindowTooShort
// otherwise. Every purge path (Purge, a Purger round, DropPartitions) calls
// it before it deletes anything. A source that reports less than 1µs is an
// error, not a licence to delete rows processed a moment ago, and one that
// reports more than MaxSafeWindow is an error too (an overflow, or a
// "forever" the source did not report as such): both wrap
// ErrWindowOutOfRange. Without w, olderThan is returned.
func checkWindow(ctx context.Context, w WindowSource, olderThan time.Duration) (time.Duration, error) {
	if w == nil {
		return olderThan, nil
	}
	safe, err := w.SafeWindow(ctx)
	if err != nil {
		return 0, fmt.Errorf("safe window: %w", err)
	}
	if safe < time.Microsecond || safe > MaxSafeWindow {
		return 0, fmt.Errorf("safe window: %w: the window source (%T) reported %v, outside 1µs to %v (MaxSafeWindow); "+
			"refusing to purge: fix the source, which must return an error when the broker keeps messages without a time limit",
			ErrWindowOutOfRange, w, safe, MaxSafeWindow)
	}
	if olderThan == 0 {
		return safe, nil
	}
	if olderThan < safe {
		return 0, fmt.Errorf("%w: %v is shorter than the safe window %v", ErrWindowTooShort, olderThan, safe)
	}
	return olderThan, nil
}

// purgeTableExists returns an error wrapping ErrTableNotFound, naming
// PurgeConfig.Table, when t does not exist; otherwise tableExists's
// result.
func purgeTableExists(ctx context.Context, db dbConn, d Dialect, t qualifiedName) error {
	err := tableExists(ctx, db, d, t)
	if errors.Is(err, ErrTableNotFound) {
		return fmt.Errorf("inbox: purge %s: %w: set PurgeConfig.Table to the inbox's table (Config.Table; default %s)",
			t, err, DefaultTable)
	}
	return err
}

// tableExists returns an error wrapping ErrTableNotFound when t does not
// exist, the error of the catalog read when it failed, nil otherwise; the
// table's shape is not judged. It reads the catalog in a read-only
// transaction (behind a transaction-mode pooler too).
func tableExists(ctx context.Context, db dbConn, d Dialect, t qualifiedName) error {
	return withReadTx(ctx, db, d, func(q sqlx.QueryerContext) error {
		_, err := d.checkTable(ctx, q, t)
		return err
	})
}
