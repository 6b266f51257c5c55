package sqliteoutboxv4

import (
	stdsql "database/sql"
	"encoding/json"
	"errors"
	"fmt"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
)

// QueueSchema is a watermill-sql v4 SchemaAdapter for SQLite in which each
// row is a queue entry with an "acked" state, as v4's PostgreSQLQueueSchema:
// a subscriber reads the unacked rows in offset order, and
// QueueOffsetsAdapter marks them acked, or deletes them (DeleteOnAck), in
// the subscriber's transaction once the handler acked them. Use it with
// QueueOffsetsAdapter; with DeleteOnAck the table only holds the messages
// not yet forwarded (see the package doc for the trade-offs).
//
// It serves one logical consumer: a subscriber with a consumer group is
// refused (ErrConsumerGroup). Several subscribers on one topic share the
// queue: with _txlock=immediate they take turns on SQLite's write lock;
// with deferred transactions two may deliver the same row, and the ack of
// the later one fails with SQLITE_BUSY_SNAPSHOT (at least once).
//
// The zero value is ready to use. It holds no state and is safe for
// concurrent use.
type QueueSchema struct {
	// GenerateWhereClause returns an extra condition for the subscriber's
	// SELECT (ANDed with "acked = 0"), with its arguments for the condition's
	// "?" placeholders, as in v4's PostgreSQLQueueSchema. The condition is SQL
	// text: build it from constants, never from message content.
	// Default: nil, no extra condition.
	GenerateWhereClause func(params wsql.GenerateWhereClauseParams) (string, []any)

	// GenerateMessagesTableName returns the table name of a topic,
	// unquoted: it is quoted here (unlike v4's PostgreSQL and MySQL
	// adapters). QueueOffsetsAdapter.GenerateMessagesTableName must return
	// the same name.
	// Default: "watermill_" + topic.
	GenerateMessagesTableName func(topic string) string

	// SubscribeBatchSize is how many messages a subscriber reads in one
	// transaction. A crash, a closed subscriber or an ack deadline redelivers
	// at most this many; with DeleteOnAck, a batch is deleted in one
	// statement after its last acked message.
	// Default: 100 (0 or less means the default).
	SubscribeBatchSize int
}

var _ wsql.SchemaAdapter = QueueSchema{}

// MessagesTable returns the quoted table name of topic.
func (s QueueSchema) MessagesTable(topic string) string {
	return queueTable(s.GenerateMessagesTableName, topic)
}

func queueTable(generate func(string) string, topic string) string {
	if generate != nil {
		return quote(generate(topic))
	}
	return quote("watermill_" + topic)
}

func queueIndex(generate func(string) string, topic string) string {
	if generate != nil {
		return quote(generate(topic) + "_unacked")
	}
	return quote("watermill_" + topic + "_unacked")
}

// SchemaInitializingQueries creates the topic's table if it does not exist
// ("offset" INTEGER PRIMARY KEY AUTOINCREMENT, so that an offset is never
// reused after a delete; uuid; payload BLOB; metadata JSON text; acked 0 or
// 1; created_at in Unix microseconds UTC by the database's clock), and a
// partial index on the unacked offsets (named after the table, with the
// suffix "_unacked"), so that a subscriber does not scan acked rows when
// they are kept (DeleteOnAck false).
func (s QueueSchema) SchemaInitializingQueries(params wsql.SchemaInitializingQueriesParams) ([]wsql.Query, error) {
	if err := checkTopic(params.Topic); err != nil {
		return nil, err
	}
	table := s.MessagesTable(params.Topic)
	return []wsql.Query{
		{Query: "CREATE TABLE IF NOT EXISTS " + table + ` (
		"offset"   INTEGER PRIMARY KEY AUTOINCREMENT,
		uuid       TEXT    NOT NULL,
		payload    BLOB,
		metadata   TEXT,
		acked      INTEGER NOT NULL DEFAULT 0,
		created_at INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000000 AS INTEGER))
	)`},
		{Query: "CREATE INDEX IF NOT EXISTS " + queueIndex(s.GenerateMessagesTableName, params.Topic) +
			" ON " + table + ` ("offset") WHERE acked = 0`},
	}, nil
}

// InsertQuery inserts params.Msgs in one statement, in their order, unacked.
func (s QueueSchema) InsertQuery(params wsql.InsertQueryParams) (wsql.Query, error) {
	if err := checkTopic(params.Topic); err != nil {
		return wsql.Query{}, err
	}
	return insertQuery(s.MessagesTable(params.Topic), params.Msgs)
}

// SelectQuery reads the next batch of unacked rows (and GenerateWhereClause's
// condition) in offset order. It wraps ErrConsumerGroup when
// params.ConsumerGroup is set.
func (s QueueSchema) SelectQuery(params wsql.SelectQueryParams) (wsql.Query, error) {
	if err := checkTopic(params.Topic); err != nil {
		return wsql.Query{}, err
	}
	if params.ConsumerGroup != "" {
		return wsql.Query{}, fmt.Errorf("%w (consumer group %q)", ErrConsumerGroup, params.ConsumerGroup)
	}
	var where string
	var args []any
	if s.GenerateWhereClause != nil {
		where, args = s.GenerateWhereClause(wsql.GenerateWhereClauseParams{Topic: params.Topic})
		if where != "" {
			where = " AND (" + where + ")"
		}
	}
	return wsql.Query{
		Query: `SELECT "offset", uuid, payload, metadata FROM ` + s.MessagesTable(params.Topic) +
			` WHERE acked = 0` + where + ` ORDER BY "offset" ASC LIMIT ` + batchSize(s.SubscribeBatchSize),
		Args: args,
	}, nil
}

// UnmarshalMessage turns a row of SelectQuery into a message, with the
// UUID, payload and metadata that were published.
func (s QueueSchema) UnmarshalMessage(params wsql.UnmarshalMessageParams) (wsql.Row, error) {
	return unmarshalRow(params.Row)
}

// SubscribeIsolationLevel is sql.LevelDefault: SQLite transactions are
// serializable, and the driver takes no other level.
func (s QueueSchema) SubscribeIsolationLevel() stdsql.IsolationLevel { return stdsql.LevelDefault }

// QueueOffsetsAdapter is the watermill-sql v4 OffsetsAdapter that goes with
// QueueSchema: it keeps no table of its own; an ack marks the batch's acked
// rows acked, or deletes them with DeleteOnAck, as v4's
// PostgreSQLQueueOffsetsAdapter.
//
// Only the rows up to the batch's last acked message (AckMessageQueryParams.
// LastRow) are acked or deleted. watermill-sql v4.1.2 passes every row it
// read in AckMessageQueryParams.Rows, including those after a message that
// was never acked because the subscriber closed or the ack deadline passed
// while it was being handled; acking those would drop messages that were
// never forwarded. The subscriber delivers a batch in offset order and
// stops at the first message that is not acked, so the acked rows are
// exactly those with an offset up to LastRow's.
//
// The zero value is ready to use. It holds no state and is safe for
// concurrent use.
type QueueOffsetsAdapter struct {
	// DeleteOnAck deletes acked rows instead of marking them acked: the
	// table then holds only the messages not yet acked, and nothing is
	// kept for audit or replay.
	// Default: false, rows are kept with acked = 1.
	DeleteOnAck bool

	// GenerateMessagesTableName returns the table name of a topic,
	// unquoted; it must return what QueueSchema.GenerateMessagesTableName
	// returns.
	// Default: "watermill_" + topic.
	GenerateMessagesTableName func(topic string) string
}

var _ wsql.OffsetsAdapter = QueueOffsetsAdapter{}

// MessagesTable returns the quoted table name of topic.
func (a QueueOffsetsAdapter) MessagesTable(topic string) string {
	return queueTable(a.GenerateMessagesTableName, topic)
}

// SchemaInitializingQueries returns none: the table is QueueSchema's.
func (a QueueOffsetsAdapter) SchemaInitializingQueries(wsql.OffsetsSchemaInitializingQueriesParams) ([]wsql.Query, error) {
	return nil, nil
}

// NextOffsetQuery is not used by QueueSchema, which reads unacked rows; it
// returns an error, so that pairing this adapter with SchemaAdapter fails
// at the first poll instead of reading from offset 0 forever.
func (a QueueOffsetsAdapter) NextOffsetQuery(wsql.NextOffsetQueryParams) (wsql.Query, error) {
	return wsql.Query{}, errors.New("sqliteoutboxv4: QueueOffsetsAdapter has no offsets: use it with QueueSchema")
}

// AckMessageQuery marks acked, or deletes (DeleteOnAck), the rows of the
// batch whose offset is at most params.LastRow's (see the type's doc), in
// one statement whose offsets travel as one JSON array argument. It wraps
// ErrConsumerGroup when params.ConsumerGroup is set.
func (a QueueOffsetsAdapter) AckMessageQuery(params wsql.AckMessageQueryParams) (wsql.Query, error) {
	if err := checkTopic(params.Topic); err != nil {
		return wsql.Query{}, err
	}
	if params.ConsumerGroup != "" {
		return wsql.Query{}, fmt.Errorf("%w (consumer group %q)", ErrConsumerGroup, params.ConsumerGroup)
	}
	offsets := make([]int64, 0, len(params.Rows))
	for _, row := range params.Rows {
		if row.Offset <= params.LastRow.Offset {
			offsets = append(offsets, row.Offset)
		}
	}
	list, err := json.Marshal(offsets)
	if err != nil {
		return wsql.Query{}, fmt.Errorf("sqliteoutboxv4: ack offsets: %w", err)
	}
	table := a.MessagesTable(params.Topic)
	where := ` WHERE "offset" IN (SELECT value FROM json_each(?))`
	if a.DeleteOnAck {
		return wsql.Query{Query: "DELETE FROM " + table + where, Args: []any{string(list)}}, nil
	}
	return wsql.Query{Query: "UPDATE " + table + " SET acked = 1" + where, Args: []any{string(list)}}, nil
}

// ConsumedMessageQuery is empty, so watermill-sql runs nothing before the
// ack (a write here would hold SQLite's only write lock while the message
// is handled).
func (a QueueOffsetsAdapter) ConsumedMessageQuery(wsql.ConsumedMessageQueryParams) (wsql.Query, error) {
	return wsql.Query{}, nil
}

// BeforeSubscribingQueries returns none.
func (a QueueOffsetsAdapter) BeforeSubscribingQueries(wsql.BeforeSubscribingQueriesParams) ([]wsql.Query, error) {
	return nil, nil
}
