package sqliteoutboxv4

import (
	stdsql "database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
)

// ErrInvalidTopic is wrapped by the errors of the adapters' methods when a
// topic is empty or holds a character that watermill-sql v4 does not allow
// in a topic (anything but A-Z a-z 0-9 - $ : . _). watermill-sql's publisher
// and subscriber refuse such topics before they reach an adapter
// (wsql.ErrInvalidTopicName); this guards direct calls. Match it with
// errors.Is.
var ErrInvalidTopic = errors.New("sqliteoutboxv4: invalid topic")

// ErrConsumerGroup is wrapped by the errors of QueueSchema.SelectQuery and
// QueueOffsetsAdapter.AckMessageQuery when the subscriber has a consumer
// group: a queue table has one "acked" state per row, so it serves one
// logical consumer (as v4's PostgreSQLQueueSchema and MySQLQueueSchema).
// Leave wsql.SubscriberConfig.ConsumerGroup empty. Match it with errors.Is.
var ErrConsumerGroup = errors.New("sqliteoutboxv4: consumer groups are not supported by the queue schema")

// topicPattern is what watermill-sql v4 accepts as a topic (its
// validateTopicName), minus the empty topic.
var topicPattern = regexp.MustCompile(`^[A-Za-z0-9\-$:._]+$`)

func checkTopic(topic string) error {
	if !topicPattern.MatchString(topic) {
		return fmt.Errorf("%w: %q", ErrInvalidTopic, topic)
	}
	return nil
}

// quote makes name one SQLite identifier, whatever it holds.
func quote(name string) string { return `"` + strings.ReplaceAll(name, `"`, `""`) + `"` }

func batchSize(n int) string {
	if n <= 0 {
		n = 100
	}
	return strconv.Itoa(n)
}

// insertQuery inserts msgs into table in one statement: uuid, payload (the
// bytes as they are) and metadata (JSON text).
func insertQuery(table string, msgs message.Messages) (wsql.Query, error) {
	if len(msgs) == 0 {
		return wsql.Query{}, errors.New("sqliteoutboxv4: insert query: no messages")
	}
	args := make([]any, 0, 3*len(msgs))
	for _, msg := range msgs {
		metadata, err := json.Marshal(msg.Metadata)
		if err != nil {
			return wsql.Query{}, fmt.Errorf("sqliteoutboxv4: metadata of message %s: %w", msg.UUID, err)
		}
		args = append(args, msg.UUID, []byte(msg.Payload), string(metadata))
	}
	return wsql.Query{
		Query: "INSERT INTO " + table + " (uuid, payload, metadata) VALUES " +
			strings.TrimSuffix(strings.Repeat("(?, ?, ?),", len(msgs)), ","),
		Args: args,
	}, nil
}

// unmarshalRow scans "offset", uuid, payload, metadata into a wsql.Row
// holding the message.
func unmarshalRow(row wsql.Scanner) (wsql.Row, error) {
	var r wsql.Row
	var uuid string
	var metadata stdsql.NullString
	if err := row.Scan(&r.Offset, &uuid, &r.Payload, &metadata); err != nil {
		return wsql.Row{}, fmt.Errorf("sqliteoutboxv4: scan message row: %w", err)
	}
	r.UUID = []byte(uuid)
	msg := message.NewMessage(uuid, r.Payload)
	if metadata.Valid && metadata.String != "" {
		r.Metadata = []byte(metadata.String)
		if err := json.Unmarshal(r.Metadata, &msg.Metadata); err != nil {
			return wsql.Row{}, fmt.Errorf("sqliteoutboxv4: metadata of message %s: %w", uuid, err)
		}
	}
	r.Msg = msg
	return r, nil
}

// SchemaAdapter is a watermill-sql v4 SchemaAdapter for SQLite with
// consumer groups: one append-only table per topic, "watermill_<topic>",
// whose rows stay after they are consumed (each consumer group keeps its
// own acked offset in OffsetsAdapter's table). Use it with OffsetsAdapter.
// The tables are the same as those of sqliteoutbox (the adapters for
// watermill-sql v3): moving from v3 to v4 keeps the data.
//
// The zero value is ready to use. It holds no state and is safe for
// concurrent use.
type SchemaAdapter struct {
	// GenerateMessagesTableName returns the table name of a topic,
	// unquoted: it is quoted here (unlike v4's PostgreSQL and MySQL
	// adapters, whose function returns the quoted name).
	// Default: "watermill_" + topic.
	GenerateMessagesTableName func(topic string) string

	// SubscribeBatchSize is how many messages a subscriber reads in one
	// transaction. A crash or an ack deadline redelivers at most this many.
	// Default: 100 (0 or less means the default).
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

// SchemaInitializingQueries creates the topic's table if it does not exist:
// "offset" (INTEGER PRIMARY KEY AUTOINCREMENT: offsets are never reused),
// uuid, created_at (Unix microseconds UTC, the database's clock), payload
// (BLOB) and metadata (JSON text).
func (s SchemaAdapter) SchemaInitializingQueries(params wsql.SchemaInitializingQueriesParams) ([]wsql.Query, error) {
	if err := checkTopic(params.Topic); err != nil {
		return nil, err
	}
	return []wsql.Query{{Query: "CREATE TABLE IF NOT EXISTS " + s.MessagesTable(params.Topic) + ` (
		"offset"   INTEGER PRIMARY KEY AUTOINCREMENT,
		uuid       TEXT    NOT NULL,
		created_at INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000000 AS INTEGER)),
		payload    BLOB,
		metadata   TEXT
	)`}}, nil
}

// InsertQuery inserts params.Msgs in one statement, in their order.
func (s SchemaAdapter) InsertQuery(params wsql.InsertQueryParams) (wsql.Query, error) {
	if err := checkTopic(params.Topic); err != nil {
		return wsql.Query{}, err
	}
	return insertQuery(s.MessagesTable(params.Topic), params.Msgs)
}

// SelectQuery reads the next batch after the consumer group's acked offset
// (params.OffsetsAdapter's NextOffsetQuery, which must return one integer),
// in offset order.
func (s SchemaAdapter) SelectQuery(params wsql.SelectQueryParams) (wsql.Query, error) {
	if err := checkTopic(params.Topic); err != nil {
		return wsql.Query{}, err
	}
	if params.OffsetsAdapter == nil {
		return wsql.Query{}, errors.New("sqliteoutboxv4: select query: no offsets adapter")
	}
	next, err := params.OffsetsAdapter.NextOffsetQuery(wsql.NextOffsetQueryParams{
		Topic:         params.Topic,
		ConsumerGroup: params.ConsumerGroup,
	})
	if err != nil {
		return wsql.Query{}, err
	}
	if next.IsZero() {
		return wsql.Query{}, errors.New("sqliteoutboxv4: select query: the offsets adapter has no next offset query (SchemaAdapter goes with OffsetsAdapter)")
	}
	return wsql.Query{
		Query: `SELECT "offset", uuid, payload, metadata FROM ` + s.MessagesTable(params.Topic) +
			` WHERE "offset" > (` + next.Query + `) ORDER BY "offset" ASC LIMIT ` + batchSize(s.SubscribeBatchSize),
		Args: next.Args,
	}, nil
}

// UnmarshalMessage turns a row of SelectQuery into a message, with the
// UUID, payload and metadata that were published.
func (s SchemaAdapter) UnmarshalMessage(params wsql.UnmarshalMessageParams) (wsql.Row, error) {
	return unmarshalRow(params.Row)
}

// SubscribeIsolationLevel is sql.LevelDefault: SQLite transactions are
// serializable, and the driver takes no other level.
func (s SchemaAdapter) SubscribeIsolationLevel() stdsql.IsolationLevel { return stdsql.LevelDefault }

// OffsetsAdapter is a watermill-sql v4 OffsetsAdapter for SQLite that goes
// with SchemaAdapter: one table per topic, "watermill_offsets_<topic>", one
// row per consumer group holding its last acked offset.
//
// The zero value is ready to use. It holds no state and is safe for
// concurrent use.
type OffsetsAdapter struct {
	// GenerateMessagesOffsetsTableName returns the offsets table name of a
	// topic, unquoted: it is quoted here.
	// Default: "watermill_offsets_" + topic.
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
func (a OffsetsAdapter) SchemaInitializingQueries(params wsql.OffsetsSchemaInitializingQueriesParams) ([]wsql.Query, error) {
	if err := checkTopic(params.Topic); err != nil {
		return nil, err
	}
	return []wsql.Query{{Query: "CREATE TABLE IF NOT EXISTS " + a.MessagesOffsetsTable(params.Topic) + ` (
		consumer_group  TEXT    NOT NULL PRIMARY KEY,
		offset_acked    INTEGER,
		offset_consumed INTEGER NOT NULL
	)`}}, nil
}

// AckMessageQuery records params.LastRow (the last message of the batch
// that was acked) as the group's acked offset. It runs in the subscriber's
// transaction, which commits it.
func (a OffsetsAdapter) AckMessageQuery(params wsql.AckMessageQueryParams) (wsql.Query, error) {
	if err := checkTopic(params.Topic); err != nil {
		return wsql.Query{}, err
	}
	return wsql.Query{
		Query: "INSERT INTO " + a.MessagesOffsetsTable(params.Topic) + ` (offset_consumed, offset_acked, consumer_group)
			VALUES (?, ?, ?) ON CONFLICT (consumer_group)
			DO UPDATE SET offset_consumed = excluded.offset_consumed, offset_acked = excluded.offset_acked`,
		Args: []any{params.LastRow.Offset, params.LastRow.Offset, params.ConsumerGroup},
	}, nil
}

// ConsumedMessageQuery is empty, so watermill-sql runs nothing before the
// ack. A write here would take SQLite's only write lock for as long as the
// message is being handled and stall every other writer (publishers,
// other topics' subscribers, the inbox) behind one slow consumer.
func (a OffsetsAdapter) ConsumedMessageQuery(wsql.ConsumedMessageQueryParams) (wsql.Query, error) {
	return wsql.Query{}, nil
}

// NextOffsetQuery returns the group's last acked offset, 0 if it has none.
func (a OffsetsAdapter) NextOffsetQuery(params wsql.NextOffsetQueryParams) (wsql.Query, error) {
	if err := checkTopic(params.Topic); err != nil {
		return wsql.Query{}, err
	}
	return wsql.Query{
		Query: `SELECT COALESCE((SELECT offset_acked FROM ` + a.MessagesOffsetsTable(params.Topic) + ` WHERE consumer_group = ?), 0)`,
		Args:  []any{params.ConsumerGroup},
	}, nil
}

// BeforeSubscribingQueries returns none: SQLite needs no row to lock (its
// write lock serialises the subscribers).
func (a OffsetsAdapter) BeforeSubscribingQueries(wsql.BeforeSubscribingQueriesParams) ([]wsql.Query, error) {
	return nil, nil
}
