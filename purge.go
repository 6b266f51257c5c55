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

// MaxPurgeBatchSize bounds PurgeConfig.BatchSize, so that no single DELETE
// holds locks long enough to stall live handlers.
const MaxPurgeBatchSize = 100_000

// PurgeConfig configures Purge.
type PurgeConfig struct {
	// DB is the database that holds the inbox table. Required.
	DB *sqlx.DB

	// Dialect is the SQL dialect of DB. Default: inferred from
	// DB.DriverName(), as in Config.
	Dialect Dialect

	// Table is the inbox table. Default: "watermill_inbox" (DefaultTable).
	// The same pattern as Config.Table applies (ErrInvalidTableName).
	Table string

	// OlderThan is the window: rows whose processed_at is more than
	// OlderThan before the database's current time are deleted. Required,
	// > 0, whole microseconds count. Choose it longer than the broker can
	// still redeliver a message (for Kafka: the topic's retention.ms, plus
	// the time a segment may outlive it, plus a margin): a message
	// redelivered after its row was purged is processed again.
	OlderThan time.Duration

	// BatchSize is the most rows one DELETE statement removes; each batch
	// is its own short transaction. Default: 1000 (DefaultPurgeBatchSize);
	// at most MaxPurgeBatchSize. Latency-sensitive consumers that purge
	// while they run do better with 100.
	BatchSize int

	// Pause is a sleep between two batches that leaves the database to the
	// live handlers, lowering the purge's share of its time. For the
	// handlers' tail latency a smaller BatchSize matters more (each batch's
	// burst of work and WAL is what a concurrent claim waits behind); see
	// docs/purge.md for measured numbers. Default: 0 (none).
	Pause time.Duration

	// Consumer, if set, restricts the purge to that consumer's rows.
	// Default: all consumers.
	Consumer string

	// Window, if set, tells the shortest safe window: how long the broker
	// can still redeliver a message (see the kafkaretention package, which
	// reads it from the topics' retention.ms and segment.ms). Purge asks it
	// first: an OlderThan shorter than the safe window is refused with
	// ErrWindowTooShort and nothing is deleted; a zero OlderThan means "use
	// the safe window". Its errors are returned wrapped.
	Window WindowSource

	hooks *hooks // test seams; nil outside tests
}

// WindowSource reports the shortest window after which the inbox rows of a
// consumer can no longer be needed, because the broker can no longer
// redeliver their messages. Implementations must be safe for concurrent use.
type WindowSource interface {
	SafeWindow(ctx context.Context) (time.Duration, error)
}

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
	if c.BatchSize < 0 || c.BatchSize > MaxPurgeBatchSize {
		errs = append(errs, fmt.Errorf("inbox: PurgeConfig.BatchSize must be between 1 and %d, got %d", MaxPurgeBatchSize, c.BatchSize))
	}
	if c.Consumer != "" {
		if err := checkKey(c.Consumer, ErrInvalidConsumer, nil, nil); err != nil {
			errs = append(errs, fmt.Errorf("PurgeConfig.Consumer: %w", err))
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
// batch comes back short or ctx ends. On PostgreSQL a batch skips rows that
// live transactions hold locked (FOR UPDATE SKIP LOCKED), so it never waits
// on a handler; on MySQL/MariaDB and SQLite a batch holds its locks only for
// its own short statement. The cutoff is recomputed for every batch.
//
// With a cfg.Window, the window is checked (or chosen) first; a window
// shorter than the safe one gives ErrWindowTooShort and deletes nothing.
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
		return 0, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	return purge(ctx, cfg.DB, cfg)
}

// purge runs a validated purge through db: the pool, or the one connection
// a Purger holds its lock on.
func purge(ctx context.Context, db dbConn, cfg PurgeConfig) (deleted int64, err error) {
	table, _ := parseTableName(cfg.Table)
	if cfg.OlderThan, err = checkWindow(ctx, cfg.Window, cfg.OlderThan); err != nil {
		return 0, fmt.Errorf("inbox: purge %s: %w", table, err)
	}
	query, args := purgeStatement(cfg.Dialect, table, cfg.OlderThan.Microseconds(), cfg.BatchSize, cfg.Consumer)
	for {
		if err := ctx.Err(); err != nil {
			return deleted, fmt.Errorf("inbox: purge %s: %w", table, err)
		}
		n, found, err := purgeBatchRetrying(ctx, db, cfg.Dialect, table, query, args, cfg.hooks)
		if err != nil {
			return deleted, fmt.Errorf("inbox: purge %s: delete batch: %w", table, err)
		}
		deleted += n
		if found < int64(cfg.BatchSize) {
			return deleted, nil
		}
		if cfg.Pause > 0 {
			select {
			case <-ctx.Done():
				return deleted, fmt.Errorf("inbox: purge %s: %w", table, ctx.Err())
			case <-time.After(cfg.Pause):
			}
		}
	}
}

// purgeBatchAttempts is how many times a batch runs before its error is
// returned, when every attempt fails with an error purgeRetryable accepts.
const purgeBatchAttempts = 5

// purgeRetryBackoff is the sleep before the second attempt of a batch; it
// doubles for every further one (10, 20, 40, 80 ms).
const purgeRetryBackoff = 10 * time.Millisecond

// purgeBatchRetrying runs one batch and runs it again, up to
// purgeBatchAttempts in all, when it lost a race with other transactions
// (purgeRetryable): a failed batch changed nothing (its statement or
// transaction was rolled back), and the next attempt picks its rows afresh.
// Any other error, and the last attempt's, is returned at once.
func purgeBatchRetrying(ctx context.Context, db dbConn, d Dialect, t qualifiedName, query string, args []any, h *hooks) (deleted, found int64, err error) {
	backoff := purgeRetryBackoff
	for attempt := 1; ; attempt++ {
		deleted, found, err = d.purgeBatch(ctx, db, t, query, args, h)
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
			return 0, 0, errors.Join(ctx.Err(), err)
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

// purgeStatement returns one batch's DELETE and its arguments: the window
// in microseconds, the batch size and, when set, the consumer.
func purgeStatement(d Dialect, t qualifiedName, window int64, batch int, consumer string) (string, []any) {
	args := []any{window}
	if consumer != "" {
		args = append(args, consumer)
	}
	return d.purgeSQL(t, consumer != ""), append(args, batch)
}

// checkWindow returns the window a purge of olderThan may use under the
// window source w: olderThan itself when it is at least w's safe window, the
// safe window when olderThan is 0, and an error wrapping ErrWindowTooShort
// otherwise. A source that reports less than 1µs is an error, not a licence
// to delete rows processed a moment ago. Without w, olderThan is returned.
func checkWindow(ctx context.Context, w WindowSource, olderThan time.Duration) (time.Duration, error) {
	if w == nil {
		return olderThan, nil
	}
	safe, err := w.SafeWindow(ctx)
	if err != nil {
		return 0, fmt.Errorf("safe window: %w", err)
	}
	if safe < time.Microsecond {
		return 0, fmt.Errorf("safe window: the window source reported %v; refusing to purge", safe)
	}
	if olderThan == 0 {
		return safe, nil
	}
	if olderThan < safe {
		return 0, fmt.Errorf("%w: %v is shorter than the safe window %v", ErrWindowTooShort, olderThan, safe)
	}
	return olderThan, nil
}
