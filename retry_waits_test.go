package inbox_test

import (
	"errors"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/watermill-inbox/inbox"
)

// Inbox.Middlewares' Retry waits InitialInterval, then that times
// Multiplier for each retry after, as its fields say, with and without an
// OnRetryHook. Watermill's Retry takes a value of its backoff for
// ShouldRetry (always set by the inbox) and one for OnRetryHook besides the
// one it waits: 100 ms doubling waited 200 ms, 800 ms and 3.2 s. The
// lower bounds are the waits asked for; the upper ones, half a wait more,
// are far below what skipping a value of the backoff gives (its multiple).
func TestRetryWaitsItsIntervalsBetweenAttempts(t *testing.T) {
	t.Parallel()
	const initial = 300 * time.Millisecond
	for _, hook := range []bool{false, true} {
		t.Run(map[bool]string{false: "without OnRetryHook", true: "with OnRetryHook"}[hook], func(t *testing.T) {
			t.Parallel()
			db := sqliteDB(t)
			f := newFixture(t, db)
			ib := f.newInbox(inbox.Config{})
			retry := middleware.Retry{MaxRetries: 3, InitialInterval: initial, Multiplier: 2, MaxInterval: time.Minute}
			if hook {
				retry.OnRetryHook = func(int, time.Duration) {}
			}
			mws, err := ib.Middlewares(inbox.MiddlewaresConfig{Retry: retry})
			if err != nil {
				t.Fatal(err)
			}
			var mu sync.Mutex
			var calls []time.Time
			in := newFeed()
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(mws...)
				r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
					mu.Lock()
					calls = append(calls, time.Now())
					mu.Unlock()
					return errors.New("the payment service is down")
				})
			})
			if in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
				t.Fatal("acked a message whose handler always fails")
			}
			mu.Lock()
			defer mu.Unlock()
			if len(calls) != 4 {
				t.Fatalf("%d handler calls, want 4 (the first and 3 retries)", len(calls))
			}
			for i, want := range []time.Duration{initial, 2 * initial, 4 * initial} {
				if got := calls[i+1].Sub(calls[i]); got < want || got > want+want/2 {
					t.Errorf("wait before retry %d: %v, want %v", i+1, got.Round(time.Millisecond), want)
				}
			}
		})
	}
}

// A Retry.Multiplier that is negative, NaN, infinite or extreme, and a
// negative interval, are refused: the waits are taken from the multiplier's
// root, and retries ran back to back, logged with a wait of minus 292 years.
func TestRetryMultiplierThatIsNotAPositiveNumberIsRefused(t *testing.T) {
	t.Parallel()
	ib := newFixture(t, sqliteDB(t)).newInbox(inbox.Config{})
	for _, m := range []float64{-2, math.NaN(), math.Inf(1), 1e-300, 1e300} {
		if _, err := ib.Middlewares(inbox.MiddlewaresConfig{Retry: middleware.Retry{Multiplier: m}}); !errors.Is(err, inbox.ErrInvalidConfig) {
			t.Errorf("Retry.Multiplier %v: %v, want ErrInvalidConfig", m, err)
		}
	}
	for _, r := range []middleware.Retry{{InitialInterval: -time.Second}, {MaxInterval: -time.Second}} {
		if _, err := ib.Middlewares(inbox.MiddlewaresConfig{Retry: r}); !errors.Is(err, inbox.ErrInvalidConfig) {
			t.Errorf("Retry %+v: %v, want ErrInvalidConfig", r, err)
		}
	}
}
