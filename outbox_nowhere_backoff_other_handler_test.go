package inbox_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/watermill-inbox/inbox"
)

// A handler whose outputs have nowhere to go backs off over its consecutive
// deliveries, 100 ms doubling to 5 s (docs/errors.md), also while another
// handler behind the same inbox (router.AddMiddleware: every handler of the
// router) commits its own messages: their commits say nothing about the
// misconfigured handler, which is not fixed by them.
func TestOutputsWithNowhereToGoBackOffWhileAnotherHandlerCommits(t *testing.T) {
	db := sqliteDB(t)
	s := randomSuffix()
	f := &fixture{t: t, db: db, inbox: "cli_inbox_" + s, business: "cli_business_" + s}
	dropLater(t, db, f.inbox)
	ib := f.newInbox(inbox.Config{})
	mws, err := ib.Middlewares(inbox.MiddlewaresConfig{})
	if err != nil {
		t.Fatal(err)
	}
	ps := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	t.Cleanup(func() { _ = ps.Close() })
	var calls atomic.Int32
	r := runRouter(t, func(r *message.Router) {
		r.AddMiddleware(mws...)
		r.AddHandler("billing", "cli_orders", ps, "cli_invoices", nil, func(msg *message.Message) ([]*message.Message, error) {
			calls.Add(1)
			return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("invoice"))}, nil
		})
		r.AddConsumerHandler("shipping", "cli_parcels", ps, func(msg *message.Message) error { return nil })
	})
	<-r.Running()
	if err := ps.Publish("cli_orders", message.NewMessage(watermill.NewUUID(), nil)); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	for ctx.Err() == nil { // the other handler's steady traffic: a message every 50 ms
		if err := ps.Publish("cli_parcels", message.NewMessage(watermill.NewUUID(), nil)); err != nil {
			t.Fatal(err)
		}
		select {
		case <-ctx.Done():
		case <-time.After(50 * time.Millisecond):
		}
	}
	if n := calls.Load(); n > 7 {
		t.Errorf("handler called %d times in 3 s for one message whose outputs have nowhere to go, while another handler"+
			" of the inbox committed; want at most 7: the wait before each nack doubles from 100 ms to 5 s", n)
	}
}
