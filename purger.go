package inbox

import (
	"context"
	"database/sql/driver"
	"errors"
	"fmt"
	"hash/fnv"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
)

// DefaultPurgeInterval is PurgerConfig.Interval when it is zero.
const DefaultPurgeInterval = time.Hour

// PurgerConfig configures a Purger.
type PurgerConfig struct {
	// Purge is what every round deletes; see PurgeConfig. Required: DB and
	// OlderThan (or a Window).
	Purge PurgeConfig

	// Interval is the time between the start of one round and the next;
	// the first round runs at once. Default: 1 hour (DefaultPurgeInterval).
	Interval time.Duration

	// Logger receives one Info line per round (rows deleted, duration, the
	// window purged by, age of the oldest remaining row, batches, time
	// paused, back-offs and the effective duty cycle, or that another
	// instance had the lock) and an Error line for a failed round.
	// Default: the router's logger under RouterPlugin, otherwise
	// watermill.NopLogger.
	Logger watermill.LoggerAdapter

	// OnRound, if set, is called after every round with its outcome, for
	// metrics. It runs on the purger's goroutine. A panic in it is
	// recovered and logged (Logger). Default: nil.
	OnRound func(PurgeRound)
}

// PurgeRound is the outcome of one round of a Purger.
type PurgeRound struct {
	// Skipped is true when another instance held the purge lock, so this
	// one deleted nothing and measured nothing. A purge limited to one
	// consumer (PurgeConfig.Consumer) waits for the lock instead, and never
	// skips.
	Skipped bool
	// Deleted is the number of rows deleted (for PostgreSQLPartitioned,
	// the rows of the dropped partitions).
	Deleted int64
	// DroppedPartitions names the partitions dropped (PostgreSQLPartitioned).
	DroppedPartitions []string
	// Duration is how long the round took.
	Duration time.Duration
	// Window is the window the round purged by: rows processed longer ago
	// were expired. It is PurgeConfig.OlderThan, or, when OlderThan is 0,
	// the safe window that PurgeConfig.Window reported for this round
	// (a source such as kafkaretention asks the broker at every round, so
	// it changes when the topics' retention does). Set once the round has
	// checked its window, so also on a round that failed or was cancelled
	// afterwards; 0 for a skipped round and for one that failed before
	// (the purge lock, the table's checks, the window source's error,
	// ErrWindowTooShort, ErrWindowOutOfRange). For PostgreSQLPartitioned, a
	// partition is dropped once all of it is older than Window, so the
	// oldest row may be up to one partition interval older than Window.
	Window time.Duration
	// OldestAge is the age of the oldest row left in the table, of
	// PurgeConfig.Consumer's rows when the purge is limited to one (another
	// consumer's rows are not this purge's to delete; the whole table's made
	// a per-consumer purge look behind for good), by the database clock; 0
	// when there is none. For
	// PostgreSQLPartitioned it is how long ago the oldest non-empty
	// partition ended (0 while it has not): every row of it is at least
	// that old, and at most one partition interval older. It passes Window
	// only while a partition the purge should have dropped is still there,
	// as a deleting round's passes it only while rows it should have
	// deleted are, or by up to the round's own duration: a round deletes by
	// the cutoff of its window check (see Purge), and rows that aged past
	// the window while it ran are the next round's.
	OldestAge time.Duration
	// TableOldestAge is OldestAge of the whole table, every consumer's rows
	// counted: what another consumer's rows that no purge deletes (a table
	// shared with a consumer whose purger is missing or down) make grow
	// past every window, which OldestAge of a purge limited to one
	// consumer cannot show. Measured as OldestAge, by one more read when
	// the purge is limited to a consumer (an end of the processed_at index,
	// which a BRIN index on PostgreSQL cannot give: the read then scans the
	// table; for PostgreSQLPartitioned, the partitions' bounds); equal to
	// OldestAge otherwise. Set on a round that ended without error only.
	TableOldestAge time.Duration
	// Pacing is how the round paced its batches (PurgeConfig.DutyCycle):
	// batches, time in batches, time paused, back-offs and the effective
	// duty cycle. Zero for a skipped round and for PostgreSQLPartitioned,
	// whose rounds drop partitions instead of deleting in batches. Filled
	// in for a failed or cancelled round too, up to where it stopped.
	Pacing PurgePacing
	// Err is the round's error, nil on success.
	Err error
}

// Purger runs Purge periodically, until its context ends. For a
// partitioned PostgreSQL table (whatever PurgeConfig.Dialect says: one
// inferred from the driver is PostgreSQL) a round instead creates the
// partitions of the coming days and drops the partitions past the window
// (CreatePartitions, DropPartitions); a table whose partitions cannot be
// maintained (a DEFAULT partition, say) fails every round with
// ErrIncompatibleTable rather than grow unnoticed. Several instances
// of an application may run one against the same table at once: each round
// first takes a lock keyed by the table name, and an instance that does not
// get it skips the round instead of competing for the same rows (a purge
// limited to one consumer, PurgeConfig.Consumer, waits for it instead: the
// holder may be another consumer's purge, which does not do its work). On
// PostgreSQL it is a transaction-scoped advisory lock
// (pg_try_advisory_xact_lock) in a transaction held open for the round, so
// the exclusion holds behind a transaction-mode pooler such as PgBouncer;
// the round's statements run on other connections of the pool, so a round
// needs two (a pool limited to one fails the round with ErrInvalidConfig).
// On MySQL/MariaDB it is GET_LOCK, held on one connection for the round. On
// SQLite every writer is serialised by the database anyway, so no lock is
// taken.
//
// A round holds the lock while its purge pauses between batches (see
// PurgeConfig.DutyCycle), so a paced round lasts longer and other instances
// skip, and DropPartitions waits, for as long. The lock holds nothing else
// back: on PostgreSQL its transaction is idle in between, with no
// transaction id and no snapshot (pg_stat_activity shows backend_xid and
// backend_xmin NULL), so it holds back neither vacuum nor the wait of
// DETACH PARTITION ... CONCURRENTLY for older snapshots, and it takes no
// lock on the table; on MySQL/MariaDB GET_LOCK is a session lock, and every
// batch on that session commits before the pause, so it holds back no
// purge of undo logs.
// A Purger is safe for concurrent use, but one Run at a time is what
// it is made for.
type Purger struct {
	cfg     PurgerConfig
	table   qualifiedName
	dialect Dialect
	logger  *componentLogger
	running runs // RouterPlugin's goroutine, Run calls
}

// NewPurger checks cfg (the error wraps ErrInvalidConfig) and returns a
// Purger. It does not touch the database.
func NewPurger(cfg PurgerConfig) (*Purger, error) {
	cfg.Purge.setDefaults()
	if cfg.Interval == 0 {
		cfg.Interval = DefaultPurgeInterval
	}
	errs := []error{cfg.Purge.Validate()}
	if cfg.Interval < 0 {
		errs = append(errs, fmt.Errorf("inbox: PurgerConfig.Interval must be positive, got %v", cfg.Interval))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, invalidConfig(err)
	}
	table, _ := parseTableName(cfg.Purge.Table)
	p := &Purger{cfg: cfg, table: table, dialect: cfg.Purge.Dialect}
	p.logger = newComponentLogger(cfg.Logger, watermill.LogFields{"table": table.String()})
	return p, nil
}

// Run runs a round at once and then every Interval, until ctx ends; it then
// returns nil (the error result is for the router-plugin and errgroup
// shapes). A failed round is logged, reported to OnRound and retried at the
// next interval; it does not stop Run. Several Run calls, in one process or
// many, do not purge at once: each round takes the purge lock or is skipped.
func (p *Purger) Run(ctx context.Context) error {
	p.running.begin()
	defer p.running.end()
	ticker := time.NewTicker(p.cfg.Interval)
	defer ticker.Stop()
	for {
		p.RunOnce(ctx)
		select {
		case <-ctx.Done():
			return nil
		case <-ticker.C:
		}
	}
}

// WaitStopped returns nil once nothing of the Purger runs: the loop its
// RouterPlugin started has stopped (within a second of the router closing,
// its round cancelled) and no Run call is in progress; or the cause of
// ctx's end, if it ends first. router.Run does not wait for a plugin's
// goroutine: call it after router.Run returned and before closing the
// database, whose close would otherwise fail the round in progress. It
// returns at once when nothing runs. Safe for concurrent use.
func (p *Purger) WaitStopped(ctx context.Context) error { return p.running.wait(ctx) }

// RouterPluginStartTimeout is how long the RouterPlugin of a Purger or an
// Outbox waits for the router to start running before it logs at Error
// that it has not (the router's Run failed, or a plugin before it takes
// that long: migrations, a leader lock); it goes on waiting, and starts
// once the router runs. (It gave up for good: a router that took longer to
// start never got its outbox relayed nor its inbox purged.)
const RouterPluginStartTimeout = 5 * time.Minute

// routerStartWarning is RouterPluginStartTimeout in nanoseconds, shorter in
// tests.
var routerStartWarning atomic.Int64

func init() { routerStartWarning.Store(int64(RouterPluginStartTimeout)) }

// routerPollInterval is how often RouterPlugin checks whether the router
// was closed (Watermill offers no channel for it).
const routerPollInterval = 100 * time.Millisecond

// RouterPlugin runs the Purger for as long as the router runs: add it with
// router.AddPlugin(purger.RouterPlugin). The first round starts once the
// router is running; the purger stops within a second of the router closing,
// cancelling a round in progress, and nothing of it is left running then.
// If the router is closed before it ever ran (its Run failed after loading
// the plugin, then Close was called), the purger never starts; if it is
// neither running nor closed within RouterPluginStartTimeout, that is logged
// at Error and the purger starts whenever the router runs.
//
// Before the router starts, it checks that the table exists (bounded by
// VerifyTimeout): router.Run returns an error wrapping ErrTableNotFound
// when it does not (PurgeConfig.Table names another table than the
// inbox's Config.Table), instead of a purger whose every round fails. Any
// other error of that check is logged, and the rounds go on (a database
// that is down at startup). Without a PurgerConfig.Logger, the purger logs
// to the router's logger from then on.
func (p *Purger) RouterPlugin(r *message.Router) error {
	p.logger.adoptRouters(r)
	ctx, cancel := context.WithTimeout(context.Background(), VerifyTimeout)
	defer cancel()
	if err := p.checkTableExists(ctx); errors.Is(err, ErrTableNotFound) {
		return err
	} else if err != nil {
		p.logger.get().Error("Inbox purger: could not check that its table exists; its rounds will tell", err, nil)
	}
	runWhileRouterRuns(r, &p.running, p.logger.get(), "Inbox purger", func(ctx context.Context) { _ = p.Run(ctx) })
	return nil
}

// checkTableExists returns an error wrapping ErrTableNotFound, naming
// PurgeConfig.Table, when the purger's table does not exist.
func (p *Purger) checkTableExists(ctx context.Context) error {
	return purgeTableExists(ctx, p.cfg.Purge.DB, p.cfg.Purge.Dialect, p.table)
}

// runWhileRouterRuns runs run in a goroutine of its own from the moment r
// is running until r is closed (then cancels run's context and waits for
// it); never if r is closed before it ran. A router neither running nor
// closed within RouterPluginStartTimeout is logged at Error once (as what,
// "... not started yet"), and waited for still.
//
// The goroutine is counted in running from the moment it sees the router
// running until it ends, so that WaitStopped after router.Run returned
// waits for run: it counts itself, then looks whether the router is
// closed already (router.Run returns only once it is), and runs nothing
// if so. While it waits for the router to start it is not counted: a
// router.Run that failed (a plugin's error) neither closes the router nor
// starts it, and WaitStopped waited for RouterPluginStartTimeout.
func runWhileRouterRuns(r *message.Router, running *runs, logger watermill.LoggerAdapter, what string, run func(ctx context.Context)) {
	go func() {
		poll := time.NewTicker(routerPollInterval)
		defer poll.Stop()
		started := time.NewTimer(time.Duration(routerStartWarning.Load()))
		defer started.Stop()
	waitForRunning:
		for {
			select {
			case <-r.Running():
				break waitForRunning
			case <-poll.C:
				if r.IsClosed() {
					return
				}
			case <-started.C:
				logger.Error(what+" not started yet: the router is not running after "+time.Duration(routerStartWarning.Load()).String()+
					" (did its Run fail? then close it); it starts once the router runs", nil, nil)
			}
		}
		running.begin()
		defer running.end()
		if r.IsClosed() {
			return
		}
		ctx, cancel := context.WithCancel(context.Background())
		stopped := make(chan struct{})
		go func() {
			defer close(stopped)
			run(ctx)
		}()
		for range poll.C {
			if r.IsClosed() {
				break
			}
		}
		cancel()
		<-stopped
	}()
}

// RunOnce runs one round now: take the lock (or skip), purge, measure the
// oldest remaining row, log and report it. The round's error is also in the
// returned PurgeRound.
func (p *Purger) RunOnce(ctx context.Context) PurgeRound {
	start := time.Now()
	round := p.round(ctx)
	round.Err = poolerHint(round.Err) // pgx's statement cache behind a transaction-mode pooler: say the fix
	round.Duration = time.Since(start)
	// The table and, for a purge limited to one, the consumer: purgers of
	// consumers that share a table logged lines told apart only by their
	// windows.
	who := watermill.LogFields{"table": p.table.String()}
	if c := p.cfg.Purge.Consumer; c != "" {
		who["consumer"] = c
	}
	fields := who.Add(watermill.LogFields{
		"deleted": round.Deleted, "duration": round.Duration.String(), "window": round.Window.String(),
		"oldest_age": round.OldestAge.String(),
		"batches":    round.Pacing.Batches, "paused": round.Pacing.Paused.String(),
		"back_offs": round.Pacing.BackOffs, "duty_cycle": round.Pacing.DutyCycle,
	})
	if p.cfg.Purge.Consumer != "" {
		fields["table_oldest_age"] = round.TableOldestAge.String()
	}
	switch {
	case round.Err != nil && ctx.Err() == nil:
		p.logger.get().Error("Inbox purge round failed", round.Err, fields)
	case round.Err != nil:
		// Stopping: not an error worth an Error line.
	case round.Skipped:
		p.logger.get().Info("Inbox purge round skipped: another instance holds the purge lock", who)
	default:
		p.logger.get().Info("Inbox purge round", fields)
	}
	if p.cfg.OnRound != nil {
		p.callOnRound(round)
	}
	return round
}

// callOnRound calls OnRound with r. A panic in it is logged, not
// propagated: Run's goroutine is the purger's own (under RouterPlugin
// too), where a panic ended the whole process.
func (p *Purger) callOnRound(r PurgeRound) {
	defer func() {
		if v := recover(); v != nil {
			p.logger.get().Error("Inbox purge OnRound panicked", fmt.Errorf("panic: %v", v), watermill.LogFields{"deleted": r.Deleted})
		}
	}()
	p.cfg.OnRound(r)
}

func (p *Purger) round(ctx context.Context) (round PurgeRound) {
	// A purge limited to one consumer waits for the lock instead of
	// skipping: the holder may be another consumer's purge of the table
	// (consumers with windows of their own), whose round does not do this
	// one's work; skipping, purgers of consumers sharing a table lost each
	// other's rounds, in one process as often as not. Waiting polls, holding
	// no connection between tries (PostgreSQL) or one on which the round
	// then works (MySQL), so a pool of two connections serves both.
	lease, got, err := acquirePurgeLock(ctx, p.cfg.Purge.DB, p.dialect, p.table, p.cfg.Purge.Consumer != "")
	if err != nil {
		return PurgeRound{Err: fmt.Errorf("inbox: purge lock: %w", err)}
	}
	if !got {
		return PurgeRound{Skipped: true}
	}
	defer func() {
		if err := lease.release(); err != nil && round.Err == nil {
			round.Err = fmt.Errorf("inbox: purge lock: %w", err)
		}
	}()
	cfg := p.cfg.Purge
	cfg.nextRound = p.cfg.Interval
	var pacing PurgePacing
	cfg.pacing = &pacing
	round = p.dialect.purgeRound(ctx, lease.work, cfg, p.table)
	round.Pacing = pacing
	return round
}

// purgeLockKey is the purge lock key of the resolved table name.
func purgeLockKey(t qualifiedName) int64 {
	h := fnv.New64a()
	h.Write([]byte("watermill-inbox purge " + t.String()))
	return int64(h.Sum64())
}

// purgeLease is a held purge lock: what a Purger round or DropPartitions
// runs under.
type purgeLease struct {
	// work is where the statements under the lock run: the pool on
	// PostgreSQL, the lock's own connection on MySQL, the pool on SQLite.
	work dbConn
	// release releases the lock (with a context of its own: the round's
	// may have ended). An error means the lock may have been lost before
	// the release (its connection broke).
	release func() error
}

// errBadConn makes database/sql discard a connection (driver.ErrBadConn).
var errBadConn = driver.ErrBadConn

// acquirePurgeLock takes the purge lock of table t, keyed by the name as
// the database resolves it (so instances that spell the table differently
// still exclude each other), as d does it (Dialect.purgeLock). Without
// wait, got is false when another instance holds it; with wait, it waits
// for it (until ctx ends).
func acquirePurgeLock(ctx context.Context, db *sqlx.DB, d Dialect, t qualifiedName, wait bool) (purgeLease, bool, error) {
	return d.purgeLock(ctx, db, t, wait)
}
