// Package metrics exports the inbox's outcomes to Prometheus, wired from the
// inbox's hooks: messages processed, skipped as duplicates and failed, reused
// message ids, the
// inbox transaction's duration, purge rounds (by outcome, the last
// successful one's time, the window they purge by, rows purged, pacing), the
// age of the oldest row and an estimate of the table's size; and the outbox relay's: messages relayed,
// refused and set aside, failed rounds, the round's duration, and the
// outbox's depth, oldest unsent message and dead letters. It is a module of
// its own so that the inbox core does not depend on the Prometheus client.
//
//	m, err := metrics.New(prometheus.DefaultRegisterer)
//	ob, err := inbox.NewOutbox(m.InstrumentOutbox(inbox.OutboxConfig{DB: db, Publisher: broker}))
//	err = m.WatchOutbox(ob) // outbox depth, oldest unsent, dead letters, read at each scrape
//	ib, err := inbox.New(m.Instrument(inbox.Config{DB: db, Outbox: ob.Publisher}))
//	purger, err := inbox.NewPurger(m.InstrumentPurger(inbox.PurgerConfig{...}))
//	err = m.WatchTable(db, nil, "") // inbox_rows, estimated at each scrape
//
// Series of an outbox are labelled with its table; InstrumentOutbox reads
// OutboxConfig.Table, so set it before (inside) the call.
//
// Names follow Prometheus conventions (base units, _total for counters) and
// the label of Watermill's own metrics (handler_name).
package metrics

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/watermill-inbox/inbox"
)

// Outcome label values of inbox_messages_total and inbox_transaction_seconds.
const (
	OutcomeProcessed = "processed"
	OutcomeDuplicate = "duplicate"
	OutcomeFailed    = "failed"
)

// Action label values of inbox_reused_ids_total: what the inbox did with a
// delivery whose message id was processed before with other content
// (inbox.Config.ReusedIDs).
const (
	// ReusedIDRefused: nacked with inbox.ErrMessageIDReused (ReusedIDsRefuse).
	ReusedIDRefused = "refused"
	// ReusedIDSkipped: logged and skipped as a duplicate (ReusedIDsWarn).
	ReusedIDSkipped = "skipped"
)

// Outcome label values of inbox_purge_rounds_total.
const (
	// RoundOK is a purge round that ended without error.
	RoundOK = "ok"
	// RoundFailed is a purge round that ended with an error (its Error
	// log line says which), a stop of the purger aside.
	RoundFailed = OutcomeFailed
	// RoundSkipped is a purge round that did nothing because another
	// instance held the purge lock.
	RoundSkipped = "skipped"
)

// Metrics holds the inbox's collectors. Create it with New; it is safe for
// concurrent use, and one Metrics may instrument any number of inboxes.
type Metrics struct {
	reg       prometheus.Registerer
	messages  *prometheus.CounterVec
	reusedIDs *prometheus.CounterVec
	// reusedIDsDetected is 1 while the inbox detects reused ids, 0 while
	// it cannot (a table without the fingerprint column, where
	// inbox_reused_ids_total stays 0 whatever comes); not set for an
	// inbox whose Config.ReusedIDs is ReusedIDsOff.
	reusedIDsDetected *prometheus.GaugeVec
	// seen holds the handler and consumer pairs whose
	// inbox_reused_ids_total and inbox_messages_total series exist (each
	// outcome and action at 0 from their first message),
	// so that a dashboard or alert reads 0 rather than no data.
	seen         sync.Map
	txSeconds    *prometheus.HistogramVec
	purgeDeleted *prometheus.CounterVec
	oldestAge    *prometheus.GaugeVec
	// tableOldestAge is oldestAge of the whole table, every consumer's rows.
	tableOldestAge *prometheus.GaugeVec
	batches        *prometheus.CounterVec
	batchSeconds   *prometheus.CounterVec
	pausedSecs     *prometheus.CounterVec
	backOffs       *prometheus.CounterVec
	dutyCycle      *prometheus.GaugeVec
	rounds         *prometheus.CounterVec
	lastSuccess    *prometheus.GaugeVec
	window         *prometheus.GaugeVec
	outbox         outboxMetrics
	// watches are the collectors of WatchTable and WatchOutbox, by kind
	// and table, for UnwatchTable and UnwatchOutbox.
	watchMu sync.Mutex
	watches map[string]prometheus.Collector
}

// New creates the collectors and registers them with reg (for example
// prometheus.DefaultRegisterer). Registering twice with one registry fails
// with prometheus.AlreadyRegisteredError.
func New(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		reg: reg,
		messages: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "inbox_messages_total",
			Help: "Messages seen by the inbox middleware, by outcome: processed (committed), duplicate (skipped and acked) or failed (rolled back: every failed attempt, those the Retry middleware outside the inbox makes before the message is nacked included).",
		}, []string{"handler_name", "consumer", "outcome"}),
		reusedIDs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "inbox_reused_ids_total",
			Help: "Deliveries whose message id was processed before with other content (a producer reusing ids), by action: refused (nacked) or skipped (acked as a duplicate under ReusedIDsWarn).",
		}, []string{"handler_name", "consumer", "action"}),
		reusedIDsDetected: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "inbox_reused_ids_detected",
			Help: "1 while the inbox detects reused message ids, 0 while it cannot (the table has no fingerprint column: a reused id is then skipped as a duplicate and inbox_reused_ids_total cannot count it); set by each message that began a transaction; absent for an inbox whose Config.ReusedIDs is ReusedIDsOff (turned off on purpose).",
		}, []string{"handler_name", "consumer"}),
		txSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "inbox_transaction_seconds",
			Help:    "Time from BEGIN to the end of COMMIT or ROLLBACK of the inbox transaction, handler and the wait for a pool connection included (deliveries refused before BEGIN, as for a missing table, are not observed).",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 18), // 0.5 ms to ~65 s: past the default Timeout of an attempt (30 s)
		}, []string{"handler_name", "consumer", "outcome"}),
		purgeDeleted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "inbox_purge_rows_deleted_total",
			Help: "Inbox rows removed by purge rounds (deleted rows, or rows of dropped partitions), the committed batches of rounds that failed later included.",
		}, []string{"table", "consumer"}),
		oldestAge: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "inbox_oldest_row_age_seconds",
			Help: "Age of the oldest inbox row after the last purge round, by the database clock (a partitioned table: how long ago its oldest non-empty partition ended); 0 when empty.",
		}, []string{"table", "consumer"}),
		tableOldestAge: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "inbox_table_oldest_row_age_seconds",
			Help: "Age of the oldest row of the whole inbox table, every consumer's, after the last purge round (as inbox_oldest_row_age_seconds, which counts only the consumer a purge is limited to); 0 when empty.",
		}, []string{"table", "consumer"}),
		batches: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "inbox_purge_batches_total",
			Help: "Purge batches run by purge rounds, each a DELETE transaction of at most the batch size (on a partitioned table, passing the partitions with nothing expired before it).",
		}, []string{"table", "consumer"}),
		batchSeconds: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "inbox_purge_batch_seconds_total",
			Help: "Time purge rounds spent running batches, retries included.",
		}, []string{"table", "consumer"}),
		pausedSecs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "inbox_purge_paused_seconds_total",
			Help: "Time purge rounds paused between batches to leave the database to the handlers (pacing, back-off and fixed Pause).",
		}, []string{"table", "consumer"}),
		backOffs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "inbox_purge_backoffs_total",
			Help: "Purge batches slower than the recent baseline, each of which lengthened the pause after it.",
		}, []string{"table", "consumer"}),
		dutyCycle: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "inbox_purge_duty_cycle",
			Help: "Effective duty cycle of the last purge round that ran batches: time in batches / (time in batches + time paused).",
		}, []string{"table", "consumer"}),
		rounds: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "inbox_purge_rounds_total",
			Help: "Purge rounds by outcome: ok (ended without error), failed, or skipped (another instance held the purge lock).",
		}, []string{"table", "consumer", "outcome"}),
		lastSuccess: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "inbox_purge_last_success_timestamp_seconds",
			Help: "Unix time at which the last purge round that ended without error ended; 0 when none has since the process started.",
		}, []string{"table", "consumer"}),
		window: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "inbox_purge_window_seconds",
			Help: "Window the last purge round purged by (PurgeConfig.OlderThan, or the safe window its source reported): rows processed longer ago are expired.",
		}, []string{"table", "consumer"}),
	}
	m.outbox = newOutboxMetrics()
	for _, c := range append([]prometheus.Collector{m.messages, m.reusedIDs, m.reusedIDsDetected, m.txSeconds, m.purgeDeleted, m.oldestAge,
		m.tableOldestAge, m.batches, m.batchSeconds, m.pausedSecs, m.backOffs, m.dutyCycle, m.rounds, m.lastSuccess, m.window},
		m.outbox.collectors()...) {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// Instrument returns cfg with its OnProcessed, OnDuplicate, OnFailed and
// OnReusedID hooks recording to m (a reused id also counts as failed or
// duplicate in inbox_messages_total, by what the inbox did with it), and
// whether the inbox detects reused ids at all (inbox_reused_ids_detected,
// from Event.ReusedIDsDetected: 0 on a table without the fingerprint
// column, where inbox_reused_ids_total reads 0 whatever comes; not exported
// when cfg.ReusedIDs is ReusedIDsOff, a choice the InboxReusedIDsNotDetected
// alert would otherwise page for: set ReusedIDs before calling Instrument). Hooks
// already set in cfg still run, first; one that panics is still counted
// (the inbox logs the panic and changes no outcome: the count stopped with
// it, and an alert on a failing handler could not fire).
func (m *Metrics) Instrument(cfg inbox.Config) inbox.Config {
	detects := cfg.ReusedIDs != inbox.ReusedIDsOff
	cfg.OnProcessed = m.hook(cfg.OnProcessed, OutcomeProcessed, detects)
	cfg.OnDuplicate = m.hook(cfg.OnDuplicate, OutcomeDuplicate, detects)
	cfg.OnFailed = m.hook(cfg.OnFailed, OutcomeFailed, detects)
	next := cfg.OnReusedID
	cfg.OnReusedID = func(e inbox.Event) {
		defer func() {
			action := ReusedIDSkipped
			if e.Err != nil {
				action = ReusedIDRefused
			}
			m.reusedIDs.WithLabelValues(handlerName(e), e.Consumer, action).Inc()
		}()
		if next != nil {
			next(e)
		}
	}
	return cfg
}

// handlerName is the Watermill handler name of e's message, "" without one.
func handlerName(e inbox.Event) string {
	if e.Message == nil {
		return ""
	}
	return message.HandlerNameFromCtx(e.Message.Context())
}

// hook returns next, recording each event's outcome first (count).
func (m *Metrics) hook(next func(inbox.Event), outcome string, detects bool) func(inbox.Event) {
	return func(e inbox.Event) {
		defer m.count(e, outcome, detects) // also when next panics
		if next != nil {
			next(e)
		}
	}
}

// count records e's outcome, and whether reused ids are detected unless
// the inbox was configured not to detect them (detects false).
func (m *Metrics) count(e inbox.Event, outcome string, detects bool) {
	handler := handlerName(e)
	if _, ok := m.seen.Load([2]string{handler, e.Consumer}); !ok {
		m.seen.Store([2]string{handler, e.Consumer}, struct{}{})
		if detects { // under ReusedIDsOff, 0 would read as "checked, none reused"
			m.reusedIDs.WithLabelValues(handler, e.Consumer, ReusedIDRefused)
			m.reusedIDs.WithLabelValues(handler, e.Consumer, ReusedIDSkipped)
		}
		// Every outcome at 0 from the first message: a series born at 1
		// is a first failure that rate() and increase() do not see, and a
		// panel of no data where 0 is meant.
		for _, o := range []string{OutcomeProcessed, OutcomeDuplicate, OutcomeFailed} {
			m.messages.WithLabelValues(handler, e.Consumer, o)
		}
	}
	m.messages.WithLabelValues(handler, e.Consumer, outcome).Inc()
	if e.Duration > 0 {
		m.txSeconds.WithLabelValues(handler, e.Consumer, outcome).Observe(e.Duration.Seconds())
		if !detects {
			return
		}
		// Known once a transaction began: the table was checked.
		detected := 0.0
		if e.ReusedIDsDetected {
			detected = 1
		}
		m.reusedIDsDetected.WithLabelValues(handler, e.Consumer).Set(detected)
	}
}

// InstrumentPurger returns cfg with its OnRound hook recording, labelled with
// the purged table (cfg.Purge.Table, DefaultTable when empty) and the
// consumer the purge is limited to (cfg.Purge.Consumer; "", which
// Prometheus stores as no label, for a purge of every consumer's rows), so
// that purgers of consumers that share a table with windows of their own
// neither overwrite each other's window and oldest row nor hide each
// other's failing rounds:
//   - every round by outcome (inbox_purge_rounds_total: ok, failed or
//     skipped); a round cut short by the purger's own stop (an error
//     wrapping context.Canceled, as at router shutdown) is not counted;
//   - rows deleted (inbox_purge_rows_deleted_total) by every round, a
//     failed or cancelled one's committed batches included;
//   - the time a round last ended without error
//     (inbox_purge_last_success_timestamp_seconds) and the oldest row's age
//     (inbox_oldest_row_age_seconds; inbox_table_oldest_row_age_seconds
//     for the whole table, every consumer's rows: PurgeRound.TableOldestAge),
//     of such rounds only;
//   - the window the last round purged by (inbox_purge_window_seconds,
//     PurgeRound.Window), also when it failed after checking its window;
//   - the pacing of every round that ran batches, failed and cancelled
//     ones included (batches, time in batches, time paused, back-offs:
//     PurgeRound.Pacing), with the effective duty cycle of the last such
//     round.
//
// The round counters and the last-success time start at 0 here, so that
// rate() and increase() see the first round and an alert sees a purger that
// never succeeds. A skipped round changes nothing but its counter. A hook
// already set still runs, first.
func (m *Metrics) InstrumentPurger(cfg inbox.PurgerConfig) inbox.PurgerConfig {
	next := cfg.OnRound
	table, consumer := cfg.Purge.Table, cfg.Purge.Consumer
	if table == "" {
		table = inbox.DefaultTable
	}
	ok, failed := m.rounds.WithLabelValues(table, consumer, RoundOK), m.rounds.WithLabelValues(table, consumer, RoundFailed)
	skipped := m.rounds.WithLabelValues(table, consumer, RoundSkipped)
	lastSuccess := m.lastSuccess.WithLabelValues(table, consumer)
	cfg.OnRound = func(r inbox.PurgeRound) {
		if next != nil {
			next(r)
		}
		if r.Skipped {
			skipped.Inc()
			return
		}
		if r.Window > 0 {
			m.window.WithLabelValues(table, consumer).Set(r.Window.Seconds())
		}
		if pc := r.Pacing; pc.Batches > 0 {
			m.batches.WithLabelValues(table, consumer).Add(float64(pc.Batches))
			m.batchSeconds.WithLabelValues(table, consumer).Add(pc.BatchTime.Seconds())
			m.pausedSecs.WithLabelValues(table, consumer).Add(pc.Paused.Seconds())
			m.backOffs.WithLabelValues(table, consumer).Add(float64(pc.BackOffs))
			m.dutyCycle.WithLabelValues(table, consumer).Set(pc.DutyCycle)
		}
		// Committed batches stay deleted whatever ends the round.
		m.purgeDeleted.WithLabelValues(table, consumer).Add(float64(r.Deleted))
		if r.Err != nil {
			if !errors.Is(r.Err, context.Canceled) {
				failed.Inc()
			}
			return
		}
		ok.Inc()
		lastSuccess.SetToCurrentTime()
		m.oldestAge.WithLabelValues(table, consumer).Set(r.OldestAge.Seconds())
		m.tableOldestAge.WithLabelValues(table, consumer).Set(r.TableOldestAge.Seconds())
	}
	return cfg
}

// WatchTableTimeout bounds the estimate that a scrape of WatchTable's
// gauge asks for (inbox.EstimateRows).
const WatchTableTimeout = 5 * time.Second

// WatchTable registers an inbox_rows{table} gauge that asks the database for
// an estimate at each scrape (inbox.EstimateRows: planner statistics on
// PostgreSQL, information_schema on MySQL, COUNT(*) on SQLite), bounded by
// WatchTableTimeout, and the counter inbox_rows_estimate_errors_total{table}
// of the estimates that failed. A failed estimate (a database that is down,
// slow or out of connections; a table that does not exist, such as the
// default name when Config.Table is another) leaves inbox_rows out of that
// scrape and adds 1 to the counter; the scrape carries on with every other
// series. (It was an invalid metric, which failed the whole scrape under
// promhttp's default HTTPErrorOnError: a full pool hid every series of the
// inbox, the alerts' included.) Concurrent scrapes share the estimate in
// flight. d nil: inferred from db; table "": DefaultTable. The watch reads
// through db for as long as it is registered: a service restarted within
// its process, with a new DB, calls UnwatchTable first. Watching a table
// twice on one registry fails with an error that wraps
// prometheus.AlreadyRegisteredError. Safe for concurrent use.
func (m *Metrics) WatchTable(db *sqlx.DB, d inbox.Dialect, table string) error {
	if db == nil {
		return errors.New("metrics: WatchTable needs a DB")
	}
	if table == "" {
		table = inbox.DefaultTable
	}
	labels := prometheus.Labels{"table": table}
	return m.watch("Table", table, &rowsCollector{
		estimate: &scrapeRead[int64]{
			read: func(ctx context.Context) (int64, error) {
				return inbox.EstimateRows(ctx, db, d, table)
			},
			timeout: WatchTableTimeout,
		},
		rows: prometheus.NewDesc("inbox_rows", "Estimated rows in the inbox table, read at scrape time.", nil, labels),
		errs: prometheus.NewDesc("inbox_rows_estimate_errors_total",
			"Scrape-time estimates of the inbox table's rows that failed or did not answer within the timeout; inbox_rows is absent from those scrapes.", nil, labels),
	})
}

// watch registers c, a watch of table (WatchTable, WatchOutbox: kind), and
// remembers it for unwatch. A table watched already on m's registry fails
// with an error that wraps prometheus.AlreadyRegisteredError and says what
// to do.
func (m *Metrics) watch(kind, table string, c prometheus.Collector) error {
	m.watchMu.Lock()
	defer m.watchMu.Unlock()
	if err := m.reg.Register(c); err != nil {
		var dup prometheus.AlreadyRegisteredError
		if errors.As(err, &dup) {
			return fmt.Errorf("metrics: %s table %q is watched already on this registry: a service restarted within its process"+
				" unwatches it first (Unwatch%s), same-named tables of two databases take a registerer each"+
				" (prometheus.WrapRegistererWith a label of the database): %w", strings.ToLower(kind), table, kind, err)
		}
		return err
	}
	if m.watches == nil {
		m.watches = map[string]prometheus.Collector{}
	}
	m.watches[kind+"\x00"+table] = c
	return nil
}

// unwatch unregisters the watch of kind of table, and reports whether there
// was one.
func (m *Metrics) unwatch(kind, table string) bool {
	m.watchMu.Lock()
	defer m.watchMu.Unlock()
	c, ok := m.watches[kind+"\x00"+table]
	if ok {
		delete(m.watches, kind+"\x00"+table)
		m.reg.Unregister(c)
	}
	return ok
}

// UnwatchTable removes the gauge WatchTable registered for table ("":
// DefaultTable) from the registry, and reports whether there was one: for a
// service restarted within its process, before it watches the table again
// through its new DB (the earlier watch reads through the DB it was given,
// which the restart closed, and a second watch of one table fails with
// prometheus.AlreadyRegisteredError). Safe for concurrent use.
func (m *Metrics) UnwatchTable(table string) bool {
	if table == "" {
		table = inbox.DefaultTable
	}
	return m.unwatch("Table", table)
}

// rowsCollector estimates an inbox table's rows at scrape time.
type rowsCollector struct {
	estimate   *scrapeRead[int64]
	rows, errs *prometheus.Desc
}

func (c *rowsCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.rows
	ch <- c.errs
}

func (c *rowsCollector) Collect(ch chan<- prometheus.Metric) {
	if n, err := c.estimate.get(); err == nil {
		ch <- prometheus.MustNewConstMetric(c.rows, prometheus.GaugeValue, float64(n))
	}
	ch <- prometheus.MustNewConstMetric(c.errs, prometheus.CounterValue, float64(c.estimate.failures.Load()))
}
