package pgxinbox_test

// Fixtures and routers for the pgx inbox's tests: a table pair per test, a
// feed that delivers exactly the messages a test hands it and reports the
// router's ack or nack, middlewares that record what the router receives,
// and helpers that read the server's view (rows, lock waiters).

import (
	"context"
	"fmt"
	"net/url"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/internal/testrouter"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// caseTimeout bounds every wait: a hang fails the test instead of stalling
// the suite. It is a bound, never a measurement.
const caseTimeout = 60 * time.Second

// dialects are the dialects a pgx inbox accepts.
var dialects = []struct {
	name    string
	dialect inbox.Dialect
}{
	{"postgres", inbox.PostgreSQL},
	{"partitioned", inbox.PostgreSQLPartitioned},
}

// forEachDialect runs test once per dialect, in parallel.
func forEachDialect(t *testing.T, test func(t *testing.T, d inbox.Dialect)) {
	t.Helper()
	t.Parallel()
	for _, d := range dialects {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			test(t, d.dialect)
		})
	}
}

// fixture is one test's inbox table and business table on a pgx pool.
type fixture struct {
	t             *testing.T
	pool          *pgxpool.Pool
	sfx           string
	table, effect string
}

// newFixture creates the business table (message_id text) and names the
// inbox table; both are dropped when t ends.
func newFixture(t *testing.T, pool *pgxpool.Pool) *fixture {
	return newFixtureWith(t, pool, "(message_id text NOT NULL)")
}

// newFixtureWith creates the business table with the column list cols.
func newFixtureWith(t *testing.T, pool *pgxpool.Pool, cols string) *fixture {
	t.Helper()
	sfx := testdb.RandomSuffix()
	f := &fixture{t: t, pool: pool, sfx: sfx, table: "pgx_inbox_" + sfx, effect: "pgx_effect_" + sfx}
	f.exec("CREATE TABLE " + f.effect + " " + cols)
	f.dropLater(f.table, f.effect)
	return f
}

// dropLater drops the tables when the test ends, with a context of its own.
func (f *fixture) dropLater(tables ...string) {
	f.t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		for _, tbl := range tables {
			if _, err := f.pool.Exec(ctx, "DROP TABLE IF EXISTS "+tbl+" CASCADE"); err != nil {
				f.t.Logf("drop %s: %v", tbl, err)
			}
		}
	})
}

func (f *fixture) exec(sql string, args ...any) {
	f.t.Helper()
	if _, err := f.pool.Exec(context.Background(), sql, args...); err != nil {
		f.t.Fatalf("%s: %v", sql, err)
	}
}

// newInbox makes an inbox on the fixture's pool and table (unless cfg names
// others), creates its table and closes it when the test ends.
func (f *fixture) newInbox(cfg pgxinbox.Config) *pgxinbox.Inbox {
	f.t.Helper()
	if cfg.Pool == nil {
		cfg.Pool = f.pool
	}
	if cfg.Table == "" {
		cfg.Table = f.table
	}
	ib, err := pgxinbox.New(cfg)
	if err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(func() {
		if err := ib.Close(); err != nil {
			f.t.Errorf("close inbox: %v", err)
		}
	})
	if err := ib.InitializeSchema(context.Background()); err != nil {
		f.t.Fatal(err)
	}
	return ib
}

// writeEffect is a handler: it inserts the message's UUID into the
// business table through the inbox's pgx transaction.
func (f *fixture) writeEffect(msg *message.Message) error {
	tx, ok := pgxinbox.TxFromContext(msg.Context())
	if !ok {
		return fmt.Errorf("message %s: no pgx transaction in its context", msg.UUID)
	}
	_, err := tx.Exec(msg.Context(), "INSERT INTO "+f.effect+" (message_id) VALUES ($1)", msg.UUID)
	return err
}

func (f *fixture) count(table string) int {
	f.t.Helper()
	var n int
	if err := f.pool.QueryRow(context.Background(), "SELECT count(*) FROM "+table).Scan(&n); err != nil {
		f.t.Fatal(err)
	}
	return n
}

func (f *fixture) effects() int   { return f.count(f.effect) }
func (f *fixture) inboxRows() int { return f.count(f.table) }

// expectRows fails the test unless the business and inbox tables hold
// effects and inboxRows rows.
func (f *fixture) expectRows(effects, inboxRows int) {
	f.t.Helper()
	if e, i := f.effects(), f.inboxRows(); e != effects || i != inboxRows {
		f.t.Errorf("business rows %d, inbox rows %d, want %d and %d", e, i, effects, inboxRows)
	}
}

// expectNoConnHeld fails the test if a connection of pool stays checked
// out. pgxpool destroys a closed connection (one whose COMMIT was cancelled,
// or whose server went away) in a goroutine of its own and counts it as
// acquired until then: a connection counts as leaked when it is still
// acquired after caseTimeout.
func expectNoConnHeld(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	deadline := time.Now().Add(caseTimeout)
	for pool.Stat().AcquiredConns() != 0 {
		if time.Now().After(deadline) {
			t.Errorf("%d connections still acquired", pool.Stat().AcquiredConns())
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// openPool opens a pgx pool of the test PostgreSQL, on its database db
// ("" for the test database), configured by configure (may be nil). Each
// connection has application_name app, so that lockWaiters can find them.
func openPool(t *testing.T, db, app string, configure func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	testdb.OpenPgxPool(t, "") // skips, or fails in CI, without a server
	u, err := url.Parse(testdb.PostgresDSN())
	if err != nil || u.Scheme == "" {
		t.Skipf("needs a URL-form %s: %v", testdb.PostgresDSNEnv, err)
	}
	if db != "" {
		u.Path = "/" + db
	}
	q := u.Query()
	q.Set("application_name", app)
	u.RawQuery = q.Encode()
	cfg, err := pgxpool.ParseConfig(u.String())
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 8
	if configure != nil {
		configure(cfg)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// slowCommitPool opens a pool on PostgreSQL's "postgres" database: the slow
// COMMITs of the tests that use it hold a snapshot for seconds, and
// DETACH PARTITION ... FINALIZE in the "test" database (the root package's
// partition tests) waits for every older snapshot there.
func slowCommitPool(t *testing.T) *pgxpool.Pool {
	return openPool(t, "postgres", "pgxinbox_slow_"+testdb.RandomSuffix(), nil)
}

// slowCommit makes every COMMIT of a transaction that inserted into the
// business table take d: a deferred constraint trigger sleeps at COMMIT.
func (f *fixture) slowCommit(d time.Duration) {
	f.t.Helper()
	fn := f.effect + "_slow_commit"
	f.exec("CREATE FUNCTION " + fn + "() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(" +
		strconv.FormatFloat(d.Seconds(), 'f', 3, 64) + "); RETURN NULL; END $$")
	f.t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		f.pool.Exec(ctx, "DROP FUNCTION IF EXISTS "+fn+" CASCADE")
	})
	f.exec("CREATE CONSTRAINT TRIGGER " + fn + " AFTER INSERT ON " + f.effect +
		" DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION " + fn + "()")
}

// fastCommit undoes slowCommit for the COMMITs that start from now on.
func (f *fixture) fastCommit() {
	f.t.Helper()
	f.exec("CREATE OR REPLACE FUNCTION " + f.effect + "_slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END $$")
}

// lockWaiters returns how many backends with application_name app wait on
// a lock (a row lock of a claim, or the partitioned dialect's key lock).
func lockWaiters(t *testing.T, pool *pgxpool.Pool, app string) int {
	t.Helper()
	var n int
	err := pool.QueryRow(context.Background(),
		"SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock'", app).Scan(&n)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// waitFor polls cond until it holds, failing the test after caseTimeout.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(caseTimeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, caseTimeout)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// feed is internal/testrouter's Feed, a message.Subscriber that delivers
// exactly the messages a test hands it and reports whether the router acked
// or nacked each. It never redelivers by itself: a redelivery is the test
// delivering a copy again.
type feed struct{ *testrouter.Feed }

func newFeed() *feed { return &feed{testrouter.NewFeed()} }

// deliver is Feed.Deliver: a fresh copy of msg, and whether it was acked.
func (f *feed) deliver(t *testing.T, msg *message.Message) bool {
	t.Helper()
	return f.Deliver(t, msg)
}

// deliverAsync is Feed.DeliverAsync: a copy of msg delivered in a
// goroutine; the channel yields whether it was acked.
func (f *feed) deliverAsync(t *testing.T, msg *message.Message) <-chan bool {
	return f.DeliverAsync(t, msg)
}

// labelled returns a copy of msg with a delivery label in its metadata, so
// that handlers and recorders tell deliveries apart.
func labelled(msg *message.Message, label string) *message.Message {
	m := msg.Copy()
	m.Metadata.Set("delivery", label)
	return m
}

// runRouter is testrouter.Start: a router configured by setup, running,
// closed when the test ends.
func runRouter(t *testing.T, setup func(r *message.Router)) *message.Router {
	t.Helper()
	return testrouter.Start(t, setup)
}

// consume runs h behind ib's middleware (and the middlewares before it,
// outermost first) as the router's handler "billing", and returns the feed
// that delivers to it.
func consume(t *testing.T, ib *pgxinbox.Inbox, h message.NoPublishHandlerFunc, outer ...message.HandlerMiddleware) *feed {
	t.Helper()
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(append(outer, ib.Middleware)...)
		r.AddConsumerHandler("billing", "orders", in, h)
	})
	return in
}

// recorder is internal/testrouter's Outcomes, a middleware outside the
// inbox that records the error the router receives for each delivery, by
// delivery label, with this package's method names.
type recorder struct{ testrouter.Outcomes }

// last returns the error of the last delivery; nil when there was none.
func (r *recorder) last() error { return r.LastOr(nil) }

// lastOf returns the error of the last delivery labelled label.
func (r *recorder) lastOf(label string) error { return r.LastOf(label) }

// hookCounts counts the inbox's outcome hooks and keeps their events.
type hookCounts struct {
	processed, duplicates, failed atomic.Int32
	mu                            sync.Mutex
	events                        []inbox.Event
}

func (c *hookCounts) config(cfg pgxinbox.Config) pgxinbox.Config {
	keep := func(n *atomic.Int32) func(inbox.Event) {
		return func(e inbox.Event) {
			n.Add(1)
			c.mu.Lock()
			c.events = append(c.events, e)
			c.mu.Unlock()
		}
	}
	cfg.OnProcessed = keep(&c.processed)
	cfg.OnDuplicate = keep(&c.duplicates)
	cfg.OnFailed = keep(&c.failed)
	return cfg
}

func (c *hookCounts) get() [3]int32 {
	return [3]int32{c.processed.Load(), c.duplicates.Load(), c.failed.Load()}
}

// calls counts handler calls by delivery label ("" counts all).
type calls struct {
	mu sync.Mutex
	n  map[string]int
}

func (c *calls) inc(msg *message.Message) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n == nil {
		c.n = map[string]int{}
	}
	c.n[""]++
	if l := msg.Metadata.Get("delivery"); l != "" {
		c.n[l]++
	}
}

func (c *calls) get(label string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[label]
}
