package inbox_test

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
)

// TestReview3TransientMessageErrors: the net package's parse and address
// errors (url.Parse, net.ParseCIDR, net.SplitHostPort) implement net.Error,
// but they are errors of the message's content: a redelivery fails the same
// way. Classified transient, such a message never reaches the poison queue
// the README recommends and is redelivered forever. Real network failures
// stay transient.
func TestReview3TransientMessageErrors(t *testing.T) {
	t.Parallel()
	_, urlErr := url.Parse("http://[::1")
	_, _, cidrErr := net.ParseCIDR("10.0.0.0/99")
	_, _, addrErr := net.SplitHostPort("billing.example")
	_, ipErr := net.ResolveIPAddr("ip", "256.1.1.1:80")
	for _, err := range []error{urlErr, cidrErr, addrErr, ipErr} {
		if err == nil {
			t.Fatal("no error produced")
		}
		if inbox.IsTransient(err) || inbox.IsTransient(fmt.Errorf("handler: %w", err)) {
			t.Errorf("IsTransient(%T %v) = true, want false: the message's content is wrong", err, err)
		}
	}

	// Network failures are still transient.
	_, dialErr := net.DialTimeout("tcp", "127.0.0.1:1", time.Second)
	client := &http.Client{Timeout: time.Nanosecond}
	_, httpErr := client.Get("http://127.0.0.1:1/")
	for _, err := range []error{dialErr, httpErr} {
		if err == nil {
			t.Fatal("no error produced")
		}
		if !inbox.IsTransient(fmt.Errorf("handler: %w", err)) {
			t.Errorf("IsTransient(%T %v) = false, want true", err, err)
		}
	}

	// Through a router with the README's poison queue: the message with the
	// bad URL goes to the poison topic (acked), not back to the broker.
	db := openSQLite(t, "")
	f := newFixture(t, db)
	ib := f.newInbox(inbox.Config{})
	poison, sink := poisonUnlessTransient(t)
	in := newFeed()
	defer in.Close()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(poison, ib.Middleware)
		r.AddConsumerHandler("webhooks", "events", in, func(msg *message.Message) error {
			if _, err := url.Parse(string(msg.Payload)); err != nil {
				return fmt.Errorf("webhook target: %w", err)
			}
			return f.writeBusinessRow(msg)
		})
	})
	ctx, cancel := context.WithTimeout(context.Background(), caseTimeout)
	defer cancel()
	msg := message.NewMessage(watermill.NewUUID(), []byte("http://[::1"))
	acked, err := in.send(ctx, delivery(msg, "first"))
	if err != nil {
		t.Fatal(err)
	}
	if !acked || len(sink.poisoned()) != 1 {
		t.Errorf("acked %v, poisoned %d: want the message in the poison queue, not redelivered forever", acked, len(sink.poisoned()))
	}
}
