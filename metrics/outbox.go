package metrics

import (
	"context"
	"errors"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/watermill-inbox/inbox"
)

// OutboxStatsTimeout bounds the Outbox.Stats query that a scrape of the
// WatchOutbox gauges runs: a database that has not answered by then leaves
// the gauges out of that scrape, which still returns at once with every
// other series.
const OutboxStatsTimeout = 2 * time.Second

// outboxMetrics are the series of the outbox relay's rounds (OnRound).
type outboxMetrics struct {
	relayed      *prometheus.CounterVec
	refused      *prometheus.CounterVec
	deadLettered *prometheus.CounterVec
	roundErrors  *prometheus.CounterVec
	roundSeconds *prometheus.HistogramVec
}

func newOutboxMetrics() outboxMetrics {
	return outboxMetrics{
		relayed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "inbox_outbox_messages_relayed_total",
			Help: "Outbox messages the broker accepted and whose rows the relay deleted.",
		}, []string{"table"}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "inbox_outbox_publish_failures_total",
			Help: "Outbox messages the broker refused, each counted once per relay round that tried it (refusals as the broker's state, which use none of OutboxConfig.MaxAttempts, included).",
		}, []string{"table"}),
		deadLettered: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "inbox_outbox_messages_dead_lettered_total",
			Help: "Outbox messages set aside in the dead-letter table after their last attempt.",
		}, []string{"table"}),
		roundErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "inbox_outbox_relay_errors_total",
			Help: "Outbox relay rounds that failed: the broker refused a message, or a database statement failed.",
		}, []string{"table"}),
		roundSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "inbox_outbox_relay_round_seconds",
			Help:    "Duration of the outbox relay rounds that found messages or failed: read, publish, delete and commit.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 17), // 1 ms to ~65 s: a round that waits out a broker's timeouts
		}, []string{"table"}),
	}
}

func (o outboxMetrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{o.relayed, o.refused, o.deadLettered, o.roundErrors, o.roundSeconds}
}

// InstrumentOutbox returns cfg with its OnRound hook recording each relay
// round, labelled with the outbox table (cfg.Table, DefaultOutboxTable when
// empty): messages relayed (inbox_outbox_messages_relayed_total), messages
// the broker refused, once per round that tried each
// (inbox_outbox_publish_failures_total: OutboxRound.Failed), messages set
// aside in the dead-letter table
// (inbox_outbox_messages_dead_lettered_total), failed rounds
// (inbox_outbox_relay_errors_total) and the round's duration
// (inbox_outbox_relay_round_seconds). The relay reports only rounds that
// found messages or failed, so idle polls add nothing to the histogram. A
// round cut short by the relay's own stop (an error wrapping
// context.Canceled, as at router shutdown) is not counted as failed. The
// table's counters start at 0 here, so that rate() and increase() see the
// first event. A hook already set still runs, first.
func (m *Metrics) InstrumentOutbox(cfg inbox.OutboxConfig) inbox.OutboxConfig {
	next := cfg.OnRound
	table := cfg.Table
	if table == "" {
		table = inbox.DefaultOutboxTable
	}
	o := m.outbox
	relayed, refused := o.relayed.WithLabelValues(table), o.refused.WithLabelValues(table)
	deadLettered, roundErrors := o.deadLettered.WithLabelValues(table), o.roundErrors.WithLabelValues(table)
	roundSeconds := o.roundSeconds.WithLabelValues(table)
	cfg.OnRound = func(r inbox.OutboxRound) {
		if next != nil {
			next(r)
		}
		relayed.Add(float64(r.Relayed))
		refused.Add(float64(r.Failed))
		deadLettered.Add(float64(r.DeadLettered))
		if r.Err != nil && !errors.Is(r.Err, context.Canceled) {
			roundErrors.Inc()
		}
		roundSeconds.Observe(r.Duration.Seconds())
	}
	return cfg
}

// WatchOutbox registers gauges of ob's table, read with ob.Stats at each
// scrape and labelled with the table (ob.Table()):
// inbox_outbox_pending_messages (messages not yet relayed: the outbox's
// depth), inbox_outbox_oldest_pending_age_seconds (how long ago the oldest
// of them was written, by the database clock; 0 when none is pending) and
// inbox_outbox_dead_letters (rows in the dead-letter table); and the counter
// inbox_outbox_stats_errors_total of the reads that failed.
//
// The values are read when Prometheus scrapes, as Prometheus asks of
// collectors that mirror state kept elsewhere, so they are as fresh as the
// scrape and cost nothing between scrapes. A read is bounded by
// OutboxStatsTimeout; one that fails or has not answered by then (a
// database that is down, slow or out of connections) leaves the three gauges
// out of that scrape and adds 1 to inbox_outbox_stats_errors_total (a read
// whose count of the pending messages alone failed, a backlog too large to
// count in time, leaves out only inbox_outbox_pending_messages: the age of
// the oldest message, which the critical alert watches, is read apart,
// through the primary key), and the
// scrape carries on with every other series, so that a database outage does
// not also hide the relay's counters that explain it (an invalid metric
// would fail the whole scrape under promhttp's default HTTPErrorOnError). Concurrent scrapes share the read in flight, so at most
// one query per outbox runs at a time, however many Prometheus servers
// scrape. The watch reads through ob for as long as it is registered: a
// service restarted within its process, with a new Outbox and DB, calls
// UnwatchOutbox first. Watching a table twice on one registry fails with an
// error that wraps prometheus.AlreadyRegisteredError. Safe for concurrent
// use.
func (m *Metrics) WatchOutbox(ob *inbox.Outbox) error {
	if ob == nil {
		return errors.New("metrics: WatchOutbox needs an Outbox")
	}
	labels := prometheus.Labels{"table": ob.Table()}
	return m.watch("Outbox", ob.Table(), &outboxCollector{
		stats: &scrapeRead[inbox.OutboxStats]{read: ob.Stats, timeout: OutboxStatsTimeout},
		pending: prometheus.NewDesc("inbox_outbox_pending_messages",
			"Outbox messages not yet relayed (the outbox's depth), read at scrape time.", nil, labels),
		oldest: prometheus.NewDesc("inbox_outbox_oldest_pending_age_seconds",
			"Age of the oldest outbox message not yet relayed, by the database clock, read at scrape time; 0 when none is pending.", nil, labels),
		dead: prometheus.NewDesc("inbox_outbox_dead_letters",
			"Messages in the outbox's dead-letter table, read at scrape time.", nil, labels),
		errs: prometheus.NewDesc("inbox_outbox_stats_errors_total",
			"Scrape-time reads of the outbox's stats that failed or did not answer within the timeout; the outbox gauges are absent from those scrapes.", nil, labels),
	})
}

// UnwatchOutbox removes the gauges WatchOutbox registered for the outbox
// table table from the registry, and reports whether there were any: for a
// service restarted within its process, before it watches the table again
// through its new Outbox (the earlier watch reads through the Outbox and DB
// it was given, which the restart closed). Safe for concurrent use.
func (m *Metrics) UnwatchOutbox(table string) bool { return m.unwatch("Outbox", table) }

// outboxCollector reads an outbox's stats at scrape time.
type outboxCollector struct {
	stats                       *scrapeRead[inbox.OutboxStats]
	pending, oldest, dead, errs *prometheus.Desc
}

func (c *outboxCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.pending
	ch <- c.oldest
	ch <- c.dead
	ch <- c.errs
}

func (c *outboxCollector) Collect(ch chan<- prometheus.Metric) {
	// On an error, -1 marks the counts inbox.Outbox.Stats could not make
	// after it read the age.
	if st, err := c.stats.get(); err == nil || st.Pending == -1 {
		ch <- prometheus.MustNewConstMetric(c.oldest, prometheus.GaugeValue, st.OldestAge.Seconds())
		if st.DeadLettered >= 0 {
			ch <- prometheus.MustNewConstMetric(c.dead, prometheus.GaugeValue, float64(st.DeadLettered))
		}
		if st.Pending >= 0 {
			ch <- prometheus.MustNewConstMetric(c.pending, prometheus.GaugeValue, float64(st.Pending))
		}
	}
	ch <- prometheus.MustNewConstMetric(c.errs, prometheus.CounterValue, float64(c.stats.failures.Load()))
}
