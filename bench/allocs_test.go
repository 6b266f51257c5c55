package bench

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
)

// BenchmarkMiddlewareAllocs/<db> reports the allocations per message that
// the inbox adds to the same handler (inbox minus baseline), as
// "middleware-allocs/msg": the middleware's own work plus the claim
// statement's trip through database/sql and the driver. dup=0.
//
// The messages carry context.Background(), whose Done channel is nil, as
// in the numbers measured before the inbox had a context of its own;
// "router-ctx-middleware-allocs/msg" is the same with a cancellable context
// per message, as GoChannel and watermill-kafka's subscriber give. The
// difference matters because drivers watch a cancellable context on every
// statement (modernc.org/sqlite starts a goroutine each time), and the
// inbox runs the transaction under a cancellable context of its own either
// way: with Background messages that cost shows as the middleware's.
//
// postgres-pgx is package pgxinbox against a bare pgx transaction
// (pgx_test.go).
func BenchmarkMiddlewareAllocs(b *testing.B) {
	b.Run("postgres-pgx", benchmarkMiddlewareAllocsPgx)
	for _, d := range databases() {
		b.Run(d.Name, func(b *testing.B) {
			db := d.Open(b)
			perMessage := func(h message.HandlerFunc, cancellable bool) float64 {
				msgs := messages(b.N+1, 0)
				if cancellable {
					for _, msg := range msgs {
						ctx, cancel := context.WithCancel(context.Background())
						defer cancel()
						msg.SetContext(ctx)
					}
				}
				i := 0
				return testing.AllocsPerRun(b.N, func() {
					if _, err := h(msgs[i]); err != nil {
						b.Fatal(err)
					}
					i++
				})
			}
			base := perMessage(baseline(b, db, d.Dialect, businessTable(b, db)), false)
			withInbox := perMessage(variants[1].build(b, db, d.Dialect, businessTable(b, db)), false)
			b.ReportMetric(withInbox-base, "middleware-allocs/msg")
			b.ReportMetric(withInbox, "inbox-allocs/msg")
			b.ReportMetric(base, "baseline-allocs/msg")
			base = perMessage(baseline(b, db, d.Dialect, businessTable(b, db)), true)
			withInbox = perMessage(variants[1].build(b, db, d.Dialect, businessTable(b, db)), true)
			b.ReportMetric(withInbox-base, "router-ctx-middleware-allocs/msg")
		})
	}
}
