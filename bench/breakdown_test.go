package bench

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
)

// BenchmarkBreakdown/<db>/<variant> splits one message's time (conc=1,
// dup=0) into before-us (BEGIN, plus the claim for the inbox), handler-us
// (the business insert) and after-us (COMMIT), as means in microseconds:
// before(inbox) - before(baseline) is what the claim costs.
func BenchmarkBreakdown(b *testing.B) {
	for _, d := range databases() {
		b.Run(d.Name, func(b *testing.B) {
			db := d.Open(b)
			for _, v := range []string{"baseline", "inbox"} {
				b.Run(v, func(b *testing.B) {
					query := insertSQL(db, businessTable(b, db))
					var before, during, after time.Duration
					var t0, t1, t2 time.Time
					handler := func(msg *message.Message) error {
						t1 = time.Now()
						var err error
						if tx, ok := inbox.TxFromContext(msg.Context()); ok {
							_, err = tx.ExecContext(msg.Context(), query, msg.UUID, 100)
						}
						t2 = time.Now()
						return err
					}
					var run func(msg *message.Message) error
					if v == "baseline" {
						run = func(msg *message.Message) error {
							ctx := msg.Context()
							tx, err := db.BeginTxx(ctx, nil)
							if err != nil {
								return err
							}
							t1 = time.Now()
							if _, err := tx.ExecContext(ctx, query, msg.UUID, 100); err != nil {
								tx.Rollback()
								return err
							}
							t2 = time.Now()
							return tx.Commit()
						}
					} else {
						ib, _ := newInbox(b, db, d.Dialect, "bench")
						h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) { return nil, handler(msg) })
						run = func(msg *message.Message) error { _, err := h(msg); return err }
					}
					msgs := messages(b.N, 0)
					b.ResetTimer()
					for _, msg := range msgs {
						t0 = time.Now()
						if err := run(msg); err != nil {
							b.Fatal(err)
						}
						end := time.Now()
						before += t1.Sub(t0)
						during += t2.Sub(t1)
						after += end.Sub(t2)
					}
					n := float64(b.N)
					b.ReportMetric(float64(before.Microseconds())/n, "before-us")
					b.ReportMetric(float64(during.Microseconds())/n, "handler-us")
					b.ReportMetric(float64(after.Microseconds())/n, "after-us")
				})
			}
		})
	}
}
