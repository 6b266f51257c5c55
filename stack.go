package inbox

import (
	"context"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
)

// MiddlewaresConfig configures Inbox.Middlewares: which of Watermill's
// middlewares go around the inbox, and their settings. The zero value is a
// complete configuration: Retry, a Timeout per attempt and Recoverer, and no
// poison queue.
type MiddlewaresConfig struct {
	// PoisonQueue, when set, receives the messages that failed for good
	// (after Retry) and ShouldPoison accepts, through Watermill's
	// middleware.PoisonQueueWithFilter, on PoisonTopic; such a message is
	// then acked. Its inbox transaction was rolled back, so replaying it
	// from the poison topic processes it.
	// Default: nil, no poison queue: every failure is nacked.
	PoisonQueue message.Publisher

	// PoisonTopic is the topic PoisonQueue publishes to. It must exist on
	// a broker that does not create topics on first use (Kafka with
	// auto.create.topics.enable=false, kfake, a JetStream subject without a
	// stream): a publish there fails, the message is nacked, and it waits
	// at the head of its partition until the topic exists. Setting it
	// without PoisonQueue is an error (ErrInvalidConfig).
	// Default: "poison" when PoisonQueue is set.
	PoisonTopic string

	// ShouldPoison decides which failures go to the poison queue. It sees
	// the error as the router would (the handler's, the inbox's, or
	// middleware.RecoveredPanicError for a panic).
	// Default: !IsTransient(err): the handler's own errors, panics and
	// invalid message ids are poisoned; deadlocks, timeouts, lost
	// connections and a missing or incompatible table at message time are
	// only nacked, so that a misconfiguration does not drain the topic.
	ShouldPoison func(err error) bool

	// Retry retries a failed attempt in place, each attempt in a new
	// inbox transaction. Its zero fields take these defaults: MaxRetries 3
	// (negative: no Retry at all), InitialInterval 100 ms, MaxInterval 10 s,
	// Multiplier 2, and ShouldRetry retries every error except those a
	// retry in place cannot fix: ErrInvalidMessageID, ErrInvalidConsumer,
	// ErrMessageIDReused, ErrNestedInbox, ErrNoTx, and a missing or incompatible
	// table (the inbox has
	// already waited before returning it; the broker redelivers).
	// MaxElapsedTime, RandomizationFactor, OnRetryHook and Logger are used
	// as they are. The waits are InitialInterval, then that times
	// Multiplier for each retry after, up to MaxInterval, as the fields
	// say (to within nanoseconds): Watermill's Retry (v1.5.1) also
	// advances its backoff for ShouldRetry and OnRetryHook, which the inbox
	// makes up for (the delays a ShouldRetry's RetryParams and OnRetryHook
	// are given are not the next wait). A Multiplier outside 0.001 to
	// 1000, or a negative interval, is refused (ErrInvalidConfig). The
	// message's context is restored after each attempt, so
	// ResetContextOnRetry is not needed.
	// Default: the values above.
	Retry middleware.Retry

	// Timeout is the deadline of each attempt (middleware.Timeout): it ends
	// a handler stuck on the database, a pool write among them, with
	// context.DeadlineExceeded. Negative: no Timeout.
	// Default: 30 s.
	Timeout time.Duration
}

// Default settings of MiddlewaresConfig.
const (
	DefaultPoisonTopic  = "poison"
	DefaultRetries      = 3
	DefaultRetryInitial = 100 * time.Millisecond
	DefaultRetryMax     = 10 * time.Second
	DefaultTimeout      = 30 * time.Second
)

// Middlewares returns the router middlewares of a consumer in the order they
// must run, the inbox last: add them with router.AddMiddleware(mws...), or
// to one handler with handler.AddMiddleware(mws...). From the outside in:
//
//  1. the poison queue (with cfg.PoisonQueue): a message that failed for
//     good goes to the poison topic after its transaction rolled back, so
//     it is not marked processed;
//  2. Retry: each attempt gets a fresh transaction, so a failed attempt's
//     writes never commit with a later one's;
//  3. Timeout: a deadline per attempt;
//  4. Recoverer: a panic, after the inbox rolled back, becomes an error
//     that Retry retries and the poison queue can take;
//  5. ib.Middleware: the transaction wraps only the handler.
//
// Two more of the library's own sit among them, so the slice holds two
// middlewares more than the list above: between Retry and Timeout, one
// that gives each attempt back the message context Timeout replaced; and
// between the poison queue and Retry, one that keeps the end of the message
// context in the error when the error is that end's cause alone (Retry
// returns it so once the context has ended: see keepContextEnd).
//
// Middlewares of your own that must see every attempt go before these;
// ones that must run inside the transaction, after them. It returns an
// error wrapping ErrInvalidConfig for an invalid cfg. It is safe for
// concurrent use, and so are the middlewares it returns.
func (ib *Inbox) Middlewares(cfg MiddlewaresConfig) ([]message.HandlerMiddleware, error) {
	var mws []message.HandlerMiddleware
	switch {
	case cfg.PoisonQueue != nil:
		topic, filter := cfg.PoisonTopic, cfg.ShouldPoison
		if topic == "" {
			topic = DefaultPoisonTopic
		}
		if filter == nil {
			filter = func(err error) bool { return !IsTransient(err) }
		}
		poison, err := middleware.PoisonQueueWithFilter(cfg.PoisonQueue, topic, filter)
		if err != nil {
			return nil, fmt.Errorf("%w: MiddlewaresConfig: %w", ErrInvalidConfig, err)
		}
		mws = append(mws, poison)
	case cfg.PoisonTopic != "" || cfg.ShouldPoison != nil:
		return nil, fmt.Errorf("%w: MiddlewaresConfig.PoisonTopic and ShouldPoison need a PoisonQueue publisher", ErrInvalidConfig)
	}
	mws = append(mws, keepContextEnd) // inside the poison queue, whose filter must see the end
	if r := cfg.Retry; r.MaxRetries >= 0 {
		if r.MaxRetries == 0 {
			r.MaxRetries = DefaultRetries
		}
		if r.InitialInterval == 0 {
			r.InitialInterval = DefaultRetryInitial
		}
		if r.MaxInterval == 0 {
			r.MaxInterval = DefaultRetryMax
		}
		if r.Multiplier == 0 {
			r.Multiplier = 2
		}
		if !(r.Multiplier >= minRetryMultiplier && r.Multiplier <= maxRetryMultiplier) {
			// retryBackOffSteps takes its root: NaN for a negative one,
			// and back-to-back retries logged with a wait of minus 292
			// years; an extreme one took the interval out of range.
			return nil, fmt.Errorf("%w: MiddlewaresConfig.Retry.Multiplier must be between %v and %v, got %v",
				ErrInvalidConfig, minRetryMultiplier, maxRetryMultiplier, r.Multiplier)
		}
		if r.InitialInterval < 0 || r.MaxInterval < 0 {
			return nil, fmt.Errorf("%w: MiddlewaresConfig.Retry: InitialInterval and MaxInterval must not be negative, got %v and %v",
				ErrInvalidConfig, r.InitialInterval, r.MaxInterval)
		}
		if r.ShouldRetry == nil {
			r.ShouldRetry = func(p middleware.RetryParams) bool { return retryableInPlace(p.Err) }
		}
		r.InitialInterval, r.Multiplier = retryBackOffSteps(r.InitialInterval, r.Multiplier, r.OnRetryHook != nil)
		mws = append(mws, r.Middleware)
	}
	mws = append(mws, restoreContext)
	if t := cfg.Timeout; t >= 0 {
		if t == 0 {
			t = DefaultTimeout
		}
		mws = append(mws, middleware.Timeout(t))
	}
	return append(mws, middleware.Recoverer, ib.Middleware), nil
}

// retryBackOffSteps returns the InitialInterval and Multiplier to give
// Watermill's Retry so that it waits initial, initial×multiplier,
// initial×multiplier², … (at most MaxInterval) between attempts, as its
// fields say. Watermill v1.5.1's Retry takes a value of its exponential
// backoff, besides the one it waits, for ShouldRetry's RetryParams.Delay on
// every failed attempt (ShouldRetry is always set here) and, from the
// second retry, another for OnRetryHook's: the documented 100, 200, 400 ms
// were 200 ms, 800 ms and 3.2 s (4.2 s for three retries, not 0.7 s). With
// every wait the step-th value of the backoff after the first, a
// multiplier of multiplier^(1/step) and an interval of initial divided by
// it give the waits asked for.
func retryBackOffSteps(initial time.Duration, multiplier float64, hook bool) (time.Duration, float64) {
	step := 2.0 // ShouldRetry's value, then the wait
	if hook {
		step = 3 // and OnRetryHook's
	}
	m := math.Pow(multiplier, 1/step)
	// Within range for a multiplier the caller accepts; at least 1 ns.
	return time.Duration(max(float64(initial)/m, 1)), m
}

// The Retry.Multiplier range Middlewares accepts: a root of it divides
// InitialInterval (retryBackOffSteps), which must stay a duration.
const (
	minRetryMultiplier = 0.001
	maxRetryMultiplier = 1000.0
)

// retryableInPlace reports whether Retry should run a failed attempt again
// at once: not for a message the inbox refuses (its id or consumer, an id
// reused for other content), a nested inbox, or a table error (see
// MiddlewaresConfig.Retry).
func retryableInPlace(err error) bool {
	var mcErr *misconfiguredError
	return !errors.Is(err, ErrInvalidMessageID) && !errors.Is(err, ErrInvalidConsumer) && !errors.Is(err, ErrMessageIDReused) &&
		!errors.Is(err, ErrNestedInbox) && !errors.Is(err, ErrNoTx) && !errors.As(err, &mcErr)
}

// restoreContext gives the message the context it came in with once the
// middlewares inside have returned: middleware.Timeout leaves its ended
// context on the message, and without this a retried attempt, or the
// poison queue's publish, would start with a context already done. It also
// records each attempt's error for keepContextEnd.
func restoreContext(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		defer msg.SetContext(ctx)
		out, err := h(msg)
		if attempt, ok := ctx.Value(lastAttemptKey{}).(*lastAttempt); ok && err != nil && ctx.Err() == nil {
			attempt.beforeEnd = err // Retry runs its attempts one after the other
		}
		return out, err
	}
}

// keepContextEnd gives the poison queue the error that says what became of
// the message, when Retry (cenkalti/backoff) returned the message context's
// cause or error because the context ended (a shutdown, a deadline) rather
// than an attempt's error: after a deadline, the error of the last attempt
// that failed before it (restoreContext records it), so that a message
// its handler refused for good is still
// poisoned (Retry dropped that refusal once a deadline passed during its
// backoff, and the message looped for ever); after a shutdown (the context
// cancelled) the context's end, which the next instance's attempts follow;
// and, when no attempt had failed, the
// cause with the context's end added (context.Canceled or
// DeadlineExceeded), so that IsTransient, and the poison queue's default
// filter with it, sees the end: a cause of its own (errgroup.WithContext
// cancels the router's context with the error of the service that failed
// first; context.WithTimeoutCause) is no transient error, and every message
// in flight at such a shutdown was poisoned.
func keepContextEnd(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		attempt := &lastAttempt{}
		msg.SetContext(context.WithValue(ctx, lastAttemptKey{}, attempt))
		defer msg.SetContext(ctx)
		out, err := h(msg)
		if err != nil && ctx.Err() != nil && attempt.beforeEnd != nil && !errors.Is(attempt.beforeEnd, err) &&
			(errors.Is(err, context.Cause(ctx)) || errors.Is(err, ctx.Err())) {
			switch {
			case errors.Is(ctx.Err(), context.DeadlineExceeded):
				// Retry gave up on the message's deadline, not on an
				// attempt: the last attempt that failed before it says
				// what became of the message, which the same deadline
				// would cut again on every redelivery. (One the
				// deadline cut short says nothing of it: a handler's
				// own "request cancelled" poisoned a message.)
				err = fmt.Errorf("%w (then the message context ended: %v)", attempt.beforeEnd, err)
			default:
				// A shutdown during Retry's wait: the next instance
				// makes the attempts Retry did not. Transient, with the
				// failed attempt named (the last attempt's error in its
				// place poisoned every message waiting at a deploy).
				err = fmt.Errorf("%w (the message context ended while Retry waited, after an attempt failed with: %v)", err, attempt.beforeEnd)
			}
		}
		return out, withContextEnd(ctx, err)
	}
}

// lastAttempt holds the error of the last attempt Retry ran that failed
// while the message context had not ended (restoreContext records it), for
// keepContextEnd.
type lastAttempt struct{ beforeEnd error }

// lastAttemptKey is the message context key of keepContextEnd's
// lastAttempt.
type lastAttemptKey struct{}

// withContextEnd returns err with ctx's error added when ctx has ended and
// err wraps its cause but not its error (see keepContextEnd).
func withContextEnd(ctx context.Context, err error) error {
	ended := ctx.Err()
	if err == nil || ended == nil || errors.Is(err, ended) || !errors.Is(err, context.Cause(ctx)) {
		return err
	}
	return fmt.Errorf("%w (the message context ended: %w)", err, ended)
}
