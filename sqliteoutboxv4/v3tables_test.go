package sqliteoutboxv4_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsqlv3 "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/sqliteoutbox"
	"github.com/watermill-inbox/inbox/sqliteoutboxv4"
)

// SchemaAdapter and OffsetsAdapter read the tables that sqliteoutbox's
// adapters for watermill-sql v3 wrote: a consumer group continues after
// the last message it acked under v3, with payload and metadata intact, so
// moving from v3 to v4 skips and repeats nothing.
func TestSchemaAdapter_continues_from_v3_tables(t *testing.T) {
	t.Parallel()
	db := testdb.OpenSQLite(t, newDBFile(t))
	topic := "orders_" + testdb.RandomSuffix()
	logger := watermill.NopLogger{}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	v3pub, err := wsqlv3.NewPublisher(db, wsqlv3.PublisherConfig{SchemaAdapter: sqliteoutbox.SchemaAdapter{}, AutoInitializeSchema: true}, logger)
	if err != nil {
		t.Fatal(err)
	}
	var sent []*message.Message
	for i := range 3 {
		msg := message.NewMessage(watermill.NewUUID(), []byte{byte(i), 0xff})
		msg.Metadata.Set("n", string(rune('a'+i)))
		if err := v3pub.Publish(topic, msg); err != nil {
			t.Fatal(err)
		}
		sent = append(sent, msg)
	}

	// Under v3, the group acks the first message (a batch of one commits
	// that ack before it reads the second), and stops with the second
	// unacked.
	v3sub, err := wsqlv3.NewSubscriber(db, wsqlv3.SubscriberConfig{
		ConsumerGroup:    "billing",
		PollInterval:     10 * time.Millisecond,
		SchemaAdapter:    sqliteoutbox.SchemaAdapter{SubscribeBatchSize: 1},
		OffsetsAdapter:   sqliteoutbox.OffsetsAdapter{},
		InitializeSchema: true,
	}, logger)
	if err != nil {
		t.Fatal(err)
	}
	v3msgs, err := v3sub.Subscribe(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	recvFrom(t, ctx, v3msgs).Ack()
	if got := recvFrom(t, ctx, v3msgs); got.UUID != sent[1].UUID {
		t.Fatalf("v3 delivered %s second, want %s", got.UUID, sent[1].UUID)
	}
	if err := v3sub.Close(); err != nil {
		t.Fatal(err)
	}

	sub, err := wsql.NewSubscriber(wsql.BeginnerFromStdSQL(db.DB), wsql.SubscriberConfig{
		ConsumerGroup:  "billing",
		PollInterval:   10 * time.Millisecond,
		SchemaAdapter:  sqliteoutboxv4.SchemaAdapter{},
		OffsetsAdapter: sqliteoutboxv4.OffsetsAdapter{},
	}, logger)
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	msgs, err := sub.Subscribe(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range sent[1:] {
		got := recvFrom(t, ctx, msgs)
		got.Ack()
		if got.UUID != want.UUID || string(got.Payload) != string(want.Payload) || got.Metadata.Get("n") != want.Metadata.Get("n") {
			t.Fatalf("v4 delivered %s %x %v, want %s %x %v", got.UUID, got.Payload, got.Metadata, want.UUID, want.Payload, want.Metadata)
		}
	}
}

// recvFrom returns the next message of msgs, failing t when ctx ends or
// msgs closes first.
func recvFrom(t *testing.T, ctx context.Context, msgs <-chan *message.Message) *message.Message {
	t.Helper()
	select {
	case msg, ok := <-msgs:
		if !ok {
			t.Fatal("the subscription closed before a message came")
		}
		return msg
	case <-ctx.Done():
		t.Fatal("no message within a minute")
		return nil
	}
}
