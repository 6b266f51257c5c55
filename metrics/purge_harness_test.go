package metrics_test

// Window sources for the purge round tests: one whose safe window (or
// error) the test sets between rounds, as a broker's retention changes, and
// one that holds a round under its purge lock until the test lets it go.

import (
	"context"
	"sync"
	"time"
)

// settableWindow is a WindowSource whose answer the test sets.
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

// heldWindow is a WindowSource that, asked for the window (which a round
// does once it holds the purge lock), closes asked and waits for release
// before it answers window.
type heldWindow struct {
	window         time.Duration
	asked, release chan struct{}
}

func newHeldWindow(window time.Duration) *heldWindow {
	return &heldWindow{window: window, asked: make(chan struct{}), release: make(chan struct{})}
}

func (w *heldWindow) SafeWindow(ctx context.Context) (time.Duration, error) {
	close(w.asked)
	select {
	case <-w.release:
		return w.window, nil
	case <-ctx.Done():
		return 0, ctx.Err()
	}
}
