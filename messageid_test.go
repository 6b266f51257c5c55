package inbox_test

import (
	"errors"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
)

// A message from a producer that is not Watermill carries no UUID but an id
// in a header: MessageIDFromMetadata deduplicates on it, and a message
// without it is refused (ErrInvalidMessageID and ErrEmptyMessageID, the keys
// named) without calling the handler or writing anything.
func TestMessageIDFromMetadata_DeduplicatesOnTheHeader(t *testing.T) {
	for _, tc := range []struct {
		name   string
		config func(keys ...string) func(*message.Message) (string, error)
		// uuidFallback: a message with a UUID and no header is processed
		// under its UUID.
		uuidFallback bool
	}{
		{"MessageIDFromMetadata", inbox.MessageIDFromMetadata, false},
		{"MessageIDFromMetadataOrUUID", inbox.MessageIDFromMetadataOrUUID, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, openSQLite(t, filepath.Join(t.TempDir(), "ids.db")))
			ib := f.newInbox(inbox.Config{MessageID: tc.config(inbox.NATSMsgIDHeader, "event-id")})
			var c calls
			rec := &recorder{}
			in := newFeed()
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(rec.Middleware, ib.Middleware)
				r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
					id := msg.Metadata.Get(inbox.NATSMsgIDHeader) + msg.Metadata.Get("event-id")
					if id == "" {
						id = msg.UUID
					}
					c.inc(id)
					return nil
				})
			})

			foreign := message.NewMessage("", nil) // no Watermill UUID
			foreign.Metadata.Set("event-id", "order-42")
			for range 2 {
				if !in.deliver(t, foreign) {
					t.Fatalf("nacked: %v", rec.last())
				}
			}
			if n := c.get("order-42"); n != 1 {
				t.Errorf("event order-42 delivered twice: %d handler calls, want 1", n)
			}

			nats := message.NewMessage("", nil)
			nats.Metadata.Set(inbox.NATSMsgIDHeader, "nats-7")
			if !in.deliver(t, nats) || c.get("nats-7") != 1 {
				t.Errorf("Nats-Msg-Id message: not processed once (%d calls, error %v)", c.get("nats-7"), rec.last())
			}

			none := message.NewMessage("", nil)
			if in.deliver(t, none) {
				t.Fatal("a message with no id at all was acked")
			}
			err := rec.last()
			if !errors.Is(err, inbox.ErrInvalidMessageID) || !errors.Is(err, inbox.ErrEmptyMessageID) ||
				!strings.Contains(err.Error(), `"event-id"`) {
				t.Errorf("error %v: want ErrInvalidMessageID and ErrEmptyMessageID, naming the keys", err)
			}

			watermillMsg := message.NewMessage("0b6ad3c4-uuid", nil)
			acked := in.deliver(t, watermillMsg)
			if tc.uuidFallback != acked {
				t.Errorf("a message with a UUID and no header: acked %v, want %v (error %v)", acked, tc.uuidFallback, rec.last())
			}
			wantRows := 2
			if tc.uuidFallback {
				wantRows = 3
			}
			if n := f.inboxRows(); n != wantRows {
				t.Errorf("inbox rows %d, want %d", n, wantRows)
			}
		})
	}
}
