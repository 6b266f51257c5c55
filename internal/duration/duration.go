// Package duration does the time.Duration arithmetic of the purge windows
// without wrapping: a sum or product that a time.Duration cannot hold
// saturates at Max (or Min) instead of wrapping around to a short or
// negative window. A window that wraps is the worst failure a purge can
// have: a retention of centuries turns into days, and the purge deletes the
// inbox rows of messages the broker still holds.
package duration

import (
	"math"
	"time"
)

// Max and Min are the longest and the most negative time.Duration: where
// Add and Mul saturate. Max is about 292 years.
const (
	Max = time.Duration(math.MaxInt64)
	Min = time.Duration(math.MinInt64)
)

// Add returns a + b, or Max (Min) when the sum is above Max (below Min).
func Add(a, b time.Duration) time.Duration {
	s := a + b
	switch {
	case a > 0 && b > 0 && s < 0:
		return Max
	case a < 0 && b < 0 && s >= 0:
		return Min
	}
	return s
}

// Mul returns d × n, or Max (Min) when the product is above Max (below Min).
func Mul(d time.Duration, n int64) time.Duration {
	if d == 0 || n == 0 {
		return 0
	}
	p := d * time.Duration(n)
	// Division undoes an exact product; MinInt64 × -1 is the one wrap that
	// division cannot see (MinInt64 / -1 wraps back to MinInt64).
	if p/time.Duration(n) != d || (n == -1 && d == Min) {
		if (d < 0) != (n < 0) {
			return Min
		}
		return Max
	}
	return p
}

// Millis returns ms milliseconds as a duration; ok is false when a
// time.Duration cannot hold it (beyond about ±292 years), and d is then Max
// or Min.
func Millis(ms int64) (d time.Duration, ok bool) {
	d = Mul(time.Millisecond, ms)
	return d, ms >= int64(Min/time.Millisecond) && ms <= int64(Max/time.Millisecond)
}
