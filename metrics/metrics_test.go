package metrics_test

import (
	"context"
	"errors"
	"math"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/metrics"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// An estimate of the inbox table that fails (a pool whose every connection
// is taken, a table that does not exist: WatchTable's default name beside
// another Config.Table) leaves inbox_rows out of that scrape and counts the
// failure, and the scrape, through promhttp's handler at its defaults as a
// service serves /metrics, still answers with every other series. It
// answered 500 before, and every series of the inbox (those the alerts
// read included) was gone while the pool was full.
func TestInboxRowsEstimateThatFailsLeavesTheScrapeWhole(t *testing.T) {
	cases := []struct {
		name  string
		open  func(t *testing.T) *sqlx.DB
		table string // the inbox's Config.Table
		hold  bool   // take the pool's only connection during the scrape
	}{
		{"table that does not exist", func(t *testing.T) *sqlx.DB {
			return testdb.OpenSQLite(t, filepath.Join(t.TempDir(), "inbox.db"))
		}, "billing_inbox", false},
		{"pool without a free connection", func(t *testing.T) *sqlx.DB {
			return testdb.OpenPostgres(t, "")
		}, "inbox_" + testdb.RandomSuffix(), true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			db := c.open(t)
			reg := prometheus.NewRegistry()
			m, err := metrics.New(reg)
			if err != nil {
				t.Fatal(err)
			}
			ib, err := inbox.New(m.Instrument(inbox.Config{DB: db, Table: c.table}))
			if err != nil {
				t.Fatal(err)
			}
			if err := ib.InitializeSchema(context.Background()); err != nil {
				t.Fatal(err)
			}
			testdb.DropLater(t, db, c.table)
			watched := inbox.DefaultTable // as the package example has it
			if c.hold {
				watched = c.table
			}
			if err := m.WatchTable(db, nil, watched); err != nil {
				t.Fatal(err)
			}
			// Series that exist from the start: the purge rounds' counters.
			m.InstrumentPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Table: c.table}})
			ctx := context.Background()

			release := func() {}
			if c.hold {
				db.SetMaxOpenConns(1)
				conn, err := db.Conn(ctx)
				if err != nil {
					t.Fatal(err)
				}
				release = func() { conn.Close() }
			}
			rec := httptest.NewRecorder()
			promhttp.HandlerFor(reg, promhttp.HandlerOpts{}).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
			release()
			body := rec.Body.String()
			if rec.Code != http.StatusOK || strings.Contains(body, "\ninbox_rows{") ||
				!strings.Contains(body, `inbox_rows_estimate_errors_total{table="`+watched+`"} 1`) ||
				!strings.Contains(body, `inbox_purge_rounds_total{consumer="",outcome="failed",table="`+c.table+`"} 0`) {
				t.Errorf("scrape while the estimate fails: HTTP %d\n%s\nwant 200, no inbox_rows, one estimate error and the inbox's other series", rec.Code, body)
			}
			if c.hold {
				// The estimate that waited for a connection may still be in
				// flight, and the next scrape shares it: poll.
				deadline := time.Now().Add(time.Minute)
				for {
					if _, ok := scraped(t, reg, "inbox_rows", watched); ok {
						break
					}
					if time.Now().After(deadline) {
						t.Fatal("inbox_rows did not come back once a connection was free")
					}
					time.Sleep(50 * time.Millisecond)
				}
			}
		})
	}
}

// Messages through a real router, then a purge round; the registry is
// scraped as Prometheus would.
func TestMetricsScrape(t *testing.T) {
	reg, m, ib, db := sqliteInbox(t, inbox.Config{}, true)
	if err := m.WatchTable(db, nil, ""); err != nil {
		t.Fatal(err)
	}

	deliver := routeThroughInbox(t, ib)
	a := message.NewMessage(watermill.NewUUID(), nil)
	deliver(a)
	deliver(a)
	deliver(a)
	deliver(message.NewMessage(watermill.NewUUID(), []byte("fail")))

	if _, err := db.Exec("INSERT INTO watermill_inbox (consumer, message_id, processed_at) VALUES ('old', 'x', CAST(unixepoch('subsec') * 1000000 AS INTEGER) - 7200000000)"); err != nil {
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
# HELP inbox_messages_total Messages seen by the inbox middleware, by outcome: processed (committed), duplicate (skipped and acked) or failed (rolled back: every failed attempt, those the Retry middleware outside the inbox makes before the message is nacked included).
# TYPE inbox_messages_total counter
inbox_messages_total{consumer="billing",handler_name="billing",outcome="duplicate"} 2
inbox_messages_total{consumer="billing",handler_name="billing",outcome="failed"} 1
inbox_messages_total{consumer="billing",handler_name="billing",outcome="processed"} 1
# HELP inbox_purge_rows_deleted_total Inbox rows removed by purge rounds (deleted rows, or rows of dropped partitions), the committed batches of rounds that failed later included.
# TYPE inbox_purge_rows_deleted_total counter
inbox_purge_rows_deleted_total{consumer="",table="watermill_inbox"} 1
# HELP inbox_rows Estimated rows in the inbox table, read at scrape time.
# TYPE inbox_rows gauge
inbox_rows{table="watermill_inbox"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want),
		"inbox_messages_total", "inbox_purge_rows_deleted_total", "inbox_rows"); err != nil {
		t.Error(err)
	}
	// Present at 0 from the first message: a panel or an alert over them
	// reads 0, not "no data".
	if n := testutil.CollectAndCount(reg, "inbox_reused_ids_total"); n != 2 {
		t.Errorf("inbox_reused_ids_total series = %d, want 2 (refused and skipped, at 0)", n)
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
	db, reg, m := sqliteInboxTable(t)
	expire := func(n int) {
		t.Helper()
		if _, err := db.Exec(`WITH RECURSIVE s(g) AS (SELECT 1 UNION ALL SELECT g + 1 FROM s WHERE g < ?)
			INSERT INTO watermill_inbox (consumer, message_id, processed_at) SELECT 'old', lower(hex(randomblob(16))), CAST(unixepoch('subsec') * 1000000 AS INTEGER) - 7200000000 FROM s`, n); err != nil {
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
		if labels := labelMap(mt.GetLabel()); labels["table"] != inbox.DefaultTable || labels["consumer"] != "" || len(labels) != 2 {
			t.Fatalf("%s labels %v, want table=%q and consumer=\"\" (every consumer)", name, labels, inbox.DefaultTable)
		}
		if c := mt.GetCounter(); c != nil {
			return c.GetValue()
		}
		return mt.GetGauge().GetValue()
	}
	t.Fatalf("no single series of %s", name)
	return 0
}

// Purge rounds are counted by outcome from the moment the purger is
// instrumented (every counter and the last-success time at 0 before any
// round); a successful round sets the last-success time and the window it
// purged by, which follows the window source from one round to the next; a
// failed round counts as failed and leaves the last-success time alone, and
// still reports its window when it had checked it; a round stopped by the
// purger's own cancellation is not a failure.
func TestMetricsPurgeRounds(t *testing.T) {
	db, reg, m := sqliteInboxTable(t)
	retention := &settableWindow{}
	p, err := inbox.NewPurger(m.InstrumentPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Window: retention}}))
	if err != nil {
		t.Fatal(err)
	}
	rounds := func(outcome string) float64 {
		t.Helper()
		return roundsCounted(t, reg, inbox.DefaultTable, outcome)
	}
	type state struct{ ok, failed, skipped, lastSuccess, window float64 }
	now := func() state {
		t.Helper()
		s := state{rounds(metrics.RoundOK), rounds(metrics.RoundFailed), rounds(metrics.RoundSkipped),
			gathered(t, reg, "inbox_purge_last_success_timestamp_seconds"), -1}
		if testutil.CollectAndCount(reg, "inbox_purge_window_seconds") > 0 {
			s.window = gathered(t, reg, "inbox_purge_window_seconds")
		}
		return s
	}
	if got := now(); got != (state{0, 0, 0, 0, -1}) {
		t.Errorf("before any round: %+v, want every counter and the last-success time at 0, no window", got)
	}

	retention.set(5*time.Hour, nil)
	before := float64(time.Now().UnixNano()) / 1e9
	if r := p.RunOnce(context.Background()); r.Err != nil {
		t.Fatal(r.Err)
	}
	first := now()
	if first.ok != 1 || first.failed != 0 || first.lastSuccess < before || first.lastSuccess > before+60 || first.window != 5*3600 {
		t.Errorf("after a successful round under a 5h window: %+v, want ok 1, last success about now (%v), window 18000", first, before)
	}

	retention.set(7*time.Hour, nil)
	if r := p.RunOnce(context.Background()); r.Err != nil {
		t.Fatal(r.Err)
	}
	if got := now(); got.ok != 2 || got.lastSuccess < first.lastSuccess || got.window != 7*3600 {
		t.Errorf("after the retention grew to 7h: %+v, want ok 2 and window 25200", got)
	}
	second := now()

	retention.set(0, errors.New("retention unreadable"))
	if r := p.RunOnce(context.Background()); r.Err == nil {
		t.Fatal("round with an unreadable window succeeded")
	}
	if got := now(); got.ok != 2 || got.failed != 1 || got.lastSuccess != second.lastSuccess || got.window != 7*3600 {
		t.Errorf("after a round whose window source failed: %+v, want failed 1, last success and window unchanged", got)
	}

	retention.set(5*time.Hour, nil)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if r := p.RunOnce(ctx); !errors.Is(r.Err, context.Canceled) {
		t.Fatalf("round under a cancelled context: %v, want context.Canceled", r.Err)
	}
	if got := now(); got.ok != 2 || got.failed != 1 || got.lastSuccess != second.lastSuccess {
		t.Errorf("after a round stopped by the purger's cancellation: %+v, want no round counted", got)
	}

	if _, err := db.Exec("DROP TABLE watermill_inbox"); err != nil {
		t.Fatal(err)
	}
	if r := p.RunOnce(context.Background()); r.Err == nil || r.Window != 5*time.Hour {
		t.Fatalf("round on a dropped table: %+v, want an error after the 5h window was checked", r)
	}
	if got := now(); got.failed != 2 || got.lastSuccess != second.lastSuccess || got.window != 5*3600 {
		t.Errorf("after a round that failed past its window check: %+v, want failed 2 and window 18000", got)
	}
}

// A round that finds the purge lock held by another instance counts as
// skipped and changes nothing else (PostgreSQL: SQLite takes no lock).
func TestMetricsPurgeRoundSkipped(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	table := "metrics_skip_" + testdb.RandomSuffix()
	testdb.DropLater(t, db, table)
	ib, err := inbox.New(inbox.Config{DB: db, Table: table})
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg)
	if err != nil {
		t.Fatal(err)
	}
	holding := newHeldWindow(time.Hour)
	holder, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Table: table, Window: holding}})
	if err != nil {
		t.Fatal(err)
	}
	p, err := inbox.NewPurger(m.InstrumentPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Table: table, OlderThan: time.Hour}}))
	if err != nil {
		t.Fatal(err)
	}
	held := make(chan inbox.PurgeRound)
	go func() { held <- holder.RunOnce(context.Background()) }()
	<-holding.asked // the holder's round has the lock
	r := p.RunOnce(context.Background())
	close(holding.release)
	if hr := <-held; hr.Err != nil {
		t.Fatal(hr.Err)
	}
	if !r.Skipped {
		t.Fatalf("round while another instance holds the lock: %+v, want skipped", r)
	}
	for outcome, want := range map[string]float64{metrics.RoundSkipped: 1, metrics.RoundOK: 0, metrics.RoundFailed: 0} {
		if got := roundsCounted(t, reg, table, outcome); got != want {
			t.Errorf("inbox_purge_rounds_total{outcome=%q} = %v, want %v", outcome, got, want)
		}
	}
	if n := testutil.CollectAndCount(reg, "inbox_purge_window_seconds", "inbox_oldest_row_age_seconds"); n != 0 {
		t.Errorf("%d window or oldest-age series after a skipped round, want none", n)
	}
}

// roundsCounted returns the value of inbox_purge_rounds_total{table,
// outcome}, found by gathering.
func roundsCounted(t *testing.T, reg *prometheus.Registry, table, outcome string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "inbox_purge_rounds_total" {
			continue
		}
		for _, mt := range mf.Metric {
			if labels := labelMap(mt.GetLabel()); labels["table"] == table && labels["outcome"] == outcome {
				return mt.GetCounter().GetValue()
			}
		}
	}
	t.Fatalf("no inbox_purge_rounds_total{table=%q,outcome=%q}", table, outcome)
	return 0
}

// labelMap returns a series' labels by name.
func labelMap(labels []*dto.LabelPair) map[string]string {
	m := map[string]string{}
	for _, l := range labels {
		m[l.GetName()] = l.GetValue()
	}
	return m
}

// Two purgers of one table, each limited to its consumer with a window of
// its own (PurgeConfig.Consumer), report apart: each its own window, oldest
// row and rounds, labelled with its consumer. One set of series per table
// had the last round's purger overwrite the other's window and oldest row,
// and one's successful rounds hid the other's failing ones from
// InboxPurgeRoundsFailing.
func TestMetricsPurgersOfConsumersThatShareATableReportApart(t *testing.T) {
	ctx := context.Background()
	db, reg, m := sqliteInboxTable(t)
	for consumer, age := range map[string]time.Duration{"orders": 30 * time.Minute, "ledger": 5 * 24 * time.Hour} {
		if _, err := db.Exec("INSERT INTO watermill_inbox (consumer, message_id, processed_at) VALUES (?, ?, ?)",
			consumer, "m1", time.Now().Add(-age).UnixMicro()); err != nil {
			t.Fatal(err)
		}
	}
	ledgerWindow := &settableWindow{}
	ledgerWindow.set(0, errors.New("the broker cannot be asked"))
	orders, err := inbox.NewPurger(m.InstrumentPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Consumer: "orders", OlderThan: time.Hour}}))
	if err != nil {
		t.Fatal(err)
	}
	ledger, err := inbox.NewPurger(m.InstrumentPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Consumer: "ledger", Window: ledgerWindow}}))
	if err != nil {
		t.Fatal(err)
	}
	if r := orders.RunOnce(ctx); r.Err != nil {
		t.Fatal(r.Err)
	}
	if r := ledger.RunOnce(ctx); r.Err == nil {
		t.Fatal("ledger's round succeeded; want it failed (its window source refuses)")
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		for _, mt := range mf.Metric {
			labels := labelMap(mt.GetLabel())
			key := mf.GetName() + " " + labels["consumer"] + " " + labels["outcome"]
			if c := mt.GetCounter(); c != nil {
				got[key] = c.GetValue()
			} else {
				got[key] = mt.GetGauge().GetValue()
			}
		}
	}
	for key, want := range map[string]float64{
		"inbox_purge_window_seconds orders ":                 3600,
		"inbox_purge_rounds_total orders ok":                 1,
		"inbox_purge_rounds_total orders failed":             0,
		"inbox_purge_rounds_total ledger ok":                 0,
		"inbox_purge_rounds_total ledger failed":             1,
		"inbox_purge_last_success_timestamp_seconds ledger ": 0,
	} {
		if v, ok := got[key]; !ok || v != want {
			t.Errorf("%s = %v (present: %v), want %v", key, v, ok, want)
		}
	}
	if age := got["inbox_oldest_row_age_seconds orders "]; age < 1700 || age > 1900 {
		t.Errorf("orders' oldest row age = %vs, want about 1800 (its own row, not ledger's 5 days)", age)
	}
}

// sqliteInboxTable returns a SQLite database holding the default inbox
// table, and Metrics registered with a registry of their own.
func sqliteInboxTable(t *testing.T) (*sqlx.DB, *prometheus.Registry, *metrics.Metrics) {
	t.Helper()
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
	return db, reg, m
}

// sqliteInbox opens a SQLite database in a temporary folder and returns a
// new registry, Metrics on it, and an inbox on the database configured by
// cfg (its DB set here) and instrumented by the Metrics; with initialize,
// the inbox's table is created.
func sqliteInbox(t *testing.T, cfg inbox.Config, initialize bool) (*prometheus.Registry, *metrics.Metrics, *inbox.Inbox, *sqlx.DB) {
	t.Helper()
	db := testdb.OpenSQLite(t, filepath.Join(t.TempDir(), "inbox.db"))
	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg)
	if err != nil {
		t.Fatal(err)
	}
	cfg.DB = db
	ib, err := inbox.New(m.Instrument(cfg))
	if err != nil {
		t.Fatal(err)
	}
	if initialize {
		if err := ib.InitializeSchema(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	return reg, m, ib, db
}

// routeThroughInbox runs a router (closed when t ends) whose handler
// "billing" sits behind ib's middleware and fails the messages whose payload
// is "fail", and returns a function that delivers a copy of a message and
// waits until it is acked or nacked.
func routeThroughInbox(t *testing.T, ib *inbox.Inbox) (deliver func(*message.Message)) {
	t.Helper()
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
	go func() { _ = router.Run(context.Background()) }()
	<-router.Running()
	t.Cleanup(func() { router.Close() })
	return func(msg *message.Message) {
		m := msg.Copy()
		pubsub <- m
		select {
		case <-m.Acked():
		case <-m.Nacked():
		case <-time.After(10 * time.Second):
			t.Fatal("not handled")
		}
	}
}

// A hook of the application's that panics (the inbox logs the panic and
// changes no outcome) does not stop the metrics' count of its outcome:
// Instrument's hook ran the application's first and counted after it, so
// the panic skipped the count, and an alert on a failing handler could not
// fire.
func TestMetricsCountWhatAnApplicationHookThatPanicsReports(t *testing.T) {
	db := testdb.OpenSQLite(t, filepath.Join(t.TempDir(), "inbox.db"))
	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg)
	if err != nil {
		t.Fatal(err)
	}
	ib, err := inbox.New(m.Instrument(inbox.Config{DB: db,
		OnProcessed: func(inbox.Event) { panic("bug in the application's processed hook") },
		OnFailed:    func(inbox.Event) { panic("bug in the application's failed hook") },
	}))
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	deliver := routeThroughInbox(t, ib)
	deliver(message.NewMessage(watermill.NewUUID(), nil))
	deliver(message.NewMessage(watermill.NewUUID(), []byte("fail")))
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	counted := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() == "inbox_messages_total" {
			for _, mt := range mf.Metric {
				counted[labelMap(mt.GetLabel())["outcome"]] += mt.GetCounter().GetValue()
			}
		}
	}
	if counted[metrics.OutcomeProcessed] != 1 || counted[metrics.OutcomeFailed] != 1 {
		t.Errorf("inbox_messages_total by outcome: %v, want 1 processed and 1 failed", counted)
	}
}

// A pgxinbox inbox is instrumented in one call (pgxinbox.Config.Instrument
// with Instrument): its outcomes are counted as inbox.Inbox's are; users
// copied the four hooks by hand, and one forgotten went uncounted.
func TestMetricsCountAPgxInboxInstrumentedInOneCall(t *testing.T) {
	pool := testdb.OpenPgxPool(t, "")
	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg)
	if err != nil {
		t.Fatal(err)
	}
	table := "metrics_pgx_" + testdb.RandomSuffix()
	ib, err := pgxinbox.New(pgxinbox.Config{Pool: pool, Table: table}.Instrument(m.Instrument))
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = ib.Close()
		_, _ = pool.Exec(context.Background(), "DROP TABLE IF EXISTS "+table)
	})
	deliver := routeThroughInbox(t, ib.Inbox)
	a := message.NewMessage(watermill.NewUUID(), nil)
	deliver(a)
	deliver(a)
	deliver(message.NewMessage(watermill.NewUUID(), []byte("fail")))
	want := `
# HELP inbox_messages_total Messages seen by the inbox middleware, by outcome: processed (committed), duplicate (skipped and acked) or failed (rolled back: every failed attempt, those the Retry middleware outside the inbox makes before the message is nacked included).
# TYPE inbox_messages_total counter
inbox_messages_total{consumer="billing",handler_name="billing",outcome="duplicate"} 1
inbox_messages_total{consumer="billing",handler_name="billing",outcome="failed"} 1
inbox_messages_total{consumer="billing",handler_name="billing",outcome="processed"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "inbox_messages_total"); err != nil {
		t.Error(err)
	}
	if n := testutil.CollectAndCount(reg, "inbox_reused_ids_total"); n != 2 {
		t.Errorf("inbox_reused_ids_total series = %d, want 2 (refused and skipped, at 0)", n)
	}
}
