package inbox_test

import (
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// On MySQL/MariaDB with the DSN parameters users set (interpolateParams,
// clientFoundRows, multiStatements, a non-UTF-8 connection charset), the
// messages a handler returns and those it publishes leave with their exact
// bytes and in order: published first, then returned; one alone, several in
// one statement, and more than one INSERT's chunk.
func TestOutboxReturnedMessagesKeepTheirBytesWithEveryMySQLDSNParam(t *testing.T) {
	for _, param := range []string{"interpolateParams=true", "interpolateParams=true&clientFoundRows=true",
		"multiStatements=true", "interpolateParams=true&charset=latin1", "charset=latin1"} {
		t.Run(param, func(t *testing.T) {
			t.Parallel()
			db := testdb.OpenMySQL(t, param)
			broker := newBrokerStub()
			ob := newTestOutbox(t, db, inbox.MySQL, inbox.OutboxConfig{Publisher: broker, PollInterval: time.Hour})
			f := newFixture(t, db)
			ib := f.newInbox(inbox.Config{Outbox: ob.Publisher, Dialect: inbox.MySQL})
			every, big := binaryPayload(256), binaryPayload(200<<10)
			payloads := [][]byte{{}, every, big, []byte("\\'\"\x00\x1a"), every[:1], nil}
			var want []*message.Message
			in := newFeed()
			out := &outcomes{}
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(out.Middleware, ib.Middleware)
				r.AddHandler("billing", "orders", in, "invoices", &recordingPublisher{fail: true}, func(msg *message.Message) ([]*message.Message, error) {
					mk := func(i int, tag string) *message.Message {
						payload := every // a 1001 messages' statement stays under max_allowed_packet
						if i < len(payloads) {
							payload = payloads[i]
						}
						m := message.NewMessage(fmt.Sprintf("%s-%s-%d", msg.UUID, tag, i), payload)
						m.Metadata.Set("index", fmt.Sprint(i))
						m.Metadata.Set("quote\"and\\slash'", "ü\x00\u2028é")
						return m
					}
					n, _ := strconv.Atoi(msg.Metadata.Get("n"))
					pub, _ := inbox.OutboxFromContext(msg.Context())
					p := mk(0, "published")
					if err := pub.Publish("invoices", p); err != nil {
						return nil, err
					}
					want = append(want, p)
					var out []*message.Message
					for i := range n {
						out = append(out, mk(i, "returned"))
					}
					want = append(want, out...)
					return out, nil
				})
			})
			for _, n := range []int{1, 2, len(payloads), 1001} {
				m := message.NewMessage(watermill.NewUUID(), nil)
				m.Metadata.Set("n", strconv.Itoa(n))
				m.Metadata.Set("delivery", "n")
				if !in.deliver(t, m) {
					t.Fatalf("message of %d outputs nacked: %v", n, out.last("n"))
				}
			}
			relayUntilEmpty(t, ob)
			got := broker.messages("invoices")
			if len(got) != len(want) {
				t.Fatalf("sent %d messages, want %d", len(got), len(want))
			}
			bad := 0
			for i, w := range want {
				if !got[i].Equals(w) && bad < 5 {
					bad++
					t.Errorf("message %d: sent %s (%d bytes, %v), want %s (%d bytes, %v)",
						i, got[i].UUID, len(got[i].Payload), got[i].Metadata, w.UUID, len(w.Payload), w.Metadata)
				}
			}
		})
	}
}
