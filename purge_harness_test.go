package inbox_test

// Inbox rows of a chosen age, a fixed safe window, a probe of the purge
// lock, a Purger that counts its rounds, a router whose Run fails after
// loading the Purger's plugin, and a count of the plugin's goroutines.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// fixedWindow is a WindowSource that reports a fixed safe window.
type fixedWindow time.Duration

func (w fixedWindow) SafeWindow(context.Context) (time.Duration, error) { return time.Duration(w), nil }

// settableWindow is a WindowSource whose safe window (or error) the test
// sets between purges, as a broker's retention changes.
type settableWindow struct {
	mu     sync.Mutex
	window time.Duration
	err    error
}

func (w *settableWindow) set(window time.Duration, err error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.window, w.err = window, err
}

func (w *settableWindow) SafeWindow(context.Context) (time.Duration, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.window, w.err
}

// agoSQL returns an SQL expression for "the database's now minus d", in the
// representation of processed_at.
func agoSQL(d inbox.Dialect, ago time.Duration) string {
	us := ago.Microseconds()
	switch d {
	case inbox.PostgreSQL, inbox.PostgreSQLPartitioned:
		return fmt.Sprintf("now() - interval '%d microseconds'", us)
	case inbox.MySQL:
		return fmt.Sprintf("UTC_TIMESTAMP(6) - INTERVAL %d MICROSECOND", us)
	default:
		return fmt.Sprintf("CAST(unixepoch('subsec') * 1000000 AS INTEGER) - %d", us)
	}
}

// insertRows adds n inbox rows for consumer, processed ago before now by the
// database clock, in one statement per 500 rows.
func insertRows(t *testing.T, db *sqlx.DB, d inbox.Dialect, table, consumer, prefix string, n int, ago time.Duration) {
	t.Helper()
	for start := 0; start < n; start += 500 {
		var values []string
		for i := start; i < min(n, start+500); i++ {
			values = append(values, fmt.Sprintf("('%s', '%s-%d', %s)", consumer, prefix, i, agoSQL(d, ago)))
		}
		exec(t, db, "INSERT INTO "+table+" (consumer, message_id, processed_at) VALUES "+strings.Join(values, ", "))
	}
}

// lockFree reports whether another instance could take the purge lock of
// table now (taking and releasing it on a probe connection).
// eventuallyLockFree polls lockFree for up to 10 s.
func eventuallyLockFree(t *testing.T, probe *sqlx.DB, d inbox.Dialect, table string) bool {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if lockFree(t, probe, d, table) {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func lockFree(t *testing.T, probe *sqlx.DB, d inbox.Dialect, table string) bool {
	t.Helper()
	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: probe, Dialect: d, Table: table, OlderThan: time.Hour}})
	if err != nil {
		t.Fatal(err)
	}
	release, got, err := inbox.PurgeLock(context.Background(), probe, p)
	if err != nil {
		t.Fatal(err)
	}
	if got {
		if err := release(); err != nil {
			t.Fatal(err)
		}
	}
	return got
}

// countingPurger returns a Purger of table on db (OlderThan one hour) that
// starts a round every interval, and the count of its rounds.
func countingPurger(t *testing.T, db *sqlx.DB, table string, interval time.Duration) (*inbox.Purger, *atomic.Int32) {
	t.Helper()
	rounds := new(atomic.Int32)
	p, err := inbox.NewPurger(inbox.PurgerConfig{
		Purge:    inbox.PurgeConfig{DB: db, Table: table, OlderThan: time.Hour},
		Interval: interval,
		OnRound:  func(inbox.PurgeRound) { rounds.Add(1) },
	})
	if err != nil {
		t.Fatal(err)
	}
	return p, rounds
}

// runFailingRouter runs a router with p's RouterPlugin and, after it, a
// plugin that fails (a metrics plugin whose port is in use), and returns the
// router once its Run has returned that error. The router is not closed.
func runFailingRouter(t *testing.T, p *inbox.Purger, closeTimeout time.Duration) *message.Router {
	t.Helper()
	r := pluginRouter(t, closeTimeout, watermill.NopLogger{},
		p.RouterPlugin, func(*message.Router) error { return errors.New("metrics plugin: port in use") })
	if err := r.Run(context.Background()); err == nil {
		t.Fatal("want Run to fail")
	}
	return r
}

// pluginGoroutines counts the goroutines running a router plugin's watcher
// (runWhileRouterRuns) or the Purger it started.
func pluginGoroutines() int {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	var count int
	for _, g := range bytes.Split(buf, []byte("\n\n")) {
		if bytes.Contains(g, []byte("inbox.runWhileRouterRuns")) || bytes.Contains(g, []byte("inbox.(*Purger).Run(")) {
			count++
		}
	}
	return count
}

// pluginRouter returns a router (not running) that logs to logger and
// waits closeTimeout for its handlers at Close, with plugins and one
// consumer handler that does nothing.
func pluginRouter(t *testing.T, closeTimeout time.Duration, logger watermill.LoggerAdapter, plugins ...message.RouterPlugin) *message.Router {
	t.Helper()
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: closeTimeout}, logger)
	if err != nil {
		t.Fatal(err)
	}
	r.AddPlugin(plugins...)
	r.AddConsumerHandler("billing", "orders", newFeed(), func(*message.Message) error { return nil })
	return r
}
