package bench

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
)

// BenchmarkMiddlewareAllocs/<db> reports the allocations per message that
// the inbox adds to the same handler (inbox minus baseline), as
// "middleware-allocs/msg": the middleware's own work plus the claim
// statement's trip through database/sql and the driver. dup=0.
func BenchmarkMiddlewareAllocs(b *testing.B) {
	for _, d := range databases() {
		b.Run(d.Name, func(b *testing.B) {
			db := d.Open(b)
			perMessage := func(h message.HandlerFunc) float64 {
				msgs := messages(b.N+1, 0)
				i := 0
				return testing.AllocsPerRun(b.N, func() {
					if _, err := h(msgs[i]); err != nil {
						b.Fatal(err)
					}
					i++
				})
			}
			base := perMessage(baseline(b, db, d.Dialect, businessTable(b, db)))
			withInbox := perMessage(variants[1].build(b, db, d.Dialect, businessTable(b, db)))
			b.ReportMetric(withInbox-base, "middleware-allocs/msg")
			b.ReportMetric(withInbox, "inbox-allocs/msg")
			b.ReportMetric(base, "baseline-allocs/msg")
		})
	}
}
