package metrics_test

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/metrics"
)

// A transaction that runs up to the default Timeout of an attempt (30 s)
// and a relay round that waits out a broker's timeouts land in a bucket of
// their own: the dashboard's quantiles (histogram_quantile) cannot rise
// above the largest finite bucket, and read 4.096 s for transactions of
// 6 s (the mean read 6 s) while the buckets ended there.
func TestSlowTransactionsAndRelayRoundsShowTheirDurationOnTheDashboard(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg)
	if err != nil {
		t.Fatal(err)
	}
	const slow = 40 * time.Second
	cfg := m.Instrument(inbox.Config{})
	cfg.OnProcessed(inbox.Event{Consumer: "billing", Duration: slow})
	m.InstrumentOutbox(inbox.OutboxConfig{}).OnRound(inbox.OutboxRound{Relayed: 1, Duration: slow})

	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"inbox_transaction_seconds", "inbox_outbox_relay_round_seconds"} {
		h := histogramOf(t, families, name)
		// The quantile of a single observation is in the first bucket
		// whose upper bound holds it: a finite one.
		var within bool
		for _, b := range h.GetBucket() {
			if b.GetCumulativeCount() == 1 && b.GetUpperBound() >= slow.Seconds() && b.GetUpperBound() < 2*slow.Seconds() {
				within = true
				break
			}
			if b.GetCumulativeCount() == 1 {
				break
			}
		}
		if !within {
			t.Errorf("%s: no finite bucket holds a %s observation within a factor of 2: %v", name, slow, h.GetBucket())
		}
	}
}

// histogramOf returns the only histogram of the family name.
func histogramOf(t *testing.T, families []*dto.MetricFamily, name string) *dto.Histogram {
	t.Helper()
	for _, mf := range families {
		if mf.GetName() == name && len(mf.GetMetric()) == 1 {
			return mf.GetMetric()[0].GetHistogram()
		}
	}
	t.Fatalf("no single %s in the scrape", name)
	return nil
}
