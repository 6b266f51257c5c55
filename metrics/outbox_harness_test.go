package metrics_test

// The outbox's test harness: the databases, a broker that refuses chosen
// messages, an outbox of a test's own, and reading a series off a scrape.

import (
	"context"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// outboxDBs are the databases the outbox runs on: SQLite, PostgreSQL and
// MySQL/MariaDB (the inbox's partitioned and clientFoundRows variants change
// nothing for the outbox).
func outboxDBs() []testdb.DB {
	var dbs []testdb.DB
	for _, d := range testdb.All {
		switch d.Name {
		case "sqlite", "postgres", "mysql":
			dbs = append(dbs, d)
		}
	}
	return dbs
}

// refusingBroker is the broker the relay publishes to: it records the
// UUIDs it accepted, and refuses a whole Publish call that carries a UUID
// of refuse, as a broker call fails.
type refusingBroker struct {
	mu       sync.Mutex
	refuse   map[string]bool
	accepted []string
}

func (b *refusingBroker) Publish(_ string, msgs ...*message.Message) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, m := range msgs {
		if b.refuse[m.UUID] {
			return errRefused
		}
	}
	for _, m := range msgs {
		b.accepted = append(b.accepted, m.UUID)
	}
	return nil
}

func (b *refusingBroker) Close() error { return nil }

func (b *refusingBroker) sent() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]string(nil), b.accepted...)
}

type refusedError struct{}

func (refusedError) Error() string { return "message too large" }

var errRefused error = refusedError{}

// newOutbox returns an outbox on db with cfg, whose Table (a name of the
// test's own, set before InstrumentOutbox reads it) is created, and dropped
// with its dead-letter table when t ends.
func newOutbox(t *testing.T, db *sqlx.DB, d inbox.Dialect, cfg inbox.OutboxConfig) *inbox.Outbox {
	t.Helper()
	cfg.DB, cfg.Dialect = db, d
	testdb.DropLater(t, db, cfg.Table+"_dead")
	testdb.DropLater(t, db, cfg.Table)
	ob, err := inbox.NewOutbox(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	return ob
}

// scraped returns the value of the series name labelled table=table in a
// scrape of reg (a counter's or gauge's value, a histogram's sample count),
// and whether the scrape had it. A failed scrape fails the test.
func scraped(t *testing.T, reg *prometheus.Registry, name, table string) (float64, bool) {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatalf("scrape: %v", err)
	}
	return seriesValue(mfs, name, table)
}

func seriesValue(mfs []*dto.MetricFamily, name, table string) (float64, bool) {
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, mt := range mf.Metric {
			if l := mt.GetLabel(); len(l) != 1 || l[0].GetName() != "table" || l[0].GetValue() != table {
				continue
			}
			switch {
			case mt.GetCounter() != nil:
				return mt.GetCounter().GetValue(), true
			case mt.GetGauge() != nil:
				return mt.GetGauge().GetValue(), true
			case mt.GetHistogram() != nil:
				return float64(mt.GetHistogram().GetSampleCount()), true
			}
		}
	}
	return 0, false
}
