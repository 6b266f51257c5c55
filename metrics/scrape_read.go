package metrics

import (
	"context"
	"errors"
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

// errScrapeReadLate is get's error for a read that has not answered in time.
var errScrapeReadLate = errors.New("metrics: the read did not answer within its timeout")

// scrapeReadGrace is how much longer than the read's own timeout get waits
// for it: a read that ends at its deadline with a partial value (an
// OutboxStats whose count ran out of time) is still seen.
const scrapeReadGrace = 200 * time.Millisecond

// get returns the read's value and its error, or errScrapeReadLate when the
// read has not answered within the timeout (and the grace), and counts a
// failure whenever the error is not nil. The value may be partial when the
// error is not nil: what the read returned with its error.
func (r *scrapeRead[T]) get() (T, error) {
	r.mu.Lock()
	call := r.call
	if call == nil {
		call = &readCall[T]{done: make(chan struct{})}
		r.call = call
		go r.run(call)
	}
	r.mu.Unlock()
	timer := time.NewTimer(r.timeout + scrapeReadGrace)
	defer timer.Stop()
	select {
	case <-call.done:
		if call.err == nil {
			return call.v, nil
		}
		r.failures.Add(1)
		return call.v, call.err
	case <-timer.C:
	}
	r.failures.Add(1)
	var zero T
	return zero, errScrapeReadLate
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
