package inbox

import (
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
