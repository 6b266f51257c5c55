package sqliteoutboxv4_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/sqliteoutboxv4"
)

// Calls that cannot be served fail with an error that errors.Is matches: a
// topic that watermill-sql v4 would refuse (it becomes part of a table
// name), and a consumer group on the queue schema, which has one acked
// state per row.
func TestAdapters_refuse_invalid_topics_and_queue_consumer_groups(t *testing.T) {
	t.Parallel()
	queue, queueOffsets := sqliteoutboxv4.QueueSchema{}, sqliteoutboxv4.QueueOffsetsAdapter{DeleteOnAck: true}
	schema, offsets := sqliteoutboxv4.SchemaAdapter{}, sqliteoutboxv4.OffsetsAdapter{}
	msgs := message.Messages{message.NewMessage(watermill.NewUUID(), nil)}
	for _, tc := range []struct {
		name string
		call func() error
		want error
	}{
		{"insert with a quote in the topic", func() error {
			_, err := schema.InsertQuery(wsql.InsertQueryParams{Topic: `a"b`, Msgs: msgs})
			return err
		}, sqliteoutboxv4.ErrInvalidTopic},
		{"queue insert with an empty topic", func() error {
			_, err := queue.InsertQuery(wsql.InsertQueryParams{Topic: "", Msgs: msgs})
			return err
		}, sqliteoutboxv4.ErrInvalidTopic},
		{"select with a space in the topic", func() error {
			_, err := schema.SelectQuery(wsql.SelectQueryParams{Topic: "a b", OffsetsAdapter: offsets})
			return err
		}, sqliteoutboxv4.ErrInvalidTopic},
		{"queue select for a consumer group", func() error {
			_, err := queue.SelectQuery(wsql.SelectQueryParams{Topic: "orders", ConsumerGroup: "billing", OffsetsAdapter: queueOffsets})
			return err
		}, sqliteoutboxv4.ErrConsumerGroup},
		{"queue ack for a consumer group", func() error {
			_, err := queueOffsets.AckMessageQuery(wsql.AckMessageQueryParams{Topic: "orders", ConsumerGroup: "billing"})
			return err
		}, sqliteoutboxv4.ErrConsumerGroup},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.call(); !errors.Is(err, tc.want) {
				t.Errorf("got %v, want an error matching %v", err, tc.want)
			}
		})
	}
	// Pairing the queue offsets adapter with the offsets schema fails at
	// once instead of reading from offset 0 forever.
	if _, err := schema.SelectQuery(wsql.SelectQueryParams{Topic: "orders", OffsetsAdapter: queueOffsets}); err == nil {
		t.Error("SchemaAdapter's select with QueueOffsetsAdapter: no error")
	}
}

// Without DeleteOnAck, acked rows stay in the queue table marked acked and
// are not delivered again; GenerateWhereClause limits what a subscriber
// reads, and the rows it does not select stay unacked.
func TestQueueSchema_keeps_acked_rows_and_filters_with_where_clause(t *testing.T) {
	t.Parallel()
	db := testdb.OpenSQLite(t, newDBFile(t))
	topic := outboxTopic()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	schema := sqliteoutboxv4.QueueSchema{GenerateWhereClause: func(wsql.GenerateWhereClauseParams) (string, []any) {
		return "json_extract(metadata, '$.tenant') = ?", []any{"a"}
	}}
	sub, err := wsql.NewSubscriber(wsql.BeginnerFromStdSQL(db.DB), wsql.SubscriberConfig{
		PollInterval:     10 * time.Millisecond,
		SchemaAdapter:    schema,
		OffsetsAdapter:   sqliteoutboxv4.QueueOffsetsAdapter{},
		InitializeSchema: true,
	}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	if err := sub.SubscribeInitialize(topic); err != nil {
		t.Fatal(err)
	}
	pub, err := wsql.NewPublisher(wsql.BeginnerFromStdSQL(db.DB), wsql.PublisherConfig{SchemaAdapter: schema}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	var forA []string
	for _, tenant := range []string{"a", "b", "a"} {
		msg := message.NewMessage(watermill.NewUUID(), nil)
		msg.Metadata.Set("tenant", tenant)
		if err := pub.Publish(topic, msg); err != nil {
			t.Fatal(err)
		}
		if tenant == "a" {
			forA = append(forA, msg.UUID)
		}
	}

	msgs, err := sub.Subscribe(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range forA {
		got := recvFrom(t, ctx, msgs)
		got.Ack()
		if got.UUID != want {
			t.Fatalf("delivered %s (tenant %q), want %s", got.UUID, got.Metadata.Get("tenant"), want)
		}
	}
	// The ack of the last one commits after it was acked.
	type row struct {
		Tenant string `db:"tenant"`
		Acked  int    `db:"acked"`
	}
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(10 * time.Millisecond) {
		var rows []row
		if err := db.Select(&rows, `SELECT json_extract(metadata, '$.tenant') AS tenant, acked FROM `+schema.MessagesTable(topic)+` ORDER BY "offset"`); err != nil {
			t.Fatal(err)
		}
		want := []row{{"a", 1}, {"b", 0}, {"a", 1}}
		if len(rows) == 3 && rows[0] == want[0] && rows[1] == want[1] && rows[2] == want[2] {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("rows %v, want %v", rows, want)
		}
	}
}
