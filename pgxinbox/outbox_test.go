package pgxinbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// With Config.Outbox over watermill-sql v4 (wsql.TxFromPgx), the messages a
// handler returns and the ones it publishes through inbox.OutboxFromContext
// are written in the inbox transaction: a subscriber over the pool
// (wsql.BeginnerFromPgx) receives them iff that transaction commits, once
// per processed message, none for a failed try or a duplicate.
func TestOutbox_PublishedIffTheInboxTransactionCommits(t *testing.T) {
	forEachDialect(t, func(t *testing.T, d inbox.Dialect) {
		pool := testdb.OpenPgxPool(t, "")
		subPool := testdb.OpenPgxPool(t, "") // the subscriber polls: its connections are not the inbox's
		f := newFixture(t, pool)
		topic := "pgx_outbox_" + f.sfx
		f.dropLater(`"watermill_` + topic + `"`)
		// The queue schema: the default schema's subscriber reads only rows
		// older than every transaction open on the server
		// (pg_snapshot_xmin), which other tests' and processes' open
		// transactions on this shared server hold back for as long as they
		// run.
		schema := wsql.PostgreSQLQueueSchema{}
		sub, err := wsql.NewSubscriber(wsql.BeginnerFromPgx(subPool), wsql.SubscriberConfig{
			PollInterval:     10 * time.Millisecond,
			SchemaAdapter:    schema,
			OffsetsAdapter:   wsql.PostgreSQLQueueOffsetsAdapter{DeleteOnAck: true},
			InitializeSchema: true,
		}, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { sub.Close() })
		ctx, cancel := context.WithTimeout(context.Background(), caseTimeout)
		defer cancel()
		published, err := sub.Subscribe(ctx, topic) // creates the outbox tables
		if err != nil {
			t.Fatal(err)
		}

		ib := f.newInbox(pgxinbox.Config{Dialect: d, Outbox: func(tx pgx.Tx) (message.Publisher, error) {
			return wsql.NewPublisher(wsql.TxFromPgx(tx), wsql.PublisherConfig{SchemaAdapter: schema}, watermill.NopLogger{})
		}})
		rec := &recorder{}
		var c calls
		in := newFeed()
		runRouter(t, func(r *message.Router) {
			r.AddMiddleware(rec.Middleware, ib.Middleware)
			r.AddHandler("billing", "orders", in, topic, gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{}),
				func(msg *message.Message) ([]*message.Message, error) {
					c.inc(msg)
					if err := f.writeEffect(msg); err != nil {
						return nil, err
					}
					out := func(kind string) *message.Message {
						m := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
						m.Metadata.Set("source", msg.UUID)
						m.Metadata.Set("kind", kind)
						return m
					}
					pub, ok := inbox.OutboxFromContext(msg.Context())
					if !ok {
						return nil, errors.New("no outbox publisher in the message context")
					}
					if err := pub.Publish(topic, out("from-context")); err != nil {
						return nil, err
					}
					if msg.Metadata.Get("delivery") == "fail" {
						return nil, errors.New("declined after publishing")
					}
					return []*message.Message{out("returned")}, nil
				})
		})
		m1, m2 := message.NewMessage(watermill.NewUUID(), nil), message.NewMessage(watermill.NewUUID(), nil)
		if in.deliver(t, labelled(m1, "fail")) {
			t.Error("acked a failed try")
		}
		for _, m := range []*message.Message{m1, m1, m2} {
			if !in.deliver(t, m) {
				t.Fatalf("nacked: %v", rec.last())
			}
		}
		f.expectRows(2, 2)
		if n := c.get(""); n != 3 {
			t.Errorf("handler calls %d, want 3", n)
		}
		// m2's messages commit last: once both arrived, every message
		// committed before them has too (the queue reads in offset order).
		got := map[string]int{}
		for got[m2.UUID+"/from-context"] == 0 || got[m2.UUID+"/returned"] == 0 {
			select {
			case m := <-published:
				got[m.Metadata.Get("source")+"/"+m.Metadata.Get("kind")]++
				m.Ack()
			case <-ctx.Done():
				t.Fatalf("outbox messages not received: got %v", got)
			}
		}
		want := map[string]int{m1.UUID + "/from-context": 1, m1.UUID + "/returned": 1, m2.UUID + "/from-context": 1, m2.UUID + "/returned": 1}
		if len(got) != len(want) {
			t.Errorf("published %v, want %v", got, want)
		}
		for k, n := range want {
			if got[k] != n {
				t.Errorf("published %v, want %v", got, want)
				break
			}
		}
		expectNoConnHeld(t, pool)
	})
}
