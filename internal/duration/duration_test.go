package duration_test

import (
	"math"
	"math/big"
	"testing"
	"time"

	"github.com/watermill-inbox/inbox/internal/duration"
)

// exact returns v clamped to [Min, Max]: what a saturating result must be.
func exact(v *big.Int) time.Duration {
	switch {
	case v.Cmp(big.NewInt(math.MaxInt64)) > 0:
		return duration.Max
	case v.Cmp(big.NewInt(math.MinInt64)) < 0:
		return duration.Min
	}
	return time.Duration(v.Int64())
}

var edges = []int64{0, 1, -1, 2, -2, 1000, -1000, 1_000_000, int64(time.Hour), -int64(time.Hour),
	math.MaxInt32, math.MinInt32, math.MaxInt64 / 2, math.MinInt64 / 2, math.MaxInt64/2 + 1,
	math.MaxInt64 - 1, math.MaxInt64, math.MinInt64 + 1, math.MinInt64}

// Add and Mul are exact while the result fits in a time.Duration and
// saturate at Max or Min beyond it: never a wrapped value.
func TestAddAndMulSaturate(t *testing.T) {
	t.Parallel()
	for _, a := range edges {
		for _, b := range edges {
			sum := new(big.Int).Add(big.NewInt(a), big.NewInt(b))
			if got, want := duration.Add(time.Duration(a), time.Duration(b)), exact(sum); got != want {
				t.Errorf("Add(%d, %d) = %d, want %d", a, b, got, want)
			}
			product := new(big.Int).Mul(big.NewInt(a), big.NewInt(b))
			if got, want := duration.Mul(time.Duration(a), b), exact(product); got != want {
				t.Errorf("Mul(%d, %d) = %d, want %d", a, b, got, want)
			}
		}
	}
}

// Millis converts every millisecond count a time.Duration holds exactly,
// and reports the others (Kafka's Long.MAX_VALUE, 300 years) as not held.
func TestMillis(t *testing.T) {
	t.Parallel()
	year := int64(365*24*time.Hour) / int64(time.Millisecond)
	cases := []struct {
		ms   int64
		want time.Duration
		ok   bool
	}{
		{ms: 604800000, want: 7 * 24 * time.Hour, ok: true},
		{ms: -1, want: -time.Millisecond, ok: true},
		{ms: math.MaxInt64 / 1_000_000, want: time.Duration(math.MaxInt64/1_000_000) * time.Millisecond, ok: true},
		{ms: math.MaxInt64/1_000_000 + 1, want: duration.Max},
		{ms: 300 * year, want: duration.Max},
		{ms: 1000 * year, want: duration.Max},
		{ms: math.MaxInt64, want: duration.Max},
		{ms: math.MinInt64, want: duration.Min},
	}
	for _, c := range cases {
		if got, ok := duration.Millis(c.ms); got != c.want || ok != c.ok {
			t.Errorf("Millis(%d) = %v, %v; want %v, %v", c.ms, got, ok, c.want, c.ok)
		}
	}
}
