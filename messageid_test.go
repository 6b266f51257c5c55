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

// A refused message id's error names the package once and still matches
// both of its sentinels: "inbox: invalid message id: empty message id ...",
// not "inbox: invalid message id: inbox: empty message id".
func TestRefusedMessageIDErrorNamesThePackageOnce(t *testing.T) {
	t.Parallel()
	f := newFixture(t, sqliteDB(t))
	fromMetadata := f.newInbox(inbox.Config{MessageID: inbox.MessageIDFromMetadata("event-id")})
	byUUID := f.newInbox(inbox.Config{})
	rec := &recorder{}
	metadataFeed, uuidFeed := newFeed(), newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(rec.Middleware)
		r.AddConsumerHandler("metadata", "orders", metadataFeed, func(*message.Message) error { return nil }).
			AddMiddleware(fromMetadata.Middleware)
		r.AddConsumerHandler("uuid", "orders", uuidFeed, func(*message.Message) error { return nil }).
			AddMiddleware(byUUID.Middleware)
	})
	for _, tc := range []struct {
		feed *feed
		msg  *message.Message
		want string
		is   []error
	}{
		{uuidFeed, message.NewMessage("", nil),
			`inbox: invalid message id: empty message id (message "", consumer "uuid")`,
			[]error{inbox.ErrInvalidMessageID, inbox.ErrEmptyMessageID}},
		{uuidFeed, message.NewMessage(strings.Repeat("x", 256), nil),
			`inbox: invalid message id: message id too long: 256 bytes, at most 255 (message "` + strings.Repeat("x", 256) + `", consumer "uuid")`,
			[]error{inbox.ErrInvalidMessageID, inbox.ErrMessageIDTooLong}},
		{metadataFeed, message.NewMessage("m-1", nil),
			`inbox: message id of message "m-1": invalid message id: empty message id: no metadata "event-id"`,
			[]error{inbox.ErrInvalidMessageID, inbox.ErrEmptyMessageID}},
	} {
		if tc.feed.deliver(t, tc.msg) {
			t.Fatalf("message %q acked", tc.msg.UUID)
		}
		err := rec.last()
		if err == nil || err.Error() != tc.want {
			t.Errorf("error text\n%v\nwant\n%s", err, tc.want)
		}
		for _, target := range tc.is {
			if !errors.Is(err, target) {
				t.Errorf("%v does not match %v", err, target)
			}
		}
	}
}
