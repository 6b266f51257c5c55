package metrics

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/watermill-inbox/inbox"
)

// A scrape whose outbox stats came back without the count of pending
// messages (inbox.Outbox.Stats: Pending -1 and the count's error, a backlog
// too large to count within the read's timeout) still has the oldest
// message's age and the dead letters, which the critical alert needs, and
// counts the failed read; only the depth is left out.
func TestOutboxGaugesKeepTheAgeOfABacklogTooLargeToCount(t *testing.T) {
	labels := prometheus.Labels{"table": "outbox"}
	c := &outboxCollector{
		stats: &scrapeRead[inbox.OutboxStats]{timeout: time.Second, read: func(ctx context.Context) (inbox.OutboxStats, error) {
			return inbox.OutboxStats{Pending: -1, OldestAge: 90 * time.Minute, DeadLettered: 2}, context.DeadlineExceeded
		}},
		pending: prometheus.NewDesc("inbox_outbox_pending_messages", "h", nil, labels),
		oldest:  prometheus.NewDesc("inbox_outbox_oldest_pending_age_seconds", "h", nil, labels),
		dead:    prometheus.NewDesc("inbox_outbox_dead_letters", "h", nil, labels),
		errs:    prometheus.NewDesc("inbox_outbox_stats_errors_total", "h", nil, labels),
	}
	reg := prometheus.NewPedanticRegistry()
	if err := reg.Register(c); err != nil {
		t.Fatal(err)
	}
	want := map[string]float64{"inbox_outbox_oldest_pending_age_seconds": 5400, "inbox_outbox_dead_letters": 2, "inbox_outbox_stats_errors_total": 1}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.Metric {
			if m.Gauge != nil {
				got[mf.GetName()] = m.Gauge.GetValue()
			} else {
				got[mf.GetName()] = m.Counter.GetValue()
			}
		}
	}
	if len(got) != len(want) {
		t.Errorf("scrape = %v, want %v (no pending gauge)", got, want)
	}
	for name, v := range want {
		if got[name] != v {
			t.Errorf("%s = %v, want %v", name, got[name], v)
		}
	}

	// A read whose count of the dead letters failed (the dead-letter
	// table's count comes first) leaves out both counts, not the age.
	c.stats = &scrapeRead[inbox.OutboxStats]{timeout: time.Second, read: func(ctx context.Context) (inbox.OutboxStats, error) {
		return inbox.OutboxStats{Pending: -1, DeadLettered: -1, OldestAge: time.Minute}, context.DeadlineExceeded
	}}
	if n := testutil.CollectAndCount(c); n != 2 {
		t.Errorf("a read without its counts: %d series, want the age and the error counter", n)
	}

	// A read that fails before the age leaves all three out.
	c.stats = &scrapeRead[inbox.OutboxStats]{timeout: time.Second, read: func(ctx context.Context) (inbox.OutboxStats, error) {
		return inbox.OutboxStats{}, errors.New("connection refused")
	}}
	if n := testutil.CollectAndCount(c); n != 1 {
		t.Errorf("a failed read: %d series, want only the error counter", n)
	}
}
