package metrics_test

// The Grafana dashboard (grafana/inbox-dashboard.json) and the Prometheus
// alert rules (prometheus/inbox-alerts.yml, with their promtool tests) ask
// only for series the module exports, so that they cannot drift from the
// code. The rules' behaviour is tested by promtool (`promtool test rules
// prometheus/inbox-alerts_test.yml`, run by .ci/run).

import (
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/prometheus/promql/parser"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/metrics"
)

// Every query of every panel and variable of the dashboard parses as
// PromQL and selects series that a scrape of the instrumented components
// has, by labels and label values those series carry; and every series
// family the module exports is on the dashboard.
func TestDashboardAsksOnlyForExportedSeries(t *testing.T) {
	t.Parallel()
	set := scrapeEverySeries(t)
	vars, varQueries, exprs := dashboardQueries(t)
	vc := newSeriesChecker(set)
	for where, q := range varQueries {
		vc.variableQuery("variable "+where, q, vars)
	}
	vc.report(t, dashboardFile)
	c := newSeriesChecker(set)
	for where, e := range exprs {
		c.expr(where, e)
	}
	c.report(t, dashboardFile)
	for _, f := range set.families {
		if !c.used[f] {
			t.Errorf("%s: no panel shows %s, which the metrics module exports", dashboardFile, f)
		}
	}
}

// Every alert rule's expression parses and selects series the module
// exports (or client_golang's process collector, which the default
// registerer carries), by labels and values they carry; the promtool tests feed only
// such series, so that they test the rules against what Prometheus will
// scrape.
func TestAlertRulesUseOnlyExportedSeries(t *testing.T) {
	t.Parallel()
	set := withProcessSeries(t, scrapeEverySeries(t))
	rules, recorded := alertRules(t)
	c := newSeriesChecker(set)
	for _, r := range recorded {
		c.recorded[r] = true
	}
	for where, e := range rules {
		c.expr(where, e)
	}
	c.report(t, alertsFile)

	series, exprs := alertTests(t)
	tc := newSeriesChecker(set)
	for _, r := range recorded {
		tc.recorded[r] = true
	}
	for where, s := range series {
		tc.inputSeries(where, s)
	}
	for where, e := range exprs {
		tc.expr(where, e)
	}
	tc.report(t, alertsTestFile)
}

// The checker reports what a dashboard or a rule must not ask for: a name
// the module does not export, a histogram by its bare name, a label the
// series does not carry, a value no series has, a grouping by a label
// nothing below carries; and accepts a histogram's buckets, sum and count,
// the target's labels and Grafana's variables.
func TestSeriesCheckerRejectsWhatTheModuleDoesNotExport(t *testing.T) {
	t.Parallel()
	set := scrapeEverySeries(t)
	vars := map[string]string{"consumer": ".*", "window_hours": "360"}
	for _, tc := range []struct {
		name, expr string
		problem    string // "" when the expression is accepted
	}{
		{"exported counter", `sum by (consumer) (rate(inbox_messages_total{consumer=~"$consumer",outcome="failed"}[$__rate_interval]))`, ""},
		{"histogram buckets", `histogram_quantile(0.99, sum by (le) (rate(inbox_transaction_seconds_bucket[5m])))`, ""},
		{"histogram sum over count", `rate(inbox_outbox_relay_round_seconds_sum[5m]) / rate(inbox_outbox_relay_round_seconds_count[5m])`, ""},
		{"target labels", `inbox_rows{job="billing",instance=~".+"}`, ""},
		{"scalar arithmetic on a variable", `$window_hours * 3600 - max by (table) (inbox_oldest_row_age_seconds)`, ""},
		{"name not exported", `rate(inbox_messages_reused_total[5m])`, "inbox_messages_reused_total is not exported"},
		{"histogram by its bare name", `inbox_transaction_seconds`, "inbox_transaction_seconds is not exported"},
		{"buckets of a counter", `inbox_messages_total_bucket`, "is not exported"},
		{"label the series does not carry", `inbox_outbox_pending_messages{consumer="billing"}`, `has no label "consumer"`},
		{"value no series has", `inbox_messages_total{outcome="reused"}`, "no series has"},
		{"grouping by a label not below", `sum by (consumer) (inbox_outbox_pending_messages)`, "names a label no series under it carries: consumer"},
		{"matching on a label not on one side", `inbox_rows and on (consumer) inbox_messages_total`, "names a label no series under it carries: consumer"},
		{"selector without a name", `{table="watermill_inbox"}`, "selects no series by name"},
		{"names by alternation", `{__name__=~"inbox_rows|inbox_purge_rounds_total",table=~".+"}`, ""},
		{"alternation with a name not exported", `{__name__=~"inbox_rows|inbox_row_count"}`, "inbox_row_count is not exported"},
		{"alternation with a label one name lacks", `{__name__=~"inbox_rows|inbox_messages_total",consumer="billing"}`, `inbox_rows has no label "consumer"`},
		{"not PromQL", `rate(inbox_rows[5m]`, "does not parse"},
		{"unknown variable", `inbox_rows{table=~"$tables"}`, "unknown variables"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newSeriesChecker(set)
			if e, err := substitute(vars, tc.expr); err != nil {
				c.problem("expr", "%v", err)
			} else {
				c.expr("expr", e)
			}
			got := strings.Join(c.problems, "; ")
			switch {
			case tc.problem == "" && got != "":
				t.Errorf("%s: %s, want it accepted", tc.expr, got)
			case tc.problem != "" && !slices.ContainsFunc(c.problems, func(p string) bool { return strings.Contains(p, tc.problem) }):
				t.Errorf("%s: problems %q, want one saying %q", tc.expr, got, tc.problem)
			}
		})
	}
}

// Every aggregation of the dashboard keeps the job, and the purge panels'
// the consumer a purge is limited to: with the Job variable at All (its
// default) two services that each have a watermill_inbox, or a consumer of
// the same name, were merged (a healthy one's headroom and last successful
// round hiding the other's, their transaction quantiles mixed), and so were
// two purgers of consumers sharing a table. The alert rules group the same
// way.
func TestDashboardKeepsTheJobAndThePurgesConsumer(t *testing.T) {
	t.Parallel()
	_, _, exprs := dashboardQueries(t)
	p := parser.NewParser(parser.Options{})
	for where, e := range exprs {
		expr, err := p.ParseExpr(e)
		if err != nil {
			t.Errorf("%s: %v", where, err)
			continue
		}
		parser.Inspect(expr, func(n parser.Node, _ []parser.Node) error {
			agg, ok := n.(*parser.AggregateExpr)
			if !ok {
				return nil
			}
			if agg.Without || !slices.Contains(agg.Grouping, "job") {
				t.Errorf("%s: %s does not keep the job", where, agg)
			}
			inner := agg.Expr.String()
			if (strings.Contains(inner, "inbox_purge_") || strings.Contains(inner, "inbox_oldest_row_age_seconds")) &&
				!slices.Contains(agg.Grouping, "consumer") {
				t.Errorf("%s: %s groups a purge series without the consumer its purge is limited to", where, agg)
			}
			return nil
		})
	}
}

// The Job variable lists the service of a process that runs any one of the
// instrumented components alone (an inbox once it has seen a message, a
// purger, WatchTable, an outbox relay, WatchOutbox): it asked only for
// inbox_messages_total, so a service that only relays an outbox or only
// purges was missing from it, and with it every panel of that service.
func TestDashboardJobListsAServiceOfAnyInstrumentedComponent(t *testing.T) {
	t.Parallel()
	_, varQueries, _ := dashboardQueries(t)
	m := labelValuesQuery.FindStringSubmatch(varQueries["job"])
	if m == nil || m[1] == "" {
		t.Fatalf("the job variable's query %q is not label_values(selector, job)", varQueries["job"])
	}
	e, err := parser.NewParser(parser.Options{}).ParseExpr(m[1])
	vs, ok := e.(*parser.VectorSelector)
	if err != nil || !ok {
		t.Fatalf("the job variable's selector %q: not a selector (%v)", m[1], err)
	}
	selected := selectedNames(vs)

	for name, instrument := range map[string]func(t *testing.T, m *metrics.Metrics){
		"inbox": func(t *testing.T, m *metrics.Metrics) {
			db := testdb.OpenSQLite(t, filepath.Join(t.TempDir(), "inbox.db"))
			ib, err := inbox.New(m.Instrument(inbox.Config{DB: db}))
			if err != nil {
				t.Fatal(err)
			}
			if err := ib.InitializeSchema(t.Context()); err != nil {
				t.Fatal(err)
			}
			routeThroughInbox(t, ib)(message.NewMessage(watermill.NewUUID(), nil))
		},
		"purger": func(t *testing.T, m *metrics.Metrics) {
			m.InstrumentPurger(inbox.PurgerConfig{})
		},
		"WatchTable": func(t *testing.T, m *metrics.Metrics) {
			db := testdb.OpenSQLite(t, filepath.Join(t.TempDir(), "inbox.db"))
			if err := m.WatchTable(db, nil, ""); err != nil {
				t.Fatal(err)
			}
		},
		"outbox relay": func(t *testing.T, m *metrics.Metrics) {
			m.InstrumentOutbox(inbox.OutboxConfig{Table: inbox.DefaultOutboxTable})
		},
		"WatchOutbox": func(t *testing.T, m *metrics.Metrics) {
			db := testdb.OpenSQLite(t, filepath.Join(t.TempDir(), "inbox.db"))
			ob := newOutbox(t, db, inbox.SQLite, inbox.OutboxConfig{Table: inbox.DefaultOutboxTable, Publisher: &refusingBroker{}})
			if err := m.WatchOutbox(ob); err != nil {
				t.Fatal(err)
			}
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			reg := prometheus.NewRegistry()
			mt, err := metrics.New(reg)
			if err != nil {
				t.Fatal(err)
			}
			instrument(t, mt)
			mfs, err := reg.Gather()
			if err != nil {
				t.Fatal(err)
			}
			var exported []string
			for _, mf := range mfs {
				if slices.Contains(selected, mf.GetName()) {
					return
				}
				exported = append(exported, mf.GetName())
			}
			t.Errorf("the job variable asks for %v; a process with only this component exports none of them: %v", selected, exported)
		})
	}
}
