package inbox

import (
	"context"
	"sync"
	"sync/atomic"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// componentLogger is the logger of a component that runs as a router
// plugin (the Purger, the Outbox's relay): the one its configuration gave,
// or, when it gave none, watermill.NopLogger until its RouterPlugin adopts
// the router's logger, so that a plugin whose rounds fail does not fail in
// silence (a purge of a misnamed table failed every round and logged
// nothing). Safe for concurrent use.
type componentLogger struct {
	current atomic.Pointer[loggerRef]
	given   bool
	fields  watermill.LogFields
}

type loggerRef struct{ watermill.LoggerAdapter }

// newComponentLogger returns the logger given (nil: none), with fields.
func newComponentLogger(given watermill.LoggerAdapter, fields watermill.LogFields) *componentLogger {
	l := &componentLogger{given: given != nil, fields: fields}
	if given == nil {
		given = watermill.NopLogger{}
	}
	l.current.Store(&loggerRef{given.With(fields)})
	return l
}

// nop reports whether the logger in use is watermill.NopLogger, so that a
// caller can skip building fields nothing reads.
func (l *componentLogger) nop() bool {
	_, ok := l.get().(watermill.NopLogger)
	return ok
}

// get returns the logger in use.
func (l *componentLogger) get() watermill.LoggerAdapter { return l.current.Load().LoggerAdapter }

// adoptRouters makes r's logger the one in use, unless one was given.
func (l *componentLogger) adoptRouters(r *message.Router) {
	if l.given || r == nil {
		return
	}
	if rl := r.Logger(); rl != nil {
		l.current.Store(&loggerRef{rl.With(l.fields)})
	}
}

// runs counts a component's running loops (its RouterPlugin's goroutine,
// Run calls), so that WaitStopped can tell when none runs. Safe for
// concurrent use; the zero value counts none.
type runs struct {
	mu   sync.Mutex
	n    int
	none chan struct{} // closed when n drops to 0; nil while n is 0
}

// begin counts one more loop.
func (r *runs) begin() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.n == 0 {
		r.none = make(chan struct{})
	}
	r.n++
}

// end counts one loop less.
func (r *runs) end() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.n--
	if r.n == 0 {
		close(r.none)
		r.none = nil
	}
}

// wait returns nil once no loop runs, or ctx's error if it ends first.
func (r *runs) wait(ctx context.Context) error {
	r.mu.Lock()
	none := r.none
	r.mu.Unlock()
	if none == nil {
		return nil
	}
	select {
	case <-none:
		return nil
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}
