package metrics

import (
	"context"
	"sync"
	"sync/atomic"
	"time"
)

// scrapeRead is a read of the database made at scrape time (WatchOutbox,
// WatchTable), bounded by timeout: the query runs on a goroutine of its own
// under that timeout, so that a driver that does not honour its context
// still cannot hold the scrape, and a scrape that arrives while a read is in
// flight waits for that one instead of starting another. It counts the
// reads that failed or did not answer in time.
type scrapeRead[T any] struct {
	read     func(context.Context) (T, error)
	timeout  time.Duration
	failures atomic.Uint64

	mu   sync.Mutex
	call *readCall[T] // the read in flight, shared by the scrapes meanwhile; nil when none
}

// readCall is one read; done closes when it ends.
type readCall[T any] struct {
	done chan struct{}
	v    T
	err  error
}

// get returns the read's value, or false (and counts a failure) when the
// read failed or did not answer within the timeout.
func (r *scrapeRead[T]) get() (T, bool) {
	r.mu.Lock()
	call := r.call
	if call == nil {
		call = &readCall[T]{done: make(chan struct{})}
		r.call = call
		go r.run(call)
	}
	r.mu.Unlock()
	timer := time.NewTimer(r.timeout)
	defer timer.Stop()
	select {
	case <-call.done:
		if call.err == nil {
			return call.v, true
		}
	case <-timer.C:
	}
	r.failures.Add(1)
	var zero T
	return zero, false
}

func (r *scrapeRead[T]) run(call *readCall[T]) {
	ctx, cancel := context.WithTimeout(context.Background(), r.timeout)
	defer cancel()
	call.v, call.err = r.read(ctx)
	r.mu.Lock()
	r.call = nil
	r.mu.Unlock()
	close(call.done)
}
