// Package sqliteoutbox provides SQLite adapters for watermill-sql v3, which
// ships adapters for MySQL and PostgreSQL only: a SchemaAdapter and an
// OffsetsAdapter, so that watermill-sql's publisher, subscriber and Watermill's
// forwarder work on SQLite, and with them an outbox in the same SQLite
// transaction as the inbox.
//
//	pub, _ := wsql.NewPublisher(tx, wsql.PublisherConfig{SchemaAdapter: sqliteoutbox.SchemaAdapter{}}, logger)
//	sub, _ := wsql.NewSubscriber(db, wsql.SubscriberConfig{
//		SchemaAdapter:  sqliteoutbox.SchemaAdapter{},
//		OffsetsAdapter: sqliteoutbox.OffsetsAdapter{},
//		InitializeSchema: true,
//	}, logger)
//
// Ordering rests on SQLite's single writer: a transaction that writes holds
// the database's write lock until it ends, so message offsets (an
// AUTOINCREMENT key, never reused) are assigned in commit order, and a
// subscriber never skips a message that commits after it read a higher
// offset.
//
// A watermill-sql subscriber keeps its transaction open until the message is
// acked, then writes the acked offset; these adapters write nothing before
// that (ConsumedMessageQuery is empty). SQLite has one write lock, so the
// subscriber's database handle decides the trade-off:
//
//   - With _txlock=immediate (as the inbox recommends), the subscriber takes
//     the write lock at BEGIN and holds it while its messages are handled:
//     delivery is exactly once and in order, and every other writer waits
//     (busy_timeout) meanwhile. Right for Watermill's forwarder, whose
//     handler only publishes to the broker: keep SubscribeBatchSize small.
//   - With deferred transactions (no _txlock), the subscriber only reads
//     while it waits and never blocks writers, but its ack fails with
//     SQLITE_BUSY_SNAPSHOT whenever another writer committed meanwhile, and
//     the batch is delivered again: at least once. Under a steady stream of
//     other writes it may keep failing, so use it only for slow consumers
//     of a quiet database. Watermill's universal pub/sub suite runs in this
//     mode (its tests leave messages unacked while others publish).
//
// SQLite does not queue writers: one that finds the write lock taken sleeps
// and polls until busy_timeout runs out, and under a sustained stream of
// other writes it can lose every poll and fail with SQLITE_BUSY (5) after
// waiting the whole timeout. Schema creation (watermill-sql runs it on
// Subscribe, and on a publisher's first message with AutoInitializeSchema)
// is such a write and is not retried by watermill-sql: create the tables
// before the load starts, and give busy_timeout room (seconds, not
// milliseconds). Everywhere else the error is a nack and
// inbox.IsTransient reports it as transient.
package sqliteoutbox

import (
	stdsql "database/sql"
	"encoding/json"
	"fmt"
	"regexp"
	"strings"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
)

// topicPattern is what a topic may be: it becomes part of a table name.
var topicPattern = regexp.MustCompile(`^[A-Za-z0-9_.\-]+$`)

func quote(name string) string { return `"` + strings.ReplaceAll(name, `"`, `""`) + `"` }

// SchemaAdapter is a watermill-sql SchemaAdapter for SQLite: one table per
// topic, "watermill_<topic>", with an AUTOINCREMENT offset.
type SchemaAdapter struct {
	// GenerateMessagesTableName overrides the table name for a topic
	// (unquoted; it is quoted here). Default: "watermill_" + topic.
	GenerateMessagesTableName func(topic string) string

	// SubscribeBatchSize is how many messages a subscriber reads at once.
	// Default: 100.
	SubscribeBatchSize int
}

var _ wsql.SchemaAdapter = SchemaAdapter{}

// MessagesTable returns the quoted table name of topic.
func (s SchemaAdapter) MessagesTable(topic string) string {
	if s.GenerateMessagesTableName != nil {
		return quote(s.GenerateMessagesTableName(topic))
	}
	return quote("watermill_" + topic)
}

// SchemaInitializingQueries creates the topic's table if it does not exist.
func (s SchemaAdapter) SchemaInitializingQueries(topic string) []wsql.Query {
	return []wsql.Query{{Query: "CREATE TABLE IF NOT EXISTS " + s.MessagesTable(topic) + ` (
		"offset"   INTEGER PRIMARY KEY AUTOINCREMENT,
		uuid       TEXT    NOT NULL,
		created_at INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000000 AS INTEGER)),
		payload    BLOB,
		metadata   TEXT
	)`}}
}

// InsertQuery inserts msgs in one statement.
func (s SchemaAdapter) InsertQuery(topic string, msgs message.Messages) (wsql.Query, error) {
	if !topicPattern.MatchString(topic) {
		return wsql.Query{}, fmt.Errorf("sqliteoutbox: invalid topic %q", topic)
	}
	args := make([]any, 0, 3*len(msgs))
	for _, msg := range msgs {
		metadata, err := json.Marshal(msg.Metadata)
		if err != nil {
			return wsql.Query{}, fmt.Errorf("sqliteoutbox: metadata of message %s: %w", msg.UUID, err)
		}
		args = append(args, msg.UUID, []byte(msg.Payload), string(metadata))
	}
	query := "INSERT INTO " + s.MessagesTable(topic) + " (uuid, payload, metadata) VALUES " +
		strings.TrimSuffix(strings.Repeat("(?, ?, ?),", len(msgs)), ",")
	return wsql.Query{Query: query, Args: args}, nil
}

// SelectQuery reads the next batch after the consumer group's acked offset.
func (s SchemaAdapter) SelectQuery(topic string, consumerGroup string, offsets wsql.OffsetsAdapter) wsql.Query {
	next := offsets.NextOffsetQuery(topic, consumerGroup)
	batch := s.SubscribeBatchSize
	if batch <= 0 {
		batch = 100
	}
	return wsql.Query{
		Query: `SELECT "offset", uuid, payload, metadata FROM ` + s.MessagesTable(topic) +
			` WHERE "offset" > (` + next.Query + `) ORDER BY "offset" ASC LIMIT ` + fmt.Sprint(batch),
		Args: next.Args,
	}
}

// UnmarshalMessage turns a row of SelectQuery into a message.
func (s SchemaAdapter) UnmarshalMessage(row wsql.Scanner) (wsql.Row, error) {
	var r wsql.Row
	var uuid string
	var metadata stdsql.NullString
	if err := row.Scan(&r.Offset, &uuid, &r.Payload, &metadata); err != nil {
		return wsql.Row{}, fmt.Errorf("sqliteoutbox: scan message row: %w", err)
	}
	r.UUID = []byte(uuid)
	msg := message.NewMessage(uuid, r.Payload)
	if metadata.Valid && metadata.String != "" {
		if err := json.Unmarshal([]byte(metadata.String), &msg.Metadata); err != nil {
			return wsql.Row{}, fmt.Errorf("sqliteoutbox: metadata of message %s: %w", uuid, err)
		}
	}
	r.Msg = msg
	return r, nil
}

// SubscribeIsolationLevel is the default: SQLite transactions are
// serializable, and the driver takes no other level.
func (s SchemaAdapter) SubscribeIsolationLevel() stdsql.IsolationLevel { return stdsql.LevelDefault }

// OffsetsAdapter is a watermill-sql OffsetsAdapter for SQLite: one table per
// topic, "watermill_offsets_<topic>", one row per consumer group.
type OffsetsAdapter struct {
	// GenerateMessagesOffsetsTableName overrides the table name for a topic
	// (unquoted). Default: "watermill_offsets_" + topic.
	GenerateMessagesOffsetsTableName func(topic string) string
}

var _ wsql.OffsetsAdapter = OffsetsAdapter{}

// MessagesOffsetsTable returns the quoted offsets table name of topic.
func (a OffsetsAdapter) MessagesOffsetsTable(topic string) string {
	if a.GenerateMessagesOffsetsTableName != nil {
		return quote(a.GenerateMessagesOffsetsTableName(topic))
	}
	return quote("watermill_offsets_" + topic)
}

// SchemaInitializingQueries creates the offsets table if it does not exist.
func (a OffsetsAdapter) SchemaInitializingQueries(topic string) []wsql.Query {
	return []wsql.Query{{Query: "CREATE TABLE IF NOT EXISTS " + a.MessagesOffsetsTable(topic) + ` (
		consumer_group  TEXT    NOT NULL PRIMARY KEY,
		offset_acked    INTEGER,
		offset_consumed INTEGER NOT NULL
	)`}}
}

// AckMessageQuery records row as acked for the group.
func (a OffsetsAdapter) AckMessageQuery(topic string, row wsql.Row, consumerGroup string) wsql.Query {
	return wsql.Query{
		Query: "INSERT INTO " + a.MessagesOffsetsTable(topic) + ` (offset_consumed, offset_acked, consumer_group)
			VALUES (?, ?, ?) ON CONFLICT (consumer_group)
			DO UPDATE SET offset_consumed = excluded.offset_consumed, offset_acked = excluded.offset_acked`,
		Args: []any{row.Offset, row.Offset, consumerGroup},
	}
}

// ConsumedMessageQuery is empty: watermill-sql runs nothing then. A write
// here would take SQLite's only write lock for as long as the message is
// being handled, and stall every other writer (other topics' subscribers,
// publishers, the inbox itself) behind one slow consumer.
func (a OffsetsAdapter) ConsumedMessageQuery(topic string, row wsql.Row, consumerGroup string, _ []byte) wsql.Query {
	return wsql.Query{}
}

// NextOffsetQuery returns the group's last acked offset, 0 if none.
func (a OffsetsAdapter) NextOffsetQuery(topic, consumerGroup string) wsql.Query {
	return wsql.Query{
		Query: `SELECT COALESCE((SELECT offset_acked FROM ` + a.MessagesOffsetsTable(topic) + ` WHERE consumer_group = ?), 0)`,
		Args:  []any{consumerGroup},
	}
}

// BeforeSubscribingQueries: none.
func (a OffsetsAdapter) BeforeSubscribingQueries(topic, consumerGroup string) []wsql.Query {
	return nil
}
