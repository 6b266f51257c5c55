package metrics_test

import (
	"context"
	"errors"
	"math"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/metrics"
)

// Messages through a real router, then a purge round; the registry is
// scraped as Prometheus would.
func TestMetricsScrape(t *testing.T) {
	db := testdb.OpenSQLite(t, filepath.Join(t.TempDir(), "inbox.db"))
	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg)
	if err != nil {
		t.Fatal(err)
	}
	ib, err := inbox.New(m.Instrument(inbox.Config{DB: db}))
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := m.WatchTable(db, nil, ""); err != nil {
		t.Fatal(err)
	}

	pubsub := make(chan *message.Message)
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	router.AddMiddleware(ib.Middleware)
	router.AddConsumerHandler("billing", "orders", &chanSubscriber{ch: pubsub}, func(msg *message.Message) error {
		if string(msg.Payload) == "fail" {
			return errors.New("failed")
		}
		return nil
	})
	go router.Run(context.Background())
	<-router.Running()
	defer router.Close()
	deliver := func(msg *message.Message) {
		m := msg.Copy()
		pubsub <- m
		select {
		case <-m.Acked():
		case <-m.Nacked():
		case <-time.After(10 * time.Second):
			t.Fatal("not handled")
		}
	}
	a := message.NewMessage(watermill.NewUUID(), nil)
	deliver(a)
	deliver(a)
	deliver(a)
	deliver(message.NewMessage(watermill.NewUUID(), []byte("fail")))

	if _, err := db.Exec("INSERT INTO watermill_inbox VALUES ('old', 'x', CAST(unixepoch('subsec') * 1000000 AS INTEGER) - 7200000000)"); err != nil {
		t.Fatal(err)
	}
	p, err := inbox.NewPurger(m.InstrumentPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, OlderThan: time.Hour}}))
	if err != nil {
		t.Fatal(err)
	}
	if r := p.RunOnce(context.Background()); r.Err != nil {
		t.Fatal(r.Err)
	}

	want := `
# HELP inbox_messages_total Messages seen by the inbox middleware, by outcome: processed (committed), duplicate (skipped and acked) or failed (nacked).
# TYPE inbox_messages_total counter
inbox_messages_total{consumer="billing",handler_name="billing",outcome="duplicate"} 2
inbox_messages_total{consumer="billing",handler_name="billing",outcome="failed"} 1
inbox_messages_total{consumer="billing",handler_name="billing",outcome="processed"} 1
# HELP inbox_purge_rows_deleted_total Inbox rows removed by purge rounds (deleted rows, or rows of dropped partitions).
# TYPE inbox_purge_rows_deleted_total counter
inbox_purge_rows_deleted_total{table="watermill_inbox"} 1
# HELP inbox_rows Estimated rows in the inbox table.
# TYPE inbox_rows gauge
inbox_rows{table="watermill_inbox"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want),
		"inbox_messages_total", "inbox_purge_rows_deleted_total", "inbox_rows"); err != nil {
		t.Error(err)
	}
	if n := testutil.CollectAndCount(reg, "inbox_transaction_seconds"); n != 3 {
		t.Errorf("transaction histograms = %d, want 3 (one per outcome)", n)
	}
	age := testutil.ToFloat64(mustGauge(t, reg))
	if age <= 0 || age > 120 {
		t.Errorf("oldest row age = %v s, want a fresh row's (> 0, < 2 min)", age)
	}
}

// mustGauge returns the collector of inbox_oldest_row_age_seconds for the
// default table, found by gathering.
func mustGauge(t *testing.T, reg *prometheus.Registry) prometheus.Collector {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "inbox_oldest_row_age_seconds" && len(mf.Metric) == 1 {
			g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "x"})
			g.Set(mf.Metric[0].GetGauge().GetValue())
			return g
		}
	}
	t.Fatal("no inbox_oldest_row_age_seconds")
	return nil
}

// chanSubscriber adapts a channel to message.Subscriber; Close closes it so
// that the router stops at once.
type chanSubscriber struct {
	ch   chan *message.Message
	once sync.Once
}

func (s *chanSubscriber) Subscribe(context.Context, string) (<-chan *message.Message, error) {
	return s.ch, nil
}

func (s *chanSubscriber) Close() error {
	s.once.Do(func() { close(s.ch) })
	return nil
}

func TestRegisterTwice(t *testing.T) {
	reg := prometheus.NewRegistry()
	if _, err := metrics.New(reg); err != nil {
		t.Fatal(err)
	}
	var already prometheus.AlreadyRegisteredError
	if _, err := metrics.New(reg); !errors.As(err, &already) {
		t.Errorf("second New on one registry: %v, want AlreadyRegisteredError", err)
	}
}

// A purge round's pacing is exported: its batches, time in batches and
// paused, back-offs, and the effective duty cycle; a second round adds to
// the counters.
func TestMetricsPurgePacing(t *testing.T) {
	db := testdb.OpenSQLite(t, filepath.Join(t.TempDir(), "inbox.db"))
	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg)
	if err != nil {
		t.Fatal(err)
	}
	ib, err := inbox.New(inbox.Config{DB: db})
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	expire := func(n int) {
		t.Helper()
		if _, err := db.Exec(`WITH RECURSIVE s(g) AS (SELECT 1 UNION ALL SELECT g + 1 FROM s WHERE g < ?)
			INSERT INTO watermill_inbox SELECT 'old', lower(hex(randomblob(16))), CAST(unixepoch('subsec') * 1000000 AS INTEGER) - 7200000000 FROM s`, n); err != nil {
			t.Fatal(err)
		}
	}
	var rounds []inbox.PurgeRound
	p, err := inbox.NewPurger(m.InstrumentPurger(inbox.PurgerConfig{
		Purge:   inbox.PurgeConfig{DB: db, OlderThan: time.Hour, BatchSize: 10, DutyCycle: 0.5},
		OnRound: func(r inbox.PurgeRound) { rounds = append(rounds, r) },
	}))
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		expire(25) // 3 batches (10, 10, 5), 2 pauses
		if r := p.RunOnce(context.Background()); r.Err != nil || r.Deleted != 25 {
			t.Fatalf("round %+v, want 25 deleted", r)
		}
	}
	var batchTime, paused time.Duration
	backOffs := 0
	for _, r := range rounds {
		batchTime += r.Pacing.BatchTime
		paused += r.Pacing.Paused
		backOffs += r.Pacing.BackOffs
	}
	if paused <= 0 {
		t.Fatalf("rounds %+v paused for nothing; want pauses at DutyCycle 0.5", rounds)
	}
	for name, want := range map[string]float64{
		"inbox_purge_batches_total":        6,
		"inbox_purge_batch_seconds_total":  batchTime.Seconds(),
		"inbox_purge_paused_seconds_total": paused.Seconds(),
		"inbox_purge_backoffs_total":       float64(backOffs),
		"inbox_purge_duty_cycle":           rounds[1].Pacing.DutyCycle,
		"inbox_purge_rows_deleted_total":   50,
	} {
		if got := gathered(t, reg, name); math.Abs(got-want) > 1e-9 {
			t.Errorf("%s = %v, want %v", name, got, want)
		}
	}
}

// gathered returns the value of the single series of the counter or gauge
// name, labelled with the default table.
func gathered(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name || len(mf.Metric) != 1 {
			continue
		}
		mt := mf.Metric[0]
		if l := mt.GetLabel(); len(l) != 1 || l[0].GetValue() != inbox.DefaultTable {
			t.Fatalf("%s labels %v, want table=%q", name, l, inbox.DefaultTable)
		}
		if c := mt.GetCounter(); c != nil {
			return c.GetValue()
		}
		return mt.GetGauge().GetValue()
	}
	t.Fatalf("no single series of %s", name)
	return 0
}
