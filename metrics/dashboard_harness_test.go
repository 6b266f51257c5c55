package metrics_test

// The harness of the dashboard and alert tests: a run of every component
// the module instruments, its scrape as a set of series, and the checks of
// a PromQL expression (or a promtool input series, or a Grafana variable
// query) against that set.

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql/parser"
	"go.yaml.in/yaml/v3"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/metrics"
)

const (
	dashboardFile  = "grafana/inbox-dashboard.json"
	alertsFile     = "prometheus/inbox-alerts.yml"
	alertsTestFile = "prometheus/inbox-alerts_test.yml"
)

// targetLabels are the labels Prometheus adds to every scraped series.
var targetLabels = []string{"job", "instance"}

// seriesSet is what a scrape exports: each series name (a histogram's
// _bucket, _sum and _count, a summary's name, _sum and _count) with the
// values seen of each of its labels, and the metric family it belongs to.
type seriesSet struct {
	labels   map[string]map[string]map[string]bool // series name -> label -> values
	family   map[string]string                     // series name -> family name
	families []string                              // every family scraped, sorted
}

func newSeriesSet(mfs []*dto.MetricFamily) seriesSet {
	s := seriesSet{labels: map[string]map[string]map[string]bool{}, family: map[string]string{}}
	for _, mf := range mfs {
		name := mf.GetName()
		s.families = append(s.families, name)
		var names []string
		switch mf.GetType() {
		case dto.MetricType_HISTOGRAM:
			names = []string{name + "_bucket", name + "_sum", name + "_count"}
		case dto.MetricType_SUMMARY:
			names = []string{name, name + "_sum", name + "_count"}
		default:
			names = []string{name}
		}
		for _, n := range names {
			s.family[n] = name
			if s.labels[n] == nil {
				s.labels[n] = map[string]map[string]bool{}
			}
			for _, m := range mf.GetMetric() {
				for _, l := range m.GetLabel() {
					if s.labels[n][l.GetName()] == nil {
						s.labels[n][l.GetName()] = map[string]bool{}
					}
					s.labels[n][l.GetName()][l.GetValue()] = true
				}
				switch {
				case strings.HasSuffix(n, "_bucket"):
					s.labels[n]["le"] = map[string]bool{"+Inf": true}
				case mf.GetType() == dto.MetricType_SUMMARY && n == name:
					s.labels[n]["quantile"] = map[string]bool{}
				}
			}
		}
	}
	sort.Strings(s.families)
	return s
}

// withProcessSeries returns s with the series of client_golang's process
// collector, which prometheus.DefaultRegisterer carries beside the
// module's (InboxMessageIDReused, InboxPurgeRoundsFailing and
// InboxOutboxDeadLettered read process_start_time_seconds to see a
// restart).
func withProcessSeries(t *testing.T, s seriesSet) seriesSet {
	t.Helper()
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	p := newSeriesSet(mfs)
	for n, l := range p.labels {
		s.labels[n] = l
	}
	for n, f := range p.family {
		s.family[n] = f
	}
	s.families = append(slices.Clone(s.families), p.families...)
	sort.Strings(s.families)
	return s
}

// recordingRegisterer registers with reg and keeps the names of the
// families every registered collector describes.
type recordingRegisterer struct {
	*prometheus.Registry
	described map[string]bool
}

var descName = regexp.MustCompile(`fqName: "([^"]+)"`)

func (r *recordingRegisterer) Register(c prometheus.Collector) error {
	if err := r.Registry.Register(c); err != nil {
		return err
	}
	ch := make(chan *prometheus.Desc, 16)
	go func() { c.Describe(ch); close(ch) }()
	for d := range ch {
		if m := descName.FindStringSubmatch(d.String()); m != nil {
			r.described[m[1]] = true
		}
	}
	return nil
}

// scrapeEverySeries runs every component the module instruments on SQLite,
// each through its real code: a Watermill router with the instrumented
// inbox (a message processed, the same one again as a duplicate, one that
// fails), whose handler writes an output to an instrumented outbox, the
// outbox's relay (which sets one output aside and sends the other), a round
// of an instrumented purger, and the table and outbox gauges. It returns a
// scrape of the registry, and fails the test unless the scrape carries
// every family that the module registered: a series added to the code that
// this run does not produce must be produced here, so that the dashboard
// and alert checks see it.
func scrapeEverySeries(t *testing.T) seriesSet {
	t.Helper()
	db := testdb.OpenSQLite(t, filepath.Join(t.TempDir(), "inbox.db"))
	reg := &recordingRegisterer{Registry: prometheus.NewRegistry(), described: map[string]bool{}}
	m, err := metrics.New(reg)
	if err != nil {
		t.Fatal(err)
	}
	broker := &refusingBroker{refuse: map[string]bool{}}
	ob := newOutbox(t, db, inbox.SQLite, m.InstrumentOutbox(inbox.OutboxConfig{
		Table: inbox.DefaultOutboxTable, Publisher: broker, MaxAttempts: 1}))
	if err := m.WatchOutbox(ob); err != nil {
		t.Fatal(err)
	}
	ib, err := inbox.New(m.Instrument(inbox.Config{DB: db, Outbox: ob.Publisher}))
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := m.WatchTable(db, nil, ""); err != nil {
		t.Fatal(err)
	}

	deliver := runInvoicing(t, ib, broker)
	refused := message.NewMessage(watermill.NewUUID(), nil)
	broker.refuse[refused.UUID+"-invoice"] = true
	for _, msg := range []*message.Message{refused, refused.Copy(), message.NewMessage(watermill.NewUUID(), nil)} {
		if !deliver(msg) {
			t.Fatalf("delivery of %s nacked", msg.UUID)
		}
	}
	if deliver(message.NewMessage(watermill.NewUUID(), []byte("fail"))) {
		t.Fatal("a failing handler's message was acked")
	}
	reused := message.NewMessage(watermill.NewUUID(), []byte("order 1"))
	if !deliver(reused) || deliver(message.NewMessage(reused.UUID, []byte("order 2"))) {
		t.Fatal("a message id reused for other content was not refused")
	}
	relayUntilEmpty(t, ob)

	if _, err := db.Exec("INSERT INTO watermill_inbox (consumer, message_id, processed_at) VALUES ('old', 'x', CAST(unixepoch('subsec') * 1000000 AS INTEGER) - 7200000000)"); err != nil {
		t.Fatal(err)
	}
	p, err := inbox.NewPurger(m.InstrumentPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, OlderThan: time.Hour}}))
	if err != nil {
		t.Fatal(err)
	}
	if r := p.RunOnce(context.Background()); r.Err != nil || r.Deleted != 1 {
		t.Fatalf("purge round %+v, want 1 row deleted", r)
	}

	mfs, err := reg.Gather()
	if err != nil {
		t.Fatalf("scrape: %v", err)
	}
	s := newSeriesSet(mfs)
	for name := range reg.described {
		if !slices.Contains(s.families, name) {
			t.Errorf("the module registers %s but this run does not produce it: make scrapeEverySeries produce it", name)
		}
	}
	if t.Failed() {
		t.FailNow()
	}
	return s
}

// seriesChecker checks PromQL expressions against a scrape and collects the
// problems found. Names listed in recorded (recording rules) are accepted
// without label checks.
type seriesChecker struct {
	set      seriesSet
	recorded map[string]bool
	parser   parser.Parser
	used     map[string]bool // families the checked expressions use
	problems []string
}

func newSeriesChecker(set seriesSet) *seriesChecker {
	return &seriesChecker{set: set, recorded: map[string]bool{}, parser: parser.NewParser(parser.Options{}),
		used: map[string]bool{}}
}

func (c *seriesChecker) problem(where, format string, args ...any) {
	c.problems = append(c.problems, where+": "+fmt.Sprintf(format, args...))
}

// expr checks that expr parses, that each of its selectors names a series
// the scrape has, matches only on labels that series carries (or the
// target's job and instance) and, where it asks for a value (= or =~), one
// the scrape has; and that every label an aggregation groups by, or a
// binary operation matches on, is carried by a series below it.
func (c *seriesChecker) expr(where, expr string) {
	e, err := c.parser.ParseExpr(expr)
	if err != nil {
		c.problem(where, "%q does not parse: %v", expr, err)
		return
	}
	parser.Inspect(e, func(n parser.Node, _ []parser.Node) error {
		switch n := n.(type) {
		case *parser.VectorSelector:
			c.selector(where, n)
		case *parser.AggregateExpr:
			if !n.Without {
				c.labelsBelow(where, n.Expr, n.Grouping, "by")
			}
		case *parser.BinaryExpr:
			if vm := n.VectorMatching; vm != nil && vm.On {
				c.labelsBelow(where, n.LHS, vm.MatchingLabels, "on")
				c.labelsBelow(where, n.RHS, vm.MatchingLabels, "on")
			}
		}
		return nil
	})
}

// selector checks one vector selector: see expr. It records the family
// of the series it selects in c.used.
func (c *seriesChecker) selector(where string, vs *parser.VectorSelector) {
	name := vs.Name
	if name == "" {
		for _, m := range vs.LabelMatchers {
			switch {
			case m.Name == "__name__" && m.Type == labels.MatchEqual:
				name = m.Value
			case m.Name == "__name__" && m.Type == labels.MatchRegexp && metricNames.MatchString(m.Value):
				// {__name__=~"a|b"}: each name is checked as a selector
				// of its own, with the other matchers.
				for _, n := range strings.Split(m.Value, "|") {
					c.selectorNamed(where, vs, n)
				}
				return
			}
		}
	}
	if name == "" {
		c.problem(where, "%s selects no series by name", vs)
		return
	}
	c.selectorNamed(where, vs, name)
}

// metricNames matches a regular expression that is an alternation of
// metric names, nothing else.
var metricNames = regexp.MustCompile(`^[a-zA-Z_:][a-zA-Z0-9_:]*(\|[a-zA-Z_:][a-zA-Z0-9_:]*)*$`)

// selectorNamed checks vs as a selector of the series name (see expr).
func (c *seriesChecker) selectorNamed(where string, vs *parser.VectorSelector, name string) {
	if c.recorded[name] {
		return
	}
	carried, ok := c.set.labels[name]
	if !ok {
		c.problem(where, "%s is not exported by the metrics module", name)
		return
	}
	c.used[c.set.family[name]] = true
	for _, m := range vs.LabelMatchers {
		if m.Name == "__name__" || slices.Contains(targetLabels, m.Name) {
			continue
		}
		values, ok := carried[m.Name]
		if !ok {
			c.problem(where, "%s has no label %q (%s)", name, m.Name, vs)
			continue
		}
		if m.Name == "le" || m.Name == "quantile" || (m.Value == "" && m.Type != labels.MatchRegexp) {
			continue
		}
		if m.Type == labels.MatchEqual || m.Type == labels.MatchRegexp {
			if !slices.ContainsFunc(mapKeys(values), m.Matches) {
				c.problem(where, "%s: no series has %s (values seen: %v)", name, m, mapKeys(values))
			}
		}
	}
}

// labelsBelow checks that each of names is carried by a series selected
// under n (le by a histogram's buckets), or is the target's job or
// instance. Labels dropped by an aggregation under n still count.
func (c *seriesChecker) labelsBelow(where string, n parser.Node, names []string, clause string) {
	carried := map[string]bool{}
	for _, l := range targetLabels {
		carried[l] = true
	}
	parser.Inspect(n, func(n parser.Node, _ []parser.Node) error {
		if vs, ok := n.(*parser.VectorSelector); ok {
			if c.recorded[vs.Name] {
				carried["*"] = true
			}
			for l := range c.set.labels[vs.Name] {
				carried[l] = true
			}
		}
		return nil
	})
	if carried["*"] {
		return
	}
	for _, l := range names {
		if !carried[l] {
			c.problem(where, "%s (%s) names a label no series under it carries: %s", clause, strings.Join(names, ", "), l)
		}
	}
}

// inputSeries checks a promtool test's input series: it names an exported
// series with labels that series carries (or job and instance).
func (c *seriesChecker) inputSeries(where, series string) {
	ls, err := c.parser.ParseMetric(series)
	if err != nil {
		c.problem(where, "%q does not parse: %v", series, err)
		return
	}
	name := ls.Get("__name__")
	carried, ok := c.set.labels[name]
	if !ok {
		c.problem(where, "%s is not exported by the metrics module", name)
		return
	}
	ls.Range(func(l labels.Label) {
		if _, ok := carried[l.Name]; !ok && l.Name != "__name__" && !slices.Contains(targetLabels, l.Name) {
			c.problem(where, "%s has no label %q", name, l.Name)
		}
	})
}

func mapKeys(m map[string]bool) []string { return slices.Sorted(maps.Keys(m)) }

// dashboard is the part of a Grafana dashboard's JSON model the checks
// read; panels are walked as raw JSON so that a query anywhere (a row's
// collapsed panels, a library panel inlined) is found.
type dashboard struct {
	Templating struct {
		List []dashboardVariable `json:"list"`
	} `json:"templating"`
	Panels []json.RawMessage `json:"panels"`
}

type dashboardVariable struct {
	Name       string          `json:"name"`
	Type       string          `json:"type"`
	Query      json.RawMessage `json:"query"`
	Definition string          `json:"definition"`
	IncludeAll bool            `json:"includeAll"`
	AllValue   string          `json:"allValue"`
	Current    struct {
		Value json.RawMessage `json:"value"`
	} `json:"current"`
}

// query returns the variable's query: a string, or the "query" of the
// object recent Grafana versions store.
func (v dashboardVariable) query() string {
	var s string
	if json.Unmarshal(v.Query, &s) == nil {
		return s
	}
	var o struct {
		Query string `json:"query"`
	}
	if json.Unmarshal(v.Query, &o) == nil && o.Query != "" {
		return o.Query
	}
	return v.Definition
}

// builtinVariables are Grafana's own variables, with the values a query is
// checked with.
var builtinVariables = map[string]string{
	"__rate_interval": "5m", "__interval": "1m", "__range": "6h",
	"__interval_ms": "60000", "__range_s": "21600", "__range_ms": "21600000",
}

var variableRef = regexp.MustCompile(`\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]`)

// substitute replaces the dashboard's and Grafana's variables in expr with
// the values a dashboard shows by default: a query variable's "All" value,
// a textbox's text; it reports any other $ reference as a problem.
func substitute(vars map[string]string, expr string) (string, error) {
	var unknown []string
	out := variableRef.ReplaceAllStringFunc(expr, func(ref string) string {
		m := variableRef.FindStringSubmatch(ref)
		name := m[1] + m[2] + m[3]
		if v, ok := vars[name]; ok {
			return v
		}
		if v, ok := builtinVariables[name]; ok {
			return v
		}
		unknown = append(unknown, ref)
		return ref
	})
	if len(unknown) > 0 {
		return "", fmt.Errorf("unknown variables %v", unknown)
	}
	return out, nil
}

// dashboardQueries reads the dashboard file and returns its variables'
// default values, its variables' queries by variable name, and its panels'
// PromQL expressions (variables substituted) by "panel title/refId".
func dashboardQueries(t *testing.T) (vars map[string]string, varQueries, exprs map[string]string) {
	t.Helper()
	raw, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	if err := json.Unmarshal(raw, &d); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	vars, varQueries, exprs = map[string]string{}, map[string]string{}, map[string]string{}
	for _, v := range d.Templating.List {
		switch v.Type {
		case "datasource":
		case "query":
			varQueries[v.Name] = v.query()
			if v.IncludeAll {
				vars[v.Name] = cmp.Or(v.AllValue, ".*")
			}
		default: // textbox, constant, custom
			vars[v.Name] = v.query()
		}
		if _, ok := vars[v.Name]; !ok && v.Type != "datasource" {
			var s string
			if json.Unmarshal(v.Current.Value, &s) == nil {
				vars[v.Name] = s
			}
		}
	}
	var walk func(title string, v any)
	walk = func(title string, v any) {
		switch v := v.(type) {
		case map[string]any:
			if s, ok := v["title"].(string); ok {
				title = s
			}
			if targets, ok := v["targets"].([]any); ok {
				for i, tg := range targets {
					tm, _ := tg.(map[string]any)
					ref, _ := tm["refId"].(string)
					where := fmt.Sprintf("panel %q target %d %s", title, i, ref)
					expr, ok := tm["expr"].(string)
					if !ok || strings.TrimSpace(expr) == "" {
						t.Errorf("%s: no PromQL expr", where)
						continue
					}
					sub, err := substitute(vars, expr)
					if err != nil {
						t.Errorf("%s: %v in %q", where, err, expr)
						continue
					}
					exprs[where] = sub
				}
			}
			for k, child := range v {
				if k != "targets" {
					walk(title, child)
				}
			}
		case []any:
			for _, child := range v {
				walk(title, child)
			}
		}
	}
	for _, p := range d.Panels {
		var v any
		if err := json.Unmarshal(p, &v); err != nil {
			t.Fatal(err)
		}
		walk("", v)
	}
	if len(exprs) == 0 {
		t.Fatalf("%s: no panel queries found", dashboardFile)
	}
	return vars, varQueries, exprs
}

var labelValuesQuery = regexp.MustCompile(`^\s*label_values\((?:(.*),)?\s*(\w+)\s*\)\s*$`)

// variableQuery checks a Grafana query variable's Prometheus query:
// label_values(selector, label) or label_values(label), and
// query_result(expr).
func (c *seriesChecker) variableQuery(where, q string, vars map[string]string) {
	q, err := substitute(vars, q)
	if err != nil {
		c.problem(where, "%v", err)
		return
	}
	if m := labelValuesQuery.FindStringSubmatch(q); m != nil {
		if m[1] == "" {
			for _, labels := range c.set.labels {
				if _, ok := labels[m[2]]; ok {
					return
				}
			}
			c.problem(where, "no exported series has the label %q", m[2])
			return
		}
		c.expr(where, m[1])
		e, err := c.parser.ParseExpr(m[1])
		if vs, ok := e.(*parser.VectorSelector); err == nil && ok {
			for _, name := range selectedNames(vs) {
				if _, ok := c.set.labels[name][m[2]]; !ok && c.set.labels[name] != nil && !slices.Contains(targetLabels, m[2]) {
					c.problem(where, "%s has no label %q", name, m[2])
				}
			}
		}
		return
	}
	if inner, ok := strings.CutPrefix(strings.TrimSpace(q), "query_result("); ok {
		c.expr(where, strings.TrimSuffix(strings.TrimSpace(inner), ")"))
		return
	}
	c.problem(where, "query %q is neither label_values nor query_result", q)
}

// alertRules returns the expressions of the rules file by "alert NAME" or
// "record NAME", and the names of its recording rules.
func alertRules(t *testing.T) (exprs map[string]string, recorded []string) {
	t.Helper()
	var f struct {
		Groups []struct {
			Name  string `yaml:"name"`
			Rules []struct {
				Alert  string `yaml:"alert"`
				Record string `yaml:"record"`
				Expr   string `yaml:"expr"`
			} `yaml:"rules"`
		} `yaml:"groups"`
	}
	readYAML(t, alertsFile, &f)
	exprs = map[string]string{}
	for _, g := range f.Groups {
		for _, r := range g.Rules {
			where := "alert " + r.Alert
			if r.Record != "" {
				where = "record " + r.Record
				recorded = append(recorded, r.Record)
			}
			exprs[where] = r.Expr
		}
	}
	if len(exprs) == 0 {
		t.Fatalf("%s: no rules", alertsFile)
	}
	return exprs, recorded
}

// alertTests returns the input series and PromQL expressions of the
// promtool test file.
func alertTests(t *testing.T) (series, exprs map[string]string) {
	t.Helper()
	var f struct {
		Tests []struct {
			InputSeries []struct {
				Series string `yaml:"series"`
			} `yaml:"input_series"`
			PromQLExprTest []struct {
				Expr string `yaml:"expr"`
			} `yaml:"promql_expr_test"`
		} `yaml:"tests"`
	}
	readYAML(t, alertsTestFile, &f)
	series, exprs = map[string]string{}, map[string]string{}
	for i, tc := range f.Tests {
		for j, s := range tc.InputSeries {
			series[fmt.Sprintf("test %d input series %d", i, j)] = s.Series
		}
		for j, e := range tc.PromQLExprTest {
			exprs[fmt.Sprintf("test %d promql_expr_test %d", i, j)] = e.Expr
		}
	}
	if len(series) == 0 {
		t.Fatalf("%s: no input series", alertsTestFile)
	}
	return series, exprs
}

func readYAML(t *testing.T, path string, v any) {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(raw, v); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}

// report fails t with every problem c found, sorted.
func (c *seriesChecker) report(t *testing.T, file string) {
	t.Helper()
	sort.Strings(c.problems)
	for _, p := range c.problems {
		t.Errorf("%s: %s", file, p)
	}
}

// selectedNames returns the metric names vs selects: its name, or those of
// a {__name__=~"a|b"} matcher.
func selectedNames(vs *parser.VectorSelector) []string {
	if vs.Name != "" {
		return []string{vs.Name}
	}
	for _, m := range vs.LabelMatchers {
		if m.Name == "__name__" && (m.Type == labels.MatchEqual || m.Type == labels.MatchRegexp) {
			return strings.Split(m.Value, "|")
		}
	}
	return nil
}
