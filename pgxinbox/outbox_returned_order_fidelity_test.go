package pgxinbox_test

import (
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// In every query mode, a handler that publishes through OutboxFromContext
// and returns 1, 3 or 1,001 messages (more than one INSERT's chunk) has its
// outputs relayed published first, then returned, in order, with their
// exact payloads and metadata.
func TestOutbox_PublishedThenReturnedKeepOrderAndBytesInEveryMode(t *testing.T) {
	for _, mode := range allModes {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			pool := openPool(t, "", "pgx_outbox_order_"+testdb.RandomSuffix(), func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = mode })
			var want []*message.Message
			every := make([]byte, 256)
			for i := range every {
				every[i] = byte(i)
			}
			mk := func(uuid string, i int) *message.Message {
				m := message.NewMessage(uuid, append([]byte{byte(i)}, every...))
				m.Metadata.Set("q'uote\"\\", "ü\x00$1 '; commit; --")
				return m
			}
			f := newReturnedFixtureWith(t, pool, pgxinbox.Config{}, func(f *returnedFixture, msg *message.Message) ([]*message.Message, error) {
				if err := f.writeEffect(msg); err != nil {
					return nil, err
				}
				pub, _ := inbox.OutboxFromContext(msg.Context())
				p := mk(msg.UUID+"-published", 0)
				if err := pub.Publish("invoices", p); err != nil {
					return nil, err
				}
				want = append(want, p)
				var n int
				fmt.Sscan(msg.Metadata.Get("n"), &n)
				var out []*message.Message
				for i := range n {
					out = append(out, mk(fmt.Sprintf("%s-%04d", msg.UUID, i), i))
				}
				want = append(want, out...)
				return out, nil
			})
			for _, n := range []int{1, 3, 1001} {
				m := message.NewMessage(watermill.NewUUID(), nil)
				m.Metadata.Set("n", fmt.Sprint(n))
				if !f.in.deliver(t, m) {
					t.Fatalf("%d outputs: nacked: %v", n, f.rec.last())
				}
			}
			f.relayed(t)
			got := f.broker.sent()
			if len(got) != len(want) {
				t.Fatalf("relayed %d, want %d", len(got), len(want))
			}
			bad := 0
			for i := range want {
				if !got[i].Equals(want[i]) && bad < 5 {
					bad++
					t.Errorf("output %d: got %s %v, want %s %v", i, got[i].UUID, got[i].Metadata, want[i].UUID, want[i].Metadata)
				}
			}
			expectNoConnHeld(t, pool)
		})
	}
}
