package inbox_test

// Routers and what the tests read from them: a feed that delivers exactly
// the messages a test hands it, middlewares that record the outcome of each
// delivery, hook counters, a barrier and a log capture.

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testrouter"
)

// caseTimeout bounds every wait of a case: a hang fails the test instead of
// stalling the suite. It is a bound, never a measurement.
const caseTimeout = 60 * time.Second

// feed is internal/testrouter's Feed, a message.Subscriber for one handler
// that delivers exactly the messages a test hands it and reports whether
// the router acked or nacked each one. Unlike a broker it never redelivers
// by itself: a redelivery is a test calling deliver again with the same
// message.
type feed struct{ *testrouter.Feed }

func newFeed() *feed { return &feed{testrouter.NewFeed()} }

// deliver is Feed.Deliver: a fresh copy of msg, and whether it was acked.
func (f *feed) deliver(t testing.TB, msg *message.Message) bool {
	t.Helper()
	return f.Deliver(t, msg)
}

// send is Feed.Send: msg itself, and whether it was acked before ctx ended.
func (f *feed) send(ctx context.Context, msg *message.Message) (bool, error) { return f.Send(ctx, msg) }

// delivery returns a redelivery of msg (a copy, as a broker makes) labelled
// in its metadata, so that outcomes and handlers can tell deliveries apart.
func delivery(msg *message.Message, label string) *message.Message {
	m := msg.Copy()
	m.Metadata.Set("delivery", label)
	return m
}

// sendToEach sends, at once, to each worker the delivery of msg(label)
// labelled with the worker's label, and returns by label whether it was
// acked. A delivery that does not complete fails the test (t.Error).
func sendToEach(ctx context.Context, t *testing.T, workers map[string]*feed, msg func(label string) *message.Message) map[string]bool {
	t.Helper()
	var mu sync.Mutex
	acked := map[string]bool{}
	var wg sync.WaitGroup
	for label, in := range workers {
		wg.Go(func() {
			a, err := in.send(ctx, delivery(msg(label), label))
			if err != nil {
				t.Error(err)
			}
			mu.Lock()
			acked[label] = a
			mu.Unlock()
		})
	}
	wg.Wait()
	return acked
}

// runRouter is testrouter.Start: a router configured by setup, running,
// closed when the test ends.
func runRouter(t testing.TB, setup func(r *message.Router)) *message.Router {
	t.Helper()
	return testrouter.Start(t, setup)
}

// recorder is internal/testrouter's Outcomes, a middleware placed outside
// the inbox that records what the router receives from it for each
// delivery, with this package's method names.
type recorder struct{ testrouter.Outcomes }

// last returns the error of the last delivery; nil when there was none.
func (r *recorder) last() error { return r.LastOr(nil) }

// outcomes is a recorder read by delivery label.
type outcomes struct{ testrouter.Outcomes }

// last returns the error of the last delivery labelled label.
func (o *outcomes) last(label string) error { return o.LastOf(label) }

// failures returns every non-nil error recorded.
func (o *outcomes) failures() []error { return o.Failures() }

// hookCounts counts the inbox's outcome hooks.
type hookCounts struct{ processed, duplicates, failed, reused atomic.Int32 }

func (c *hookCounts) config(cfg inbox.Config) inbox.Config {
	cfg.OnProcessed = func(inbox.Event) { c.processed.Add(1) }
	cfg.OnDuplicate = func(inbox.Event) { c.duplicates.Add(1) }
	cfg.OnFailed = func(inbox.Event) { c.failed.Add(1) }
	cfg.OnReusedID = func(inbox.Event) { c.reused.Add(1) }
	return cfg
}

// expect fails the test unless the hooks were called so many times.
func (c *hookCounts) expect(t *testing.T, processed, duplicates, failed, reused int32) {
	t.Helper()
	if c.processed.Load() != processed || c.duplicates.Load() != duplicates || c.failed.Load() != failed || c.reused.Load() != reused {
		t.Errorf("hooks: processed=%d duplicate=%d failed=%d reused=%d, want %d, %d, %d and %d",
			c.processed.Load(), c.duplicates.Load(), c.failed.Load(), c.reused.Load(), processed, duplicates, failed, reused)
	}
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

// barrier lets n parties through once all n arrived (or ctx ended); later
// arrivals pass at once.
type barrier struct {
	ctx     context.Context
	n       int32
	arrived atomic.Int32
	all     chan struct{}
}

func newBarrier(ctx context.Context, n int32) *barrier {
	return &barrier{ctx: ctx, n: n, all: make(chan struct{})}
}

func (b *barrier) arrive() {
	switch k := b.arrived.Add(1); {
	case k == b.n:
		close(b.all)
	case k > b.n:
		return
	}
	select {
	case <-b.all:
	case <-b.ctx.Done():
	}
}

func waitFor(t testing.TB, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met within 30s")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// logLine is one captured log call.
type logLine struct {
	level  string
	msg    string
	fields watermill.LogFields
}

// captureLogger is a watermill.LoggerAdapter that records what it is given.
type captureLogger struct {
	mu     *sync.Mutex
	lines  *[]logLine
	fields watermill.LogFields
}

func newCaptureLogger() captureLogger {
	return captureLogger{mu: &sync.Mutex{}, lines: &[]logLine{}}
}

func (l captureLogger) log(level, msg string, f watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	*l.lines = append(*l.lines, logLine{level, msg, l.fields.Add(f)})
}

// has reports whether a message containing text was logged.
func (l captureLogger) has(text string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, line := range *l.lines {
		if strings.Contains(line.msg, text) {
			return true
		}
	}
	return false
}

func (l captureLogger) Error(msg string, err error, f watermill.LogFields) { l.log("error", msg, f) }

func (l captureLogger) Info(msg string, f watermill.LogFields) { l.log("info", msg, f) }

func (l captureLogger) Debug(msg string, f watermill.LogFields) { l.log("debug", msg, f) }

func (l captureLogger) Trace(msg string, f watermill.LogFields) { l.log("trace", msg, f) }

func (l captureLogger) With(f watermill.LogFields) watermill.LoggerAdapter {
	return captureLogger{mu: l.mu, lines: l.lines, fields: l.fields.Add(f)}
}
