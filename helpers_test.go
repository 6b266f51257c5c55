package inbox_test

import (
	"context"
	"fmt"
	"runtime/pprof"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	_ "github.com/go-sql-driver/mysql"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/jmoiron/sqlx"
	_ "modernc.org/sqlite"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

type testDB = testdb.DB

var testDBs = testdb.All

var (
	randomSuffix = testdb.RandomSuffix
	dropLater    = testdb.DropLater
	openSQLite   = testdb.OpenSQLite
)

// dialectOf maps a test's *sqlx.DB to the dialect its inbox must use, for
// the dialects that are not inferred from the driver (PostgreSQLPartitioned).
var dialectOf sync.Map

// forEachDB runs f as a parallel subtest on every test database.
func forEachDB(t *testing.T, f func(t *testing.T, tdb testDB, db *sqlx.DB)) {
	t.Helper()
	for _, tdb := range testDBs {
		t.Run(tdb.Name, func(t *testing.T) {
			t.Parallel()
			db := tdb.Open(t)
			dialectOf.Store(db, tdb.Dialect)
			f(t, tdb, db)
		})
	}
}

func exec(t testing.TB, db *sqlx.DB, query string, args ...any) {
	t.Helper()
	if _, err := db.ExecContext(context.Background(), db.Rebind(query), args...); err != nil {
		t.Fatalf("%s: %v", query, err)
	}
}

func count(t testing.TB, db *sqlx.DB, table, where string, args ...any) int {
	t.Helper()
	q := "SELECT COUNT(*) FROM " + table
	if where != "" {
		q += " WHERE " + where
	}
	var n int
	if err := db.GetContext(context.Background(), &n, db.Rebind(q), args...); err != nil {
		t.Fatalf("%s: %v", q, err)
	}
	return n
}

// fixture is one test's inbox table and business table on one database.
type fixture struct {
	t        *testing.T
	db       *sqlx.DB
	inbox    string // inbox table name
	business string // business table: one row per processed (consumer, message)
}

func newFixture(t *testing.T, db *sqlx.DB) *fixture {
	t.Helper()
	s := randomSuffix()
	f := &fixture{t: t, db: db, inbox: "inbox_" + s, business: "business_" + s}
	exec(t, db, "CREATE TABLE "+f.business+" (id VARCHAR(255) NOT NULL PRIMARY KEY, consumer VARCHAR(255) NOT NULL)")
	dropLater(t, db, f.business)
	dropLater(t, db, f.inbox)
	return f
}

// newInbox creates an inbox on the fixture's table (schema included).
func (f *fixture) newInbox(cfg inbox.Config) *inbox.Inbox {
	f.t.Helper()
	cfg.DB = f.db
	cfg.Table = f.inbox
	if d, ok := dialectOf.Load(f.db); ok && cfg.Dialect == nil {
		cfg.Dialect = d.(inbox.Dialect)
	}
	ib, err := inbox.New(cfg)
	if err != nil {
		f.t.Fatal(err)
	}
	if err := ib.InitializeSchema(context.Background()); err != nil {
		f.t.Fatal(err)
	}
	return ib
}

// writeBusinessRow is what a real handler does: a write through the inbox
// transaction, keyed by consumer and message UUID.
func (f *fixture) writeBusinessRow(msg *message.Message) error {
	tx, ok := inbox.TxFromContext(msg.Context())
	if !ok {
		return fmt.Errorf("no inbox transaction in the message context")
	}
	consumer := message.HandlerNameFromCtx(msg.Context())
	_, err := tx.ExecContext(msg.Context(), tx.Rebind("INSERT INTO "+f.business+" (id, consumer) VALUES (?, ?)"),
		consumer+":"+msg.UUID, consumer)
	return err
}

func (f *fixture) businessRows() int { return count(f.t, f.db, f.business, "") }
func (f *fixture) inboxRows() int    { return count(f.t, f.db, f.inbox, "") }

// feed is a message.Subscriber for one handler that delivers exactly the
// messages a test hands it and reports whether the router acked or nacked
// each one. Unlike a broker it never redelivers by itself: a redelivery is a
// test calling deliver again with the same message.
type feed struct {
	ch        chan *message.Message
	closed    chan struct{}
	closeOnce sync.Once
}

func newFeed() *feed { return &feed{ch: make(chan *message.Message), closed: make(chan struct{})} }

// Subscribe returns a channel that, as every Watermill subscriber's does,
// closes when ctx ends or the feed is closed: Watermill's router may stop a
// handler through either (in v1.5.1 it does not always call Close).
func (f *feed) Subscribe(ctx context.Context, _ string) (<-chan *message.Message, error) {
	out := make(chan *message.Message)
	go func() {
		defer close(out)
		for {
			select {
			case <-ctx.Done():
				return
			case <-f.closed:
				return
			case m := <-f.ch:
				select {
				case out <- m:
				case <-ctx.Done():
					return
				case <-f.closed:
					return
				}
			}
		}
	}()
	return out, nil
}

func (f *feed) Close() error {
	f.closeOnce.Do(func() { close(f.closed) })
	return nil
}

// deliver sends a fresh copy of msg (same UUID, payload and metadata, a new
// context and ack channels, as a broker redelivery has) and waits for the
// router's ack (true) or nack (false).
func (f *feed) deliver(t testing.TB, msg *message.Message) bool {
	t.Helper()
	m := msg.Copy()
	select {
	case f.ch <- m:
	case <-time.After(30 * time.Second):
		t.Fatalf("message %s: router did not take it within 30s", msg.UUID)
	}
	select {
	case <-m.Acked():
		return true
	case <-m.Nacked():
		return false
	case <-time.After(30 * time.Second):
		t.Fatalf("message %s: neither acked nor nacked within 30s", msg.UUID)
		return false
	}
}

// runRouter starts a router configured by setup and closes it when the test ends.
func runRouter(t testing.TB, setup func(r *message.Router)) *message.Router {
	t.Helper()
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	setup(r)
	errc := make(chan error, 1)
	go func() { errc <- r.Run(context.Background()) }()
	select {
	case <-r.Running():
	case err := <-errc:
		t.Fatalf("router stopped: %v", err)
	}
	t.Cleanup(func() {
		if err := r.Close(); err != nil {
			var stacks strings.Builder
			_ = pprof.Lookup("goroutine").WriteTo(&stacks, 1)
			t.Errorf("close router: %v; goroutines:\n%s", err, stacks.String())
		}
	})
	return r
}

// recorder is a middleware placed outside the inbox that records what the
// router receives from it for each delivery.
type recorder struct {
	mu   sync.Mutex
	errs []error
}

func (r *recorder) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		msgs, err := h(msg)
		r.mu.Lock()
		r.errs = append(r.errs, err)
		r.mu.Unlock()
		return msgs, err
	}
}

func (r *recorder) last() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.errs) == 0 {
		return nil
	}
	return r.errs[len(r.errs)-1]
}

// calls counts handler calls per message UUID.
type calls struct {
	mu sync.Mutex
	n  map[string]int
}

func (c *calls) inc(id string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n == nil {
		c.n = map[string]int{}
	}
	c.n[id]++
}

func (c *calls) get(id string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[id]
}

// isPostgres reports whether d is one of the PostgreSQL dialects.
func isPostgres(d inbox.Dialect) bool {
	return d == inbox.PostgreSQL || d == inbox.PostgreSQLPartitioned
}
