package inbox

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
)

// Defaults of OutboxConfig.
const (
	// DefaultOutboxTable is OutboxConfig.Table when it is empty; its
	// dead-letter table is "<table>_dead" (Outbox.DeadLetterTable).
	DefaultOutboxTable = "watermill_inbox_outbox"
	// DefaultOutboxBatchSize is OutboxConfig.BatchSize when it is zero.
	DefaultOutboxBatchSize = 500
	// DefaultOutboxPollInterval is OutboxConfig.PollInterval when it is zero.
	DefaultOutboxPollInterval = time.Second
	// DefaultOutboxMaxAttempts is OutboxConfig.MaxAttempts when it is zero.
	DefaultOutboxMaxAttempts = 10
	// DefaultOutboxLinger is OutboxConfig.Linger when it is zero.
	DefaultOutboxLinger = 5 * time.Millisecond
	// DefaultOutboxMaxBackoff is OutboxConfig.MaxBackoff when it is zero.
	DefaultOutboxMaxBackoff = 5 * time.Second
	// DefaultOutboxTopicConcurrency is OutboxConfig.TopicConcurrency when
	// it is zero.
	DefaultOutboxTopicConcurrency = 64
)

// MaxOutboxBatchSize is the largest OutboxConfig.BatchSize.
const MaxOutboxBatchSize = 10000

// outboxInsertChunk is the most rows one outbox INSERT writes: 4 bind
// parameters a row stay far below every database's limit (65,535 on
// PostgreSQL and MySQL, 32,766 on SQLite).
const outboxInsertChunk = 1000

// outboxInsertBytes is the most bytes one outbox INSERT carries at worst
// (outboxRowBytes; a message larger alone goes alone): with
// go-sql-driver/mysql's interpolateParams a statement is one packet, and
// outputs whose sum passed MariaDB's max_allowed_packet (16 MiB by
// default) failed every delivery of their message. Counted from the
// stored values, not the message: metadata is stored as JSON, where a
// control character or <, > and & take 6 bytes, and counting the raw
// metadata let 6 outputs of 600 KiB go in one INSERT of about 25 MiB.
const outboxInsertBytes = 8 << 20

// outboxRowBytes returns the bytes row i of args (appendOutboxRows's: topic,
// UUID, payload, metadata) takes in an INSERT at worst: the payload and the
// metadata twice (interpolateParams escapes a NUL, a quote or a backslash
// as two bytes), the topic and the UUID once more than their length.
func outboxRowBytes(args []any, i int) int {
	topic, _ := args[4*i].(string)
	uuid, _ := args[4*i+1].(string)
	payload, _ := args[4*i+2].([]byte)
	meta, _ := args[4*i+3].([]byte)
	return 2*(len(topic)+len(uuid)) + 2*(len(payload)+len(meta)) + 16
}

// outboxRowSizes returns the size at worst (outboxRowBytes) of each row of
// args.
func outboxRowSizes(args []any) []int {
	sizes := make([]int, len(args)/4)
	for i := range sizes {
		sizes[i] = outboxRowBytes(args, i)
	}
	return sizes
}

// outboxOneInsert reports whether the rows of args go in one INSERT
// (insertChunkEnd would not split them), without building their sizes.
func outboxOneInsert(args []any, limit int) bool {
	rows := len(args) / 4
	return rows <= 1 || rows <= outboxInsertChunk && outboxRowsBytes(args) <= limit
}

// outboxRowsBytes returns the size at worst (outboxRowBytes) of all the
// rows of args.
func outboxRowsBytes(args []any) int {
	total := 0
	for i := range len(args) / 4 {
		total += outboxRowBytes(args, i)
	}
	return total
}

// insertChunkEnd returns where the INSERT of the rows of sizes (each row's
// bytes in the statement) from row start ends: at most outboxInsertChunk
// rows and, past the first, limit bytes.
func insertChunkEnd(sizes []int, start, limit int) int {
	size := 0
	for i := start; i < len(sizes) && i < start+outboxInsertChunk; i++ {
		size += sizes[i]
		if i > start && size > limit {
			return i
		}
	}
	return min(len(sizes), start+outboxInsertChunk)
}

// mysqlEscapedLen returns the bytes b takes in a statement that
// go-sql-driver/mysql's interpolateParams wrote: it escapes NUL, \n, \r,
// \x1a, ', " and \ as two bytes each (with NO_BACKSLASH_ESCAPES only ',
// so this is then at most).
func mysqlEscapedLen(b []byte) int {
	n := len(b)
	for _, c := range b {
		switch c {
		case 0, '\n', '\r', 0x1a, '\'', '"', '\\':
			n++
		}
	}
	return n
}

// outboxLargeBytes is the size at worst (outboxRowBytes) of a publish's
// rows past which a writer on MySQL/MariaDB reads the session's
// max_allowed_packet (mysqlPacketLimit): one round trip, for outputs of a
// megabyte or more only.
const outboxLargeBytes = 1 << 20

// maxOutboxTopic is the longest topic the outbox stores, in bytes.
const maxOutboxTopic = 1024

// ErrOutboxMessage is wrapped by the error an outbox publisher returns for a
// message it cannot store: an empty or over-long topic, a message UUID
// that is empty, over MaxKeyLength bytes or not valid UTF-8 (the next
// consumer's inbox could not deduplicate it), on MySQL/MariaDB a payload and
// stored metadata over the server's max_allowed_packet less 16 KiB
// together. Not transient
// (IsTransient). Nothing is written then, and
// the inbox rolls the message's transaction back. Metadata keys and values
// may hold any bytes: those that are not valid UTF-8 are stored in base64
// and reach the broker unchanged.
var ErrOutboxMessage = errors.New("inbox: message cannot go to the outbox")

// OutboxConfig configures an Outbox.
type OutboxConfig struct {
	// DB is the database of the inbox table: the outbox rows are written in
	// the inbox transaction, and the relay reads and deletes them here.
	// Give it the inbox's own handle (Config.DB; pgxinbox.DB(pool) once,
	// for both): the rows go to the database of the transaction that
	// writes them whatever DB says, so an inbox of package inbox on
	// another handle logs, once, at Info, that they are never sent unless
	// both handles reach the same database. Required.
	DB *sqlx.DB

	// Dialect is the SQL dialect of DB. Default: inferred from
	// DB.DriverName(), as Config.Dialect.
	Dialect Dialect

	// Table is the outbox table; its dead-letter table is "<Table>_dead"
	// (shortened with a hash past 63 bytes: Outbox.DeadLetterTable). On
	// PostgreSQL a name without a schema is looked up once along the
	// search_path (temporary schemas left out): by Verify (RouterPlugin),
	// InitializeSchema, the relay's first round or Stats on a connection
	// of DB; or else, for the writers the inbox makes (Publisher and
	// pgxinbox.OutboxPublisher as Config.Outbox), in the message's
	// transaction before the handler runs; for a writer the application
	// makes itself, at its first write on a connection of DB (waiting at
	// most 5 s for one). Every statement of the Outbox names that schema
	// from then on, whatever search_path a handler sets in its
	// transaction. A table that is not found is not pinned: writes name
	// the schema CREATE TABLE would use and fail there (ErrTableNotFound,
	// transient), and the inbox fails the delivery even when the handler
	// went on without its output.
	// It may be schema-qualified and must match the pattern of
	// Config.Table. Default: DefaultOutboxTable ("watermill_inbox_outbox").
	Table string

	// Publisher is the broker's publisher the relay sends the messages to,
	// each to the topic it was published to in the handler. It is called
	// with all the messages of one topic of a batch at once, in the order
	// they were written, from up to TopicConcurrency goroutines at once
	// (one call per topic at a time), so it must be safe for concurrent
	// use, as Watermill's message.Publisher contract asks; the relay
	// deletes their rows once it returns nil, so nil must mean the broker
	// has them (RabbitMQ: watermill-amqp's Publish.ConfirmDelivery). A
	// publisher that waits for each message's ack in turn moves one message
	// per broker round trip: for Kafka use kafkaoutbox.NewPublisher, which
	// sends the whole call in one batch (watermill-kafka's publisher does
	// not). An error that wraps ErrBrokerUnavailable or ErrMessageRejected
	// says what kind of refusal it is; one that carries a PublishError says
	// each message's outcome, and the relay then deletes the rows of the
	// messages the broker took. Required.
	Publisher message.Publisher

	// BatchSize is the most messages one relay transaction reads, publishes
	// and deletes; between 1 and MaxOutboxBatchSize. Larger batches relay
	// faster, and after a crash send up to a batch again. A read that the
	// database stops for its statement timeout (PostgreSQL's
	// statement_timeout, MariaDB's max_statement_time, MySQL's
	// max_execution_time: large messages) has the relay read half as many
	// rows, down to one, and twice as many again, up to BatchSize, once a
	// minute has passed without such a timeout (a relay that read BatchSize
	// rows every round failed every round, and sent nothing). A round holds
	// its messages in memory until the broker has them: with outputs of
	// megabytes, lower it (500 outputs of 4 MiB hold 2 GiB).
	// Default: DefaultOutboxBatchSize (500).
	BatchSize int

	// PollInterval is how long the relay waits for new messages when
	// nothing tells it of any: messages committed through an Inbox of this
	// process wake it at once; those of other processes are found at the
	// latest after PollInterval. Must not be negative.
	// Default: DefaultOutboxPollInterval (1 s).
	PollInterval time.Duration

	// Linger is how long the relay waits, once a commit of this process
	// woke it, before it reads: the commits of that moment then go out in
	// one round instead of one round each, which spares the database a
	// transaction per message while the handlers are busy. It adds up to
	// Linger to the time from commit to broker when the relay was idle.
	// Must not be negative; 0 takes the default (time.Nanosecond reads
	// all but at once).
	// Default: DefaultOutboxLinger (5 ms).
	Linger time.Duration

	// MaxAttempts is how many times the relay tries to publish a message
	// the broker refuses before it sets the message aside in the
	// dead-letter table, so that it stops holding back the messages behind
	// it on its topic. A message is set aside once its refusal wraps
	// ErrMessageRejected, or else only once the broker has accepted a
	// message behind it on the same topic in the same round (so a broker
	// that is down sets nothing aside, however long the outage); several
	// refused in a row, up to 8, are set aside together, each after its
	// own MaxAttempts. Never when its refusal wraps ErrBrokerUnavailable,
	// which also uses none of its attempts (the refusal is recorded as its
	// last error). Until then it stays first in line. Must be at least 1.
	// Default: DefaultOutboxMaxAttempts (10).
	MaxAttempts int

	// TopicConcurrency is how many topics one relay round publishes to at
	// once: a round's messages go to the publisher in one call per topic,
	// and each call waits for the broker (kafkaoutbox's gathers for 5 ms,
	// then a produce round trip), so a round of messages spread over many
	// topics (one per tenant), published one topic after another, sent a
	// few hundred messages a second whatever its BatchSize (200 topics
	// through kafkaoutbox: 230-310 msgs/s; 2,400-2,900 at 16 at once,
	// 5,100-7,100 at 64; BenchmarkOutboxRelayToManyTopics). A publisher
	// that holds a resource per call (a database connection) holds up to
	// that many at once. A topic's
	// messages are published by one call or walk at a time, in order, so
	// the order of each topic holds; messages of different topics have no
	// order between them (see docs/outbox.md, Order). The publisher is
	// called from that many goroutines at once, which Watermill's
	// message.Publisher contract allows ("Publish must be thread safe");
	// set 1 for a publisher that is not. Must not be negative.
	// Default: DefaultOutboxTopicConcurrency (64).
	TopicConcurrency int

	// MaxBackoff caps the wait after a failed relay round (a publish the
	// broker refused, a database error), which doubles from 50 ms. Must not
	// be negative. Default: DefaultOutboxMaxBackoff (5 s).
	MaxBackoff time.Duration

	// Logger receives an Error line for each failed relay round and for
	// each message set aside, and one Info line when messages were
	// committed and no relay had started in this process by 5
	// PollIntervals after the first commit (a relay that started and
	// stopped since is not told apart: the outbox's depth and age are, in
	// Stats and the metrics module). Default: the router's logger under
	// RouterPlugin, otherwise watermill.NopLogger; the no-relay line then
	// goes to the logger of the inbox that wrote the messages (its
	// Config.Logger, or its router's under Inbox.RouterPlugin), so that a
	// relay never added is not silent.
	Logger watermill.LoggerAdapter

	// OnRound, if set, is called after every relay round that found
	// messages or failed, with its outcome, for metrics. It runs on the
	// goroutine of the round's caller (Run's, RelayOnce's), after the
	// round's turn ended: it may call RelayOnce, and the rounds of several
	// Runs or RelayOnce calls may have it called at the same time, so it
	// must be safe for concurrent use (the metrics module's is). A panic
	// in it is recovered and logged (Logger); the round's outcome stands.
	// Default: nil.
	OnRound func(OutboxRound)
}

// OutboxRound is the outcome of one relay round.
type OutboxRound struct {
	// Relayed is the number of messages the broker accepted and whose rows
	// were deleted.
	Relayed int
	// Failed is the number of messages whose refusal the round recorded:
	// each counted once however many times the round tried it, whether it
	// stays first in line or is set aside (DeadLettered counts those
	// again). A refusal that wraps ErrBrokerUnavailable counts although it
	// uses none of the message's MaxAttempts; so does a round whose
	// records the database did not commit (Err says so). The messages
	// behind a refused one that the round did not try on their own are
	// not counted, although a call refused whole refused them too.
	Failed int
	// DeadLettered is the number of messages set aside in the dead-letter
	// table.
	DeadLettered int
	// Duration is how long the round took.
	Duration time.Duration
	// Err is the round's error, nil on success.
	Err error
}

// OutboxStats is what Outbox.Stats reads.
type OutboxStats struct {
	// Pending is the number of messages not yet relayed; -1 when Stats
	// could not count them (it then returns an error too).
	Pending int64
	// OldestAge is how long ago the oldest pending message was written, by
	// the database clock; 0 when none is pending.
	OldestAge time.Duration
	// DeadLettered is the number of messages in the dead-letter table; -1
	// when Stats could not count them (it then returns an error too).
	DeadLettered int64
	// FirstLastError is the last refusal of the first message in line
	// (the smallest id; a topic the broker keeps refusing ends up holding
	// it, since the other topics flow), as the relay stored it in
	// last_error: "" when none is pending or it was never refused.
	FirstLastError string
}

// Outbox is the transactional outbox of the inbox, with its relay: the
// messages a handler returns (or publishes through OutboxFromContext) are
// written to the outbox table in the message's inbox transaction, and the
// relay sends them to OutboxConfig.Publisher once that transaction has
// committed, then deletes their rows. Plug it in with
// Config{Outbox: ob.Publisher} and router.AddPlugin(ob.RouterPlugin).
//
// Guarantees (docs/outbox.md says what each rests on):
//   - a message is sent if and only if its transaction commits, at least
//     once: a crash or a relay stopped at any point only sends it again,
//     with the same UUID and metadata, so the next consumer's inbox skips
//     the repeat;
//   - a sent message's row is deleted in the transaction that read it, so
//     the table holds only what has not been sent;
//   - a round publishes the committed messages of a topic it reads in
//     the order of their ids: one transaction's in the order it wrote
//     them, and those of transactions committed one after another in that
//     order; a transaction that committed after a round read a later one's
//     messages is published after them; a crash sends a batch again, and
//     several relays on one table publish their batches side by side;
//   - with a publisher that says each message's outcome (PublishError,
//     kafkaoutbox's), the messages the broker took are deleted and only
//     the refused ones stay first in line;
//   - on PostgreSQL and MySQL/MariaDB a relay locks the rows it reads (FOR
//     UPDATE SKIP LOCKED), so several instances share the work and no row
//     is skipped when transactions commit out of id order; on SQLite one
//     relay per database is expected (two send messages twice).
//
// An Outbox is safe for concurrent use; run one relay (Run or RouterPlugin)
// per process.
type Outbox struct {
	cfg     OutboxConfig
	dialect Dialect
	// dialectInferred: OutboxConfig.Dialect was nil, inferred from the
	// DB's driver name; server checks that it is the server's.
	dialectInferred bool
	server          serverCheck
	readServer      serverCheck // checkServer for Stats: what reads need (sessionReads)
	wake            chan struct{}
	logger          *componentLogger
	running         runs // RouterPlugin's goroutine, Run calls

	// configured is the tables and statements as OutboxConfig.Table names
	// them; pinned, once set, the ones every statement runs from then on
	// (pinTarget): on PostgreSQL an unqualified table name qualified by
	// the schema it was found in, elsewhere or already qualified the
	// configured ones, set by newOutbox.
	configured outboxTarget
	pinned     atomic.Pointer[outboxTarget]

	// insertOne is one message's INSERT prepared on cfg.DB by the relay
	// (prepareInsertOne); nil until then.
	insertOne atomic.Pointer[sqlx.Stmt]
	// claimedOne holds, by query, one message's claimed INSERT (see
	// outboxSQL.claimedInsert) prepared on cfg.DB; a nil *sqlx.Stmt while
	// it is being prepared (preparedClaimedInsert).
	claimedOne sync.Map
	// noInTxVar: the server has no @@in_transaction (MySQL; MariaDB has
	// it), found by the first claimed INSERT that used it.
	noInTxVar atomic.Bool
	// noIdleTimeoutVars: the server has no idle-transaction timeouts
	// (MySQL; MariaDB has them), found by the relay's first read that named
	// them (outboxSQL.idleTimeoutsOff).
	noIdleTimeoutVars atomic.Bool
	// maxAllowedPacket is MySQL's max_allowed_packet as a writer last read
	// it (mysqlPacketLimit; 0: never read), for a writer of PublisherOn that
	// cannot read it now.
	maxAllowedPacket atomic.Int64
	// relayStarted is set by the first Run; noRelayCheck schedules, at the
	// first commit that wakes no relay, the one-time check of
	// warnIfNoRelay.
	relayStarted atomic.Bool
	noRelayCheck sync.Once
	// inboxLogger is the logger of an inbox that wrote here and logs
	// (bindTx), where warnIfNoRelay says so when the Outbox has no logger of
	// its own: without RouterPlugin it never gets the router's, and the
	// warning about a relay never added went nowhere.
	inboxLogger atomic.Pointer[componentLogger]
	// otherDBNoted: an inbox on another database handle than
	// OutboxConfig.DB wrote here, and its logger said so (once); or, for
	// a transaction that is not of a *sql.DB (pgxinbox's), the databases
	// were compared once (noteOtherDatabase).
	otherDBNoted atomic.Bool
	// readLimit is the most rows a round reads now, below cfg.BatchSize
	// after a read stopped by a statement timeout (0: cfg.BatchSize), and
	// readTimedOut the time of the last such read, in Unix nanoseconds
	// (see OutboxConfig.BatchSize).
	readLimit    atomic.Int64
	readTimedOut atomic.Int64
	// relaying holds a token while a round runs (capacity 1).
	relaying chan struct{}
	// topics is the Runs' memory of the topics the broker refused.
	topics *topicBackoff
	// floor is where the rounds' reads start while topics wait (see
	// outboxFloor); guarded by relaying.
	floor outboxFloor
}

func (c *OutboxConfig) setDefaults() {
	if c.Dialect == nil && c.DB != nil {
		c.Dialect, _ = dialectForDriver(c.DB.DriverName())
	}
	if c.Table == "" {
		c.Table = DefaultOutboxTable
	}
	if c.BatchSize == 0 {
		c.BatchSize = DefaultOutboxBatchSize
	}
	if c.PollInterval == 0 {
		c.PollInterval = DefaultOutboxPollInterval
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = DefaultOutboxMaxAttempts
	}
	if c.Linger == 0 {
		c.Linger = DefaultOutboxLinger
	}
	if c.MaxBackoff == 0 {
		c.MaxBackoff = DefaultOutboxMaxBackoff
	}
	if c.TopicConcurrency == 0 {
		c.TopicConcurrency = DefaultOutboxTopicConcurrency
	}
}

// Validate reports every problem of the configuration at once, joined with
// errors.Join; nil means valid. Zero optional fields are accepted as their
// defaults.
func (c OutboxConfig) Validate() error {
	errs := validateTarget("OutboxConfig", c.DB, c.Dialect, c.Table)
	if c.Publisher == nil {
		errs = append(errs, errors.New("OutboxConfig.Publisher (the broker's publisher) is required"))
	}
	if c.BatchSize < 0 || c.BatchSize > MaxOutboxBatchSize {
		errs = append(errs, fmt.Errorf("OutboxConfig.BatchSize must be between 1 and %d, got %d", MaxOutboxBatchSize, c.BatchSize))
	}
	if c.PollInterval < 0 {
		errs = append(errs, fmt.Errorf("OutboxConfig.PollInterval must not be negative, got %v", c.PollInterval))
	}
	if c.MaxAttempts < 0 {
		errs = append(errs, fmt.Errorf("OutboxConfig.MaxAttempts must be at least 1, got %d", c.MaxAttempts))
	}
	if c.Linger < 0 {
		errs = append(errs, fmt.Errorf("OutboxConfig.Linger must not be negative, got %v", c.Linger))
	}
	if c.MaxBackoff < 0 {
		errs = append(errs, fmt.Errorf("OutboxConfig.MaxBackoff must not be negative, got %v", c.MaxBackoff))
	}
	if c.TopicConcurrency < 0 {
		errs = append(errs, fmt.Errorf("OutboxConfig.TopicConcurrency must be at least 1, got %d", c.TopicConcurrency))
	}
	return errors.Join(errs...)
}

// NewOutbox checks cfg (the error wraps ErrInvalidConfig) and returns an
// Outbox. It does not touch the database: create the tables with
// InitializeSchema (or apply its DDL with your migrations).
func NewOutbox(cfg OutboxConfig) (*Outbox, error) {
	inferred := cfg.Dialect == nil
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	t, _ := parseTableName(cfg.Table) // validated
	o := newOutbox(cfg, t)
	o.dialectInferred = inferred
	return o, nil
}

// newOutbox returns the Outbox of cfg (defaults set) for its table t.
func newOutbox(cfg OutboxConfig, t qualifiedName) *Outbox {
	o := &Outbox{
		cfg:        cfg,
		dialect:    cfg.Dialect,
		configured: newOutboxTarget(cfg.Dialect, t),
		wake:       make(chan struct{}, 1),
		relaying:   make(chan struct{}, 1),
		topics:     &topicBackoff{max: cfg.MaxBackoff, waits: map[string]topicWait{}},
		logger:     newComponentLogger(cfg.Logger, watermill.LogFields{"outbox_table": t.String()}),
	}
	if !o.resolvesSchema() {
		o.pinned.Store(&o.configured)
	}
	return o
}

// outboxTarget is the outbox table, its dead-letter table and the
// statements that name them.
type outboxTarget struct {
	table, dead qualifiedName
	sql         outboxSQL
}

func newOutboxTarget(d Dialect, t qualifiedName) outboxTarget {
	dead := qualifiedName{schema: t.schema, name: t.derivedName("_dead")}
	return outboxTarget{table: t, dead: dead, sql: d.outbox(t, dead)}
}

// resolvesSchema reports whether the outbox table's schema is found once
// by pinTarget: PostgreSQL, with a table name that names no schema. A
// handler's SET LOCAL search_path (a schema per tenant) changes what an
// unqualified name means in its transaction, where the inbox writes the
// messages it returned after it returned: they went to the tenant's table
// of the same name, committed, where no relay reads. MySQL/MariaDB and
// SQLite have no search path (a handler's USE, or a temporary table, is
// documented in docs/usage.md as something it must not leave).
func (o *Outbox) resolvesSchema() bool {
	return o.dialect.server() == serverPostgreSQL && o.configured.table.schema == ""
}

// target returns the tables and statements the outbox runs: the pinned
// ones, or the configured ones until pinTarget found the schema. Safe for
// concurrent use.
func (o *Outbox) target() *outboxTarget {
	if t := o.pinned.Load(); t != nil {
		return t
	}
	return &o.configured
}

// pinTarget returns the tables and statements every statement of the
// outbox runs, finding them first when they are not yet, on a connection of
// cfg.DB (lookUpTarget). Errors wrap the driver's.
func (o *Outbox) pinTarget(ctx context.Context) (*outboxTarget, error) {
	if t := o.pinned.Load(); t != nil {
		return t, nil
	}
	var t *outboxTarget
	// One statement with a bind parameter, in a transaction of its own
	// (behind PgBouncer's transaction pooling a statement outside one may
	// meet another server connection than its prepare).
	err := withReadTx(ctx, o.cfg.DB, o.dialect, func(q sqlx.QueryerContext) error {
		var err error
		t, _, err = o.lookUpTarget(ctx, func(ctx context.Context, query string, args []any, dest ...any) error {
			return q.QueryRowxContext(ctx, query, args...).Scan(dest...)
		})
		return err
	})
	if err != nil {
		return nil, poolerHint(err)
	}
	return t, nil
}

// outboxQueryRow runs query with args and scans its one row into dest.
type outboxQueryRow func(ctx context.Context, query string, args []any, dest ...any) error

// lookUpTarget finds, on PostgreSQL, the schema of an unqualified outbox
// table along the search_path that queryRow's session has now (temporary
// schemas left out), and pins it: every statement of the Outbox names that
// schema from then on, the writers', the relay's, Stats' and Verify's, so
// they cannot part, and a handler's SET LOCAL search_path (a schema per
// tenant) cannot send its outputs elsewhere. The writers look it up in
// their transaction before the handler runs (Publisher, and pgxinbox's
// OutboxPublisher), needing no connection more; Verify (RouterPlugin),
// InitializeSchema, the relay and Stats on a connection of cfg.DB. A table
// not found is not pinned (found false): the result names the schema
// CREATE TABLE would use (current_schema()), so that a write fails there
// (undefined table) and InitializeSchema creates it there, and the next
// look-up looks again. Concurrent look-ups find the same schema and the
// first stored wins. Errors wrap the driver's.
func (o *Outbox) lookUpTarget(ctx context.Context, queryRow outboxQueryRow) (t *outboxTarget, found bool, err error) {
	if t := o.pinned.Load(); t != nil {
		return t, true, nil
	}
	var schema, current sql.NullString
	err = queryRow(ctx, `SELECT (SELECT s.nspname FROM unnest(pg_catalog.current_schemas(false)) WITH ORDINALITY AS s(nspname, pos)
		JOIN pg_catalog.pg_namespace n ON n.nspname = s.nspname
		JOIN pg_catalog.pg_class c ON c.relnamespace = n.oid AND c.relname = $1 AND c.relkind IN ('r', 'p')
		WHERE n.oid <> pg_catalog.pg_my_temp_schema() ORDER BY s.pos LIMIT 1), pg_catalog.current_schema()`,
		[]any{o.configured.table.name}, &schema, &current)
	if err != nil {
		return nil, false, fmt.Errorf("inbox: outbox table %s: find its schema: %w", o.configured.table, err)
	}
	if !schema.Valid {
		if !current.Valid {
			// The unqualified name would resolve along whatever
			// search_path a statement meets: never written so.
			return nil, false, fmt.Errorf("%w: outbox table %s is on no schema of the search_path, and no schema of it exists to"+
				" create it in", ErrTableNotFound, o.configured.table)
		}
		t := newOutboxTarget(o.dialect, qualifiedName{schema: current.String, name: o.configured.table.name})
		return &t, false, nil
	}
	pinned := newOutboxTarget(o.dialect, qualifiedName{schema: schema.String, name: o.configured.table.name})
	o.pinned.CompareAndSwap(nil, &pinned)
	return o.pinned.Load(), true, nil
}

// InitializeSchema creates the outbox table and its dead-letter table if
// they do not exist, and checks those it found: one of another shape
// (another outbox's) or that does not keep what commits (Verify) is an
// error wrapping ErrIncompatibleTable. It is idempotent and safe to run
// from several processes at once. On PostgreSQL an unqualified table is created in the
// schema CREATE TABLE uses (current_schema()) unless the search_path
// already finds one, and from then on every statement of the Outbox names
// that schema (OutboxConfig.Table). A dialect for another database server
// than the DB's (checked first) gives an error wrapping ErrDialectMismatch.
func (o *Outbox) InitializeSchema(ctx context.Context) error {
	if err := o.checkServer(ctx); err != nil {
		return err
	}
	t, err := o.pinTarget(ctx)
	if err != nil {
		return err
	}
	if err := o.dialect.createOutbox(ctx, o.cfg.DB, t.table, t.sql.create); err != nil {
		return fmt.Errorf("inbox: initialize outbox %s: %w", t.table, poolerHint(err))
	}
	if t, err = o.pinTarget(ctx); err != nil {
		return err
	}
	// A table that was there already (CREATE TABLE IF NOT EXISTS left it)
	// may be another outbox's (watermill-sql's) or one that does not keep
	// what commits: said here, as the inbox's InitializeSchema says of an
	// inbox table it found, not by the relay's first round. Its shape is
	// read with a SELECT of the relay's columns on no row.
	err = withReadTx(ctx, o.cfg.DB, o.dialect, func(q sqlx.QueryerContext) error {
		if err := checkOutboxDurable(ctx, q, o.dialect, t.table, t.dead); err != nil {
			return err
		}
		rows, err := q.QueryxContext(ctx, t.sql.probe)
		if err != nil {
			return fmt.Errorf("%w: outbox table %q is not one the relay can read (another outbox's? compare with"+
				" Outbox.SchemaSQL): %w", ErrIncompatibleTable, t.table.String(), err)
		}
		return rows.Close()
	})
	return poolerHint(err)
}

// SchemaSQL returns the DDL of the outbox and dead-letter tables, for
// migration tools. It names the tables as OutboxConfig.Table does.
func (o *Outbox) SchemaSQL() string {
	return strings.Join(o.configured.sql.create, ";\n\n") + ";\n"
}

// OutboxSchemaSQL returns the DDL of the outbox table named table (empty:
// DefaultOutboxTable) and of its dead-letter table for dialect d, exactly
// as Outbox.SchemaSQL returns it for an Outbox of that table, without an
// Outbox (whose Publisher, a broker's, may connect when it is made): for
// migrations written where no broker is reachable, and the inbox command
// ("inbox schema -outbox-table"). A nil d is an error wrapping
// ErrUnknownDialect; an invalid name, one wrapping ErrInvalidTableName.
func OutboxSchemaSQL(d Dialect, table string) (string, error) {
	if d == nil {
		return "", fmt.Errorf("%w: nil dialect", ErrUnknownDialect)
	}
	if table == "" {
		table = DefaultOutboxTable
	}
	t, err := parseTableName(table)
	if err != nil {
		return "", err
	}
	return strings.Join(newOutboxTarget(d, t).sql.create, ";\n\n") + ";\n", nil
}

// Publisher returns a publisher that writes to the outbox in tx: the
// signature of Config.Outbox (Config{Outbox: ob.Publisher}). Its Publish
// inserts the messages, in one statement per 1,000, with the message's
// UUID, payload and metadata, for the relay to send to the topic given once
// tx commits; it sends nothing itself. On PostgreSQL, with a table name
// without a schema, until the Outbox has found the table's schema
// (OutboxConfig.Table), the inbox has it looked up in tx before the
// handler runs (one catalog read); called by the application, it looks it
// up at its first write on a connection of OutboxConfig.DB. Its errors
// wrap ErrOutboxMessage or the driver's error; a table the look-up did not
// find makes Publish fail with a transient error wrapping
// ErrTableNotFound. Each is bound to one transaction, and valid while it is
// open: made by the inbox, it refuses a Publish once the handler has
// returned (an AfterCommit function, a goroutine that outlives the
// handler) with an error wrapping sql.ErrTxDone, nothing written. Its own
// Publish calls run one at a time, but not apart from the
// other statements on tx: like tx, make them from one goroutine at a time
// with the handler's statements and ORM calls (see TxFromContext). Close
// does nothing.
func (o *Outbox) Publisher(tx *sqlx.Tx) (message.Publisher, error) {
	if tx == nil {
		return nil, errors.New("inbox: outbox publisher: no transaction")
	}
	exec := func(ctx context.Context, query string, args ...any) error {
		_, err := tx.ExecContext(ctx, tx.Rebind(query), args...)
		return err
	}
	w := &outboxWriter{o: o, exec: exec, tx: tx, ctx: context.Background(), rebind: tx.Rebind, inTx: true}
	w.lookUp = func(ctx context.Context, query string, args []any, dest ...any) error {
		return tx.QueryRowxContext(ctx, tx.Rebind(query), args...).Scan(dest...)
	}
	writerMadeFor(tx, w)
	return w, nil
}

// factoryWriters holds, while the inbox calls its outbox factory for a
// delivery's transaction, the outbox writers made for that transaction
// (Publisher, or PublisherOn that a backend marked with backend.MadeFor),
// by the transaction (*sqlx.Tx, or the backend's handle). A factory that
// wraps the writer in a decorator (Watermill's
// MessageTransformPublisherDecorator, a tracing one) returns a publisher the
// inbox cannot see through: unbound, the writer wrote after a deadlock the
// handler ignored (in autocommit on MySQL/MariaDB: an output sent for a
// nacked delivery, and again under a new UUID by its redelivery), and its
// commits did not wake the relay. An entry lives only for the factory call.
var factoryWriters sync.Map // transaction -> *madeWriters

// madeWriters are the writers made for one transaction during its factory
// call.
type madeWriters struct {
	mu      sync.Mutex
	writers []txBoundPublisher
}

// writerMadeFor records w as made for tx, when the inbox is calling its
// outbox factory for tx.
func writerMadeFor(tx any, w *outboxWriter) {
	if m, ok := factoryWriters.Load(tx); ok {
		m := m.(*madeWriters)
		m.mu.Lock()
		m.writers = append(m.writers, w)
		m.mu.Unlock()
	}
}

// setPublisher calls factory, the outbox factory, for the delivery's
// transaction tx and keeps what it returns, and the outbox writers of this
// package it made for tx: the publisher itself, or those a decorator wraps.
func (s *txState) setPublisher(tx any, factory func() (message.Publisher, error)) error {
	made := &madeWriters{}
	factoryWriters.Store(tx, made)
	p, err := func() (message.Publisher, error) {
		defer factoryWriters.Delete(tx) // also when the factory panics
		return factory()
	}()
	if err != nil {
		return err
	}
	s.publisher = p
	if w, ok := p.(txBoundPublisher); ok {
		s.writers = []txBoundPublisher{w}
		return nil
	}
	made.mu.Lock()
	s.writers = made.writers
	made.mu.Unlock()
	return nil
}

// lookUpTarget has the writer name the outbox table by its schema
// (Outbox.lookUpTarget) when the Outbox has not pinned it yet. The inbox
// calls it (bindTx) in the message's transaction before the handler runs,
// through the writer's lookUp, so that the handler's SET LOCAL
// search_path does not count and no connection more is needed. A writer
// the inbox did not bind (Publisher or PublisherOn called by the
// application, whose transaction may have any search_path, role or pool)
// looks it up at its first write on a connection of OutboxConfig.DB,
// waiting at most pinWriteWait for one (on a pool its caller holds whole,
// that fails until Verify, InitializeSchema or the relay pinned it). An
// error is kept for every write to return (refuse).
func (w *outboxWriter) lookUpTarget(ctx context.Context, bound bool) {
	if !w.o.resolvesSchema() || w.o.pinned.Load() != nil || w.tgt != nil || w.lookUpErr != nil {
		return
	}
	var t *outboxTarget
	var found bool
	var err error
	if bound && w.lookUp != nil {
		// Before the handler runs, in the message's transaction.
		t, found, err = w.o.lookUpTarget(ctx, w.lookUp)
	} else {
		// The application's transaction may have any search_path, role
		// ("$user") or pool: never pinned from there.
		ctx, cancel := context.WithTimeout(ctx, pinWriteWait)
		defer cancel()
		if t, err = w.o.pinTarget(ctx); err == nil {
			found = w.o.pinned.Load() != nil
		}
	}
	if err != nil {
		if errors.Is(err, ErrTableNotFound) {
			err = &misconfiguredError{err} // nothing about the message is wrong: transient
		}
		w.lookUpErr = fmt.Errorf("inbox: outbox: %w", err)
		return
	}
	w.tgt, w.missing = t, !found
}

// pinWriteWait bounds how long a writer the inbox did not bind waits for a
// connection of OutboxConfig.DB to look its table up (lookUpTarget): its
// caller may hold the last one. The write then fails (context deadline).
const pinWriteWait = 5 * time.Second

// refuse records err, the refusal of msgs to topic for the table
// (lookUpTarget's error, or an INSERT into a table the look-up did not
// find), for refusedWrite, until a later write of the same messages
// succeeds (written).
func (w *outboxWriter) refuse(err error, topic string, msgs []*message.Message) error {
	w.refusedMu.Lock()
	defer w.refusedMu.Unlock()
	if w.refused == nil {
		w.refused = map[string]error{}
	}
	for _, m := range msgs {
		if _, ok := w.refused[topic+"\x00"+m.UUID]; !ok {
			w.refused[topic+"\x00"+m.UUID] = err
		}
	}
	return err
}

// written forgets the refusals of msgs to topic, now written: the handler
// recovered (rolled back to a savepoint, created the table) and wrote them.
func (w *outboxWriter) written(topic string, msgs []*message.Message) {
	w.refusedMu.Lock()
	defer w.refusedMu.Unlock()
	for _, m := range msgs {
		delete(w.refused, topic+"\x00"+m.UUID)
	}
}

// refusedWrite implements txBoundPublisher.
func (w *outboxWriter) refusedWrite() error {
	w.refusedMu.Lock()
	defer w.refusedMu.Unlock()
	for _, err := range w.refused {
		return err
	}
	return nil
}

// target returns the tables and statements the writer writes with.
func (w *outboxWriter) target() *outboxTarget {
	if w.tgt != nil {
		return w.tgt
	}
	return w.o.target()
}

// prepareInsertOne prepares the INSERT of one message on cfg.DB for the
// writers (database/sql then keeps it prepared on each connection it has
// run on), on MySQL/MariaDB and SQLite, where the inbox prepares its claim
// too. The relay calls it outside any transaction, so that a writer never
// waits for a second connection of a full pool while it holds one; until
// it succeeds writers run the statement unprepared.
func (o *Outbox) prepareInsertOne(ctx context.Context) {
	if o.insertOne.Load() != nil || !o.dialect.preparesByDefault() {
		return
	}
	t := o.target()
	stmt, err := o.cfg.DB.PreparexContext(ctx, o.cfg.DB.Rebind(t.sql.insertPrefix+t.sql.insertRow))
	if err != nil {
		return // the table may not exist yet: the next round tries again
	}
	if !o.insertOne.CompareAndSwap(nil, stmt) {
		stmt.Close()
	}
}

// OutboxExec runs one statement in the caller's transaction, with its bind
// parameters, and returns the driver's error: what PublisherOn writes
// through.
type OutboxExec func(ctx context.Context, query string, args ...any) error

// PublisherOn returns an outbox publisher, as Publisher does, that writes
// through exec: for a transaction of another driver than database/sql
// (pgxinbox.OutboxPublisher passes a pgx.Tx's Exec). Statements carry the
// placeholders of OutboxConfig.DB's driver ($1 for "pgx" and "postgres", ?
// for "mysql" and "sqlite"); payloads and metadata are []byte, stored as
// bytea/blob in every pgx query mode. It is bound to the transaction exec
// runs in, and safe for concurrent use while that is open: its Publish
// calls run one at a time (a pgx.Tx is not safe for concurrent use, so the
// caller's own statements on it must not run beside them). It cannot read
// through exec, so it looks the table's schema up, when the Outbox has not
// found it yet, at its first write on a connection of OutboxConfig.DB
// (pgxinbox.OutboxPublisher gives the inbox a way to look it up in the
// message's transaction instead). Returned by Config.Outbox on
// MySQL/MariaDB or SQLite, it cannot check the claim in its INSERT, as
// Publisher does, so the inbox reads the claim before each of its
// Publish calls (one read more each), as for another package's publisher.
func (o *Outbox) PublisherOn(exec OutboxExec) message.Publisher {
	bind := sqlx.BindType(o.cfg.DB.DriverName())
	rebind := func(query string) string { return sqlx.Rebind(bind, query) }
	return &outboxWriter{o: o, ctx: context.Background(), rebind: rebind, exec: func(ctx context.Context, query string, args ...any) error {
		return exec(ctx, rebind(query), args...)
	}}
}

// txBoundPublisher is an outbox publisher of this package (outboxWriter)
// that the middleware tells of its transaction's context, claim and commit.
type txBoundPublisher interface {
	bindTx(ctx context.Context, ended func() bool, inboxDB, prepareOn *sql.DB, claim *outboxClaim, logger *componentLogger)
	// publishLast is Publish for the messages the handler returned, the
	// transaction's last statements before the pre-commit check: it
	// reports whether they checked that the transaction still holds its
	// claim (claimed INSERTs), which makes that check's read redundant.
	publishLast(topic string, msgs []*message.Message) (claimHeld bool, err error)
	// stageLast checks msgs as Publish does and, instead of writing them,
	// returns their INSERT (the driver's placeholders) and its arguments
	// for the caller to run with COMMIT, the transaction's last
	// statement. ok is false, and nothing is checked, when the writer
	// cannot: it writes elsewhere than through the transaction, checks the
	// claim in its inserts, or msgs need more than one statement.
	stageLast(topic string, msgs []*message.Message) (query string, args []any, ok bool, err error)
	// stagedInsertError returns the error a failed INSERT of n messages
	// to topic is reported with when the table, not the messages, is at
	// fault (transient); nil otherwise, for the caller to report err.
	stagedInsertError(topic string, n int, err error) error
	// refusedWrite returns the refusal of a message because the outbox
	// table was not found (or could not be looked up), unless a later
	// write of that message succeeded: the delivery fails with it even
	// when the handler ignored it, since the output is not written.
	refusedWrite() error
	// checksClaim reports whether each write checks, in its own statement,
	// that the transaction still holds the claim where the dialect needs
	// that (bindTx set the claim): false for a writer through PublisherOn
	// on MySQL/MariaDB or SQLite, which the inbox then checks as another
	// package's publisher.
	checksClaim() bool
	// endWrites refuses every Publish from now on, once the ones in
	// progress are done: the inbox calls it before its pre-commit check
	// and COMMIT, and before a rollback.
	endWrites()
	committed()
}

// outboxClaim is the inbox claim that an outbox writer's inserts check
// (outboxSQL.claimedInsert), on the dialects whose inserts read it:
// MySQL/MariaDB, whose pre-commit check reads the claim's row, and SQLite,
// whose driver reports no transaction status.
type outboxClaim struct {
	table        string // the inbox table, quoted
	consumer, id string
}

var _ txBoundPublisher = (*outboxWriter)(nil)

// outboxWriter is the outbox publisher of one inbox transaction.
type outboxWriter struct {
	o *Outbox
	// publishing serializes Publish: a transaction of another driver
	// (PublisherOn: a pgx.Tx, not safe for concurrent use) is used by one
	// statement at a time, and a writer's first write looks its table up.
	publishing sync.Mutex
	exec       OutboxExec            // runs a statement ("?" placeholders) in the transaction
	rebind     func(q string) string // "?" placeholders to the driver's
	// inTx: exec runs in the transaction the writer was made for (always
	// for Publisher; for PublisherOn when marked by backend.WritesInTx), so
	// that its statement may be sent with that transaction's COMMIT
	// (stageLast).
	inTx  bool
	tx    *sqlx.Tx        // the transaction, when it is database/sql's (Publisher); nil for PublisherOn
	ctx   context.Context // the transaction's (bindTx)
	ended func() bool     // the server has ended the transaction (bindTx); nil: unknown
	// prepared: one message's INSERT runs as the Outbox's prepared
	// statement (bindTx: the inbox prepares its own statements, on the
	// Outbox's database).
	prepared bool
	// claim, when set (bindTx), is checked by every insert in the same
	// statement (outboxSQL.claimedInsert): an insert that succeeded found
	// it held.
	claim *outboxClaim
	// key is the delivery's claim (bindTx), which a write refused for an
	// ended transaction reads to tell the handler's COMMIT from a rollback
	// (endedError); nil for a writer the inbox did not bind.
	key   *outboxClaim
	wrote atomic.Bool
	// done: the inbox is ending the transaction (endWrites); a Publish
	// from then on writes nothing. Guarded by publishing.
	done bool
	// lookUp reads a row in the writer's transaction, for lookUpTarget
	// (nil: the writer cannot read there). tgt, when set, is the target the
	// look-up found; missing: it did not find the table, and tgt names the
	// schema it would be created in; lookUpErr: the look-up failed.
	lookUp    outboxQueryRow
	bound     bool // bindTx ran: the inbox made the writer
	tgt       *outboxTarget
	missing   bool
	lookUpErr error
	// refused is the first write refused for the table (refuse), which
	// fails the delivery even when the handler ignored it.
	refusedMu sync.Mutex
	refused   map[string]error // by topic and UUID
}

// bindTx makes the writer's statements run under ctx, the inbox
// transaction's context (cancelled by the message's context until the
// handler returns, then by Config.CommitTimeout), and has it ask ended,
// before every write, whether the transaction is still open on the server
// (from the status of the connection's last response: no round trip). The
// middleware calls it right after the Outbox factory. prepareOn is the
// inbox's database when the inbox prepares its statements (MySQL/MariaDB
// and SQLite, PostgreSQL with Config.PrepareStatements), nil otherwise:
// when it is the Outbox's database too, a message written alone runs as a
// prepared statement (on MySQL/MariaDB one round trip instead of
// go-sql-driver/mysql's prepare, execute and close; on SQLite no parse).
//
// claim, when not nil, is the inbox claim of the transaction: on
// MySQL/MariaDB every insert then checks, in its own statement, that the
// transaction still holds it, so that an insert after a deadlock the
// handler ignored (the database rolled the transaction back, and the
// connection's last status still says it is open) writes nothing instead
// of committing on its own.
func (w *outboxWriter) bindTx(ctx context.Context, ended func() bool, inboxDB, prepareOn *sql.DB, claim *outboxClaim, logger *componentLogger) {
	if il := w.o.inboxLogger.Load(); il != logger && (il == nil || il.nop()) && logger != nil && !logger.nop() {
		w.o.inboxLogger.Store(logger) // an inbox that logs, rather than the first to write
	}
	w.ctx, w.ended = ctx, ended
	w.bound, w.key = true, claim
	w.lookUpTarget(ctx, true) // before the handler runs
	w.prepared = w.tx != nil && prepareOn != nil && prepareOn == w.o.cfg.DB.DB
	if w.tx != nil && inboxDB != nil && inboxDB != w.o.cfg.DB.DB && logger != nil && w.o.otherDBNoted.CompareAndSwap(false, true) {
		// The rows go in the inbox's database, and the relay reads
		// OutboxConfig.DB's: on two databases they were committed and
		// never sent, with nothing said (a relay ran). Two handles on one
		// database are right, so this is said, not refused.
		logger.get().Info("Inbox: the Outbox's DB (OutboxConfig.DB) is another database handle than the inbox's (Config.DB):"+
			" its messages are written in the inbox's database, and its relay reads OutboxConfig.DB's, so unless both"+
			" handles reach the same database they are never sent; give both the same *sqlx.DB",
			watermill.LogFields{"outbox_table": w.o.target().table.String()})
	}
	if w.tx == nil && w.lookUp != nil && logger != nil && !logger.nop() && w.o.resolvesSchema() && w.o.otherDBNoted.CompareAndSwap(false, true) {
		w.noteOtherDatabase(ctx, logger)
	}
	if w.tx != nil && w.target().sql.claimedInsert != nil {
		w.claim = claim
	}
}

// pgDatabaseIdentity names the PostgreSQL database a session is on, the
// same through any pooler and whatever the session's settings: its name
// and its server's start time, as a number.
const pgDatabaseIdentity = "SELECT pg_catalog.current_database()::text || ' ' || " +
	"EXTRACT(EPOCH FROM pg_catalog.pg_postmaster_start_time())::text"

// noteOtherDatabase is bindTx's check of another database for a writer
// bound to a transaction it reads through lookUp (pgxinbox's, whose
// transactions are not of a *sql.DB to compare with OutboxConfig.DB):
// once per Outbox, before the handler runs, it reads which database the
// transaction is on and which OutboxConfig.DB is on and, when they differ,
// says at Info that the messages are written where the relay never reads
// them (they were committed and never sent, with nothing said). A read
// that fails says nothing: the check is advice, and the transaction's
// failed read would be the delivery's error anyway.
func (w *outboxWriter) noteOtherDatabase(ctx context.Context, logger *componentLogger) {
	var inTx string
	if err := w.lookUp(ctx, pgDatabaseIdentity, nil, &inTx); err != nil {
		return
	}
	// OutboxConfig.DB's on a goroutine of its own: the delivery's
	// transaction may hold the pool's last connection (pgxinbox.DB of a
	// pool of one), and the first delivery waited for one meanwhile.
	go w.o.noteOtherDatabase(inTx, logger)
}

// noteOtherDatabase reads which database OutboxConfig.DB is on and says at
// Info, once, when it is not inTx's (outboxWriter.noteOtherDatabase).
func (o *Outbox) noteOtherDatabase(inTx string, logger *componentLogger) {
	ctx, cancel := context.WithTimeout(context.Background(), VerifyTimeout)
	defer cancel()
	var ofDB string
	if err := o.cfg.DB.QueryRowContext(ctx, pgDatabaseIdentity).Scan(&ofDB); err != nil || inTx == ofDB {
		return
	}
	logger.get().Info("Inbox: the Outbox's DB (OutboxConfig.DB) is on another database than the inbox's transactions:"+
		" its messages are written in the inbox's database, and its relay reads OutboxConfig.DB's, so they are never sent;"+
		" give the Outbox a DB on the inbox's database (pgxinbox.DB(pool) of the inbox's pool)",
		watermill.LogFields{"outbox_table": o.target().table.String(), "inbox_database": inTx, "outbox_database": ofDB})
}

// erUnknownSystemVariable is MySQL's ER_UNKNOWN_SYSTEM_VARIABLE, what
// erNoSuchTable is MySQL/MariaDB's ER_NO_SUCH_TABLE.
const erNoSuchTable = 1146

// tableMissing reports whether err, from a statement on the outbox table of
// t, comes from that table being missing: the error is MySQL/MariaDB's 1146
// (ER_NO_SUCH_TABLE) or, on SQLite, whose "no such table" has the generic
// code SQLITE_ERROR, any; and, since a trigger on the outbox table that
// writes to a missing table fails with the same code, the table itself is
// found missing: by the catalog read on q, or, when q is nil, by a read of
// no row of it through exec. Both run in the failed statement's own
// transaction (which MySQL/MariaDB and SQLite leave open after it), never
// on another connection of the pool, which the transaction may hold the
// last of; each for at most a second. Not on PostgreSQL, whose failed
// statement ends the transaction and whose look-up before the handler
// tells a missing table (outboxWriter.missing).
func (o *Outbox) tableMissing(ctx context.Context, err error, t *outboxTarget, q sqlx.QueryerContext, exec OutboxExec) bool {
	switch {
	case o.dialect.server() == serverPostgreSQL, ctx.Err() != nil:
		return false
	case o.dialect.server() == serverMySQL && !hasMySQLNumber(err, erNoSuchTable):
		return false
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
	defer cancel()
	if q != nil {
		_, cerr := o.dialect.checkTable(ctx, q, t.table)
		return errors.Is(cerr, ErrTableNotFound)
	}
	perr := exec(ctx, "SELECT 1 FROM "+t.table.quoted(o.dialect)+" WHERE 1 = 0")
	if o.dialect.server() == serverMySQL {
		return hasMySQLNumber(perr, erNoSuchTable)
	}
	// SQLITE_ERROR, which a read of no row of an existing table cannot
	// get: not a transaction that has ended (sql.ErrTxDone, where the
	// INSERT failed for the same reason), a closed connection or an I/O
	// error.
	return hasSQLiteError(perr)
}

// MySQL answers to MariaDB's @@in_transaction.
const erUnknownSystemVariable = 1193

// insertClaimed runs the claimed INSERT (outboxSQL.claimedInsert) of the
// messages whose values are args.
func (w *outboxWriter) insertClaimed(n int, args []any, prepare bool) error {
	args = append(args, w.claim.consumer, w.claim.id)
	for {
		inTx := !w.o.noInTxVar.Load()
		query := w.target().sql.claimedInsert(w.claim.table, n, inTx)
		var res sql.Result
		var err error
		if stmt := w.o.preparedClaimedInsert(query, n == 1 && w.prepared); stmt != nil {
			res, err = w.tx.StmtxContext(w.ctx, stmt).ExecContext(w.ctx, args...)
		} else if prepare {
			res, err = w.execPreparedResult(query, args)
		} else {
			res, err = w.tx.ExecContext(w.ctx, query, args...)
		}
		if err != nil && inTx && hasMySQLNumber(err, erUnknownSystemVariable) {
			w.o.noInTxVar.Store(true) // MySQL: the claim's row alone decides
			continue
		}
		if err != nil {
			return err
		}
		rows, err := res.RowsAffected()
		switch {
		case err != nil:
			return err
		case rows == 0:
			// Not claimCommitted: the transaction is open as far as the
			// driver knows (writable asked), so the claim is gone with a
			// rollback, and a row there now is another delivery's.
			return fmt.Errorf("%w: the transaction no longer holds the claim of %q/%q (the database rolled it back"+
				" after an error the handler ignored, or the handler ended it)", claimGoneError(w.o.dialect), w.claim.consumer, w.claim.id)
		case rows != int64(n):
			return fmt.Errorf("%w: %d, writing %d messages", ErrUnexpectedRowsAffected, rows, n)
		}
		return nil
	}
}

// execPrepared runs query with args as a statement prepared on the
// writer's transaction (w.tx), and closes it: with go-sql-driver/mysql
// each value then goes on its own (COM_STMT_SEND_LONG_DATA), where
// interpolateParams would put them all, escaped, in one packet.
func (w *outboxWriter) execPrepared(query string, args []any) error {
	_, err := w.execPreparedResult(query, args)
	return err
}

func (w *outboxWriter) execPreparedResult(query string, args []any) (sql.Result, error) {
	stmt, err := w.tx.PreparexContext(w.ctx, query)
	if err != nil {
		return nil, err
	}
	res, err := stmt.ExecContext(w.ctx, args...)
	if cerr := stmt.Close(); err == nil && cerr != nil {
		return nil, cerr
	}
	return res, err
}

// mysqlPacketLimit reads the session's max_allowed_packet and returns the
// most bytes an INSERT of several rows may carry and the size past which a
// row goes alone as a prepared statement (execPrepared), whose values are
// not escaped; it sets sizes to each row's size once escaped by
// interpolateParams (mysqlEscapedLen), the size of the statement that
// carries it. A row whose payload and metadata together pass the packet
// less packetMargin is not stored: ErrOutboxMessage, not transient (the
// server answered 1153, ER_NET_PACKET_TOO_LARGE, and dropped the
// connection; the failed rollback made the error transient, and the
// message was redelivered for ever). Together, not each: go-sql-driver/mysql
// sends a value on its own (COM_STMT_SEND_LONG_DATA) only from its own
// maxAllowedPacket divided by the statement's values plus one (9 MiB at its
// default), and smaller ones in one packet.
//
// A writer of PublisherOn has no transaction to read in, nor a statement of
// its own to prepare: it reads on the Outbox's database, waiting at most a
// second for a connection (a pool whose connections the handlers'
// transactions all hold made it wait until the CommitTimeout), or takes the
// value read last when it cannot; and its rows must fit once escaped.
// Without any value read, the rows go unbounded, as before.
func (w *outboxWriter) mysqlPacketLimit(args []any, sizes []int, topic string) (limit, alone int, err error) {
	var packet int64
	if w.tx != nil {
		if err := w.tx.QueryRowxContext(w.ctx, "SELECT @@max_allowed_packet").Scan(&packet); err != nil {
			return 0, 0, fmt.Errorf("inbox: outbox: read max_allowed_packet: %w", err)
		}
	} else {
		ctx, cancel := context.WithTimeout(w.ctx, time.Second)
		err := w.o.cfg.DB.QueryRowxContext(ctx, "SELECT @@max_allowed_packet").Scan(&packet)
		cancel()
		if err != nil {
			if packet = w.o.maxAllowedPacket.Load(); packet == 0 {
				return outboxInsertBytes, math.MaxInt, nil
			}
		}
	}
	w.o.maxAllowedPacket.Store(packet)
	room := int(packet) - packetMargin
	for i := range sizes {
		topicS, _ := args[4*i].(string)
		uuid, _ := args[4*i+1].(string)
		payload, _ := args[4*i+2].([]byte)
		meta, _ := args[4*i+3].([]byte)
		sizes[i] = mysqlEscapedLen([]byte(topicS)) + mysqlEscapedLen([]byte(uuid)) + mysqlEscapedLen(payload) + mysqlEscapedLen(meta) + 16
		if len(payload)+len(meta) > room {
			return 0, 0, fmt.Errorf("%w: message %v to %q: its payload (%d bytes) and stored metadata (%d bytes) are over"+
				" the server's max_allowed_packet (%d bytes) less %d, which bounds a row an INSERT sends: raise it,"+
				" or keep large content elsewhere and send a reference", ErrOutboxMessage, uuid, topic, len(payload), len(meta),
				packet, packetMargin)
		}
		if w.tx == nil && sizes[i] > room {
			return 0, 0, fmt.Errorf("%w: message %v to %q: through Outbox.PublisherOn its row goes in your statement, which"+
				" interpolateParams escapes (%d bytes then), over the server's max_allowed_packet (%d bytes) less %d: write"+
				" it through Outbox.Publisher, which prepares such a row, or keep large content elsewhere", ErrOutboxMessage,
				uuid, topic, sizes[i], packet, packetMargin)
		}
	}
	alone = max(room, 0)
	if w.tx == nil {
		alone = math.MaxInt
	}
	return max(min(outboxInsertBytes, room), 0), alone, nil
}

// packetMargin is what mysqlPacketLimit leaves of max_allowed_packet for
// the rest of a row's statement: its text, its other values (the topic, at
// most 1 KiB, the UUID, the claim's key) and the packets' headers.
const packetMargin = 16 << 10

// preparedClaimedInsert returns query prepared on cfg.DB when prepare, or
// nil until it is: the first call prepares it in a goroutine of its own,
// outside any transaction, so that a writer, which holds its connection,
// never waits for a second one of a full pool. A failed PREPARE is tried
// again a second later.
func (o *Outbox) preparedClaimedInsert(query string, prepare bool) *sqlx.Stmt {
	if !prepare {
		return nil
	}
	v, loaded := o.claimedOne.LoadOrStore(query, (*sqlx.Stmt)(nil))
	if loaded {
		return v.(*sqlx.Stmt)
	}
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		stmt, err := o.cfg.DB.PreparexContext(ctx, query)
		if err != nil {
			if hasMySQLNumber(err, erUnknownSystemVariable) {
				o.noInTxVar.Store(true)
			}
			time.AfterFunc(time.Second, func() { o.claimedOne.Delete(query) })
			return
		}
		o.claimedOne.Store(query, stmt)
	}()
	return nil
}

// insert runs the INSERT of the messages whose values are args.
func (w *outboxWriter) insert(n int, args []any, prepare bool) error {
	if w.claim != nil {
		return w.insertClaimed(n, args, prepare)
	}
	if prepare && w.tx != nil {
		return w.execPrepared(w.target().sql.insert(n), args)
	}
	if n == 1 && w.prepared {
		if stmt := w.o.insertOne.Load(); stmt != nil {
			_, err := w.tx.StmtxContext(w.ctx, stmt).ExecContext(w.ctx, args...)
			return err
		}
	}
	query := w.target().sql.insert(n)
	return w.exec(w.ctx, query, args...)
}

// checksClaim implements txBoundPublisher.
func (w *outboxWriter) checksClaim() bool {
	return w.claim != nil || w.target().sql.claimedInsert == nil
}

// endWrites implements txBoundPublisher.
func (w *outboxWriter) endWrites() {
	w.publishing.Lock()
	w.done = true
	w.publishing.Unlock()
}

// committed tells the relay of this process that rows were committed.
func (w *outboxWriter) committed() {
	if w.wrote.Load() {
		w.o.notify()
	}
}

// publishLast implements txBoundPublisher.
func (w *outboxWriter) publishLast(topic string, msgs []*message.Message) (bool, error) {
	if err := w.Publish(topic, msgs...); err != nil {
		return false, err
	}
	return w.claim != nil && len(msgs) > 0, nil // each claimed INSERT found the claim held
}

// Publish writes msgs to the outbox in the writer's transaction. Calls
// from several goroutines run one at a time.
func (w *outboxWriter) Publish(topic string, msgs ...*message.Message) error {
	w.publishing.Lock()
	defer w.publishing.Unlock()
	if w.done {
		// After the handler returned (an AfterCommit function, a goroutine
		// that outlives the handler): the COMMIT may have been sent, and
		// with pgxinbox the connection given back to the pool, where the
		// INSERT ran in autocommit or in another message's transaction.
		return fmt.Errorf("inbox: outbox: %w: nothing written to %q: the inbox has ended the message's transaction;"+
			" publish before the handler returns", sql.ErrTxDone, topic)
	}
	for i, m := range msgs {
		if m == nil {
			// A nil in a handler's returned slice: the write (or its
			// refusal, which names each message) panicked on it.
			return fmt.Errorf("inbox: outbox: %w: message %d of %d to %q is nil", ErrOutboxMessage, i+1, len(msgs), topic)
		}
	}
	if err := w.writable(topic); err != nil {
		if w.lookUpErr != nil {
			return w.refuse(err, topic, msgs)
		}
		return err
	}
	// Room for the claim's key, which insertClaimed appends.
	all, err := appendOutboxRows(make([]any, 0, 4*len(msgs)+2), topic, msgs)
	if err != nil {
		return err
	}
	limit, alone := outboxInsertBytes, math.MaxInt
	var sizes []int // nil: one INSERT of all, the common case
	if w.o.dialect.server() == serverMySQL && outboxRowsBytes(all) > outboxLargeBytes {
		sizes = outboxRowSizes(all)
		if limit, alone, err = w.mysqlPacketLimit(all, sizes, topic); err != nil {
			return err
		}
	} else if !outboxOneInsert(all, limit) {
		sizes = outboxRowSizes(all)
	}
	var buf []any
	for start, end := 0, len(msgs); start < len(msgs); start = end {
		args, prepare := all, false
		if sizes != nil {
			end = insertChunkEnd(sizes, start, limit)
			// A copy: insertClaimed appends the claim's key to it.
			buf = append(buf[:0], all[4*start:4*end]...)
			args, prepare = buf, end-start == 1 && sizes[start] > alone
		}
		chunk := msgs[start:end]
		if err := w.insert(len(chunk), args, prepare); err != nil {
			// A missing table: PostgreSQL's look-up before the handler
			// found none on the search_path (missing); elsewhere the
			// INSERT's error and a read in its transaction tell it. Nothing
			// about the message is wrong: transient (a poison filter
			// drained the topic for a migration not yet run). refuse keeps
			// a handler that ignored this error (or rolled back to a
			// savepoint) from committing.
			table, where := w.target().table, "does not exist"
			if w.missing {
				table, where = w.o.configured.table, "is not on the search_path"
			}
			if w.missing || w.o.tableMissing(w.ctx, err, w.target(), nil, w.exec) {
				return w.refuse(&misconfiguredError{fmt.Errorf("inbox: outbox: insert %d messages to %q: %w: outbox table %s %s"+
					" (run Outbox.InitializeSchema, or apply Outbox.SchemaSQL with your migrations): %w",
					len(chunk), topic, ErrTableNotFound, table, where, err)}, topic, chunk)
			}
			if err := w.stagedInsertError(topic, len(chunk), err); err != nil {
				return w.refuse(err, topic, chunk)
			}
			return fmt.Errorf("inbox: outbox: insert %d messages to %q: %w", len(chunk), topic, err)
		}
		w.wrote.Store(true)
		w.written(topic, chunk)
	}
	return nil
}

// stageLast implements txBoundPublisher.
func (w *outboxWriter) stageLast(topic string, msgs []*message.Message) (string, []any, bool, error) {
	if !w.inTx || w.claim != nil || w.missing {
		return "", nil, false, nil
	}
	args, err := appendOutboxRows(make([]any, 0, 4*len(msgs)), topic, msgs)
	if err != nil || !outboxOneInsert(args, outboxInsertBytes) {
		return "", nil, false, nil // Publish writes them, or returns the error
	}
	if err := w.writable(topic); err != nil {
		return "", nil, false, err
	}
	w.wrote.Store(true) // for committed: the query runs with the COMMIT
	return w.rebind(w.target().sql.insert(len(msgs))), args, true, nil
}

// stagedInsertError implements txBoundPublisher: an INSERT of n messages
// to topic that met an id the outbox table's rows still hold (its identity
// restarted by hand while messages were pending) is the table's fault, not
// the messages': transient (misconfiguredError), with the setval that
// fixes it, as a missing table is (a poison filter on IsTransient poisoned
// and acked messages that had nothing wrong). Each try takes the next id.
// nil for any other error.
func (w *outboxWriter) stagedInsertError(topic string, n int, err error) error {
	t := w.target().table
	if !isUniqueViolationOn(err, t.name) {
		return nil
	}
	return &misconfiguredError{fmt.Errorf("inbox: outbox: insert %d messages to %q: the id of outbox table %s hands out ids"+
		" that its rows still hold (restarted by hand?); fix: SELECT setval(pg_get_serial_sequence('%s', 'id'),"+
		" (SELECT max(id) FROM %[4]s)): %w", n, topic, t, t.quoted(w.o.dialect), err)}
}

// writable refuses a bad topic, and any write once the server has ended
// the transaction.
func (w *outboxWriter) writable(topic string) error {
	if topic == "" || len(topic) > maxOutboxTopic || !utf8.ValidString(topic) || containsNUL(topic) {
		return fmt.Errorf("%w: topic %q must be 1 to %d bytes of UTF-8 without NUL", ErrOutboxMessage, topic, maxOutboxTopic)
	}
	if w.ended != nil && w.ended() {
		// The statement would run outside any transaction and commit on
		// its own: sent although the message is not processed, and sent
		// again by the redelivery under the handler's new UUIDs.
		if committed, known := w.claimCommitted(); committed || !known {
			return fmt.Errorf("inbox: outbox: %w: nothing written to %q (the handler's COMMIT, or a statement that commits"+
				" implicitly, committed the message's claim and effects before its outputs, or the handler ended the"+
				" transaction in a way the inbox cannot read)", ErrTransactionEnded, topic)
		}
		return fmt.Errorf("inbox: outbox: %w: nothing written to %q (the handler's ROLLBACK, or the database's after an"+
			" error the handler ignored, removed the message's claim)", claimGoneError(w.o.dialect), topic)
	}
	if !w.bound {
		w.lookUpTarget(w.ctx, false) // a writer the inbox did not bind, at its first write
	}
	if w.lookUpErr != nil {
		return fmt.Errorf("%w; nothing written to %q", w.lookUpErr, topic)
	}
	return nil
}

// claimCommitted reports whether the delivery's claim is committed, once a
// write found its transaction ended by the handler (the driver reports no
// transaction; a deadlock leaves it reporting one), and whether it could
// tell: the handler committed it (its COMMIT, or a statement that commits
// implicitly) rather than rolled it back. That is the handler's mistake,
// ErrTransactionEnded, not transient: reported as ErrTxRolledBack, which
// is, the redelivery was skipped as a duplicate and its outputs lost with
// nothing to tell. A read on the writer's connection, in autocommit since
// the transaction ended (database/sql's, or a native backend's look-up).
// It cannot tell when the read fails (a LOCK TABLES still in force, a
// transaction the driver closed: tx.Commit) or the writer has no way to
// read (one the inbox did not bind); the caller then takes the handler's
// end for a commit, since poisoning a message that was rolled back can be
// undone, and a duplicate skipped for good cannot.
func (w *outboxWriter) claimCommitted() (committed, known bool) {
	if w.key == nil {
		return false, false
	}
	query := w.rebind(claimCountSQL(w.key.table))
	var n int64
	var err error
	switch {
	case w.tx != nil:
		err = w.tx.QueryRowxContext(w.ctx, query, w.key.consumer, w.key.id).Scan(&n)
	case w.lookUp != nil:
		err = w.lookUp(w.ctx, query, []any{w.key.consumer, w.key.id}, &n)
	default:
		return false, false
	}
	if err != nil {
		return false, false
	}
	return n > 0, true
}

// appendOutboxRows appends to args the bind parameters of msgs' rows
// (outboxSQL.insertRow's: topic, uuid, payload, metadata).
func appendOutboxRows(args []any, topic string, msgs []*message.Message) ([]any, error) {
	for i, m := range msgs {
		if m == nil {
			// A nil in a handler's returned slice: it panicked here, on
			// every delivery.
			return nil, fmt.Errorf("%w: message %d of %d to %q is nil", ErrOutboxMessage, i+1, len(msgs), topic)
		}
		if err := checkKey(m.UUID, ErrOutboxMessage, nil, nil); err != nil {
			return nil, fmt.Errorf("message UUID %q: %w", m.UUID, err)
		}
		meta, err := encodeOutboxMetadata(m.Metadata, m.Payload == nil)
		if err != nil {
			return nil, fmt.Errorf("inbox: outbox: metadata of message %s: %w", m.UUID, err)
		}
		payload := []byte(m.Payload)
		if payload == nil {
			payload = []byte{} // NOT NULL: the metadata says it was nil
		}
		args = append(args, topic, m.UUID, payload, meta)
	}
	return args, nil
}

// outboxBinaryMetadata and outboxNilPayload are the flags of the outbox's
// array encoding of metadata, the JSON array [<flags>, {<key>: <value>, …}]
// whose first element holds them, separated by spaces: outboxBinaryMetadata
// when a key or value is not valid UTF-8 (a binary Kafka header a handler
// copied onto its output), every key and value then in standard base64;
// outboxNilPayload when the message's payload was nil, not empty (a Kafka
// tombstone, which compaction reads as the key's deletion: the payload
// column is NOT NULL, and the relay sent a record of 0 bytes instead, so
// the key was never deleted). Any other metadata is stored as a JSON object
// of its strings, which no array can be mistaken for. encoding/json would
// put U+FFFD in place of bytes that are not UTF-8, and the message would
// reach the broker changed; refusing them failed the handler on every
// redelivery.
const (
	outboxBinaryMetadata = "base64"
	outboxNilPayload     = "nil-payload"
)

// encodeOutboxMetadata returns md as the outbox stores it, for a message
// whose payload is nil when nilPayload: a JSON object, or the array
// encoding (outboxBinaryMetadata) with its flags.
func encodeOutboxMetadata(md message.Metadata, nilPayload bool) ([]byte, error) {
	binary := false
	for k, v := range md {
		if !utf8.ValidString(k) || !utf8.ValidString(v) {
			binary = true
			break
		}
	}
	if !binary && !nilPayload {
		return json.Marshal(md)
	}
	var flags []string
	encoded := make(map[string]string, len(md))
	for k, v := range md {
		encoded[k] = v
	}
	if binary {
		flags = append(flags, outboxBinaryMetadata)
		clear(encoded)
		for k, v := range md {
			encoded[base64.StdEncoding.EncodeToString([]byte(k))] = base64.StdEncoding.EncodeToString([]byte(v))
		}
	}
	if nilPayload {
		flags = append(flags, outboxNilPayload)
	}
	return json.Marshal([]any{strings.Join(flags, " "), encoded})
}

// decodeOutboxMetadata reads metadata that encodeOutboxMetadata stored,
// and whether the message's payload was nil.
func decodeOutboxMetadata(b []byte) (md message.Metadata, nilPayload bool, err error) {
	md = message.Metadata{}
	if trimmed := bytes.TrimLeft(b, " \t\r\n"); len(trimmed) == 0 || trimmed[0] != '[' {
		if err := json.Unmarshal(b, &md); err != nil {
			return nil, false, err
		}
		if md == nil { // a stored JSON null
			md = message.Metadata{}
		}
		return md, false, nil
	}
	var parts []json.RawMessage
	var mark string
	var encoded map[string]string
	if err := json.Unmarshal(b, &parts); err != nil {
		return nil, false, err
	}
	if len(parts) != 2 || json.Unmarshal(parts[0], &mark) != nil {
		return nil, false, errors.New(`metadata array is not [<flags>, {…}]`)
	}
	binary := false
	for _, flag := range strings.Fields(mark) {
		switch flag {
		case outboxBinaryMetadata:
			binary = true
		case outboxNilPayload:
			nilPayload = true
		default:
			return nil, false, fmt.Errorf("metadata array's flag %q is not one of %q, %q (written by a later version?)",
				flag, outboxBinaryMetadata, outboxNilPayload)
		}
	}
	if err := json.Unmarshal(parts[1], &encoded); err != nil {
		return nil, false, err
	}
	for k, v := range encoded {
		if !binary {
			md[k] = v
			continue
		}
		key, err := base64.StdEncoding.DecodeString(k)
		if err != nil {
			return nil, false, fmt.Errorf("metadata key %q: %w", k, err)
		}
		value, err := base64.StdEncoding.DecodeString(v)
		if err != nil {
			return nil, false, fmt.Errorf("metadata value of %q: %w", key, err)
		}
		md[string(key)] = string(value)
	}
	return md, nilPayload, nil
}

// Close does nothing: the writer holds nothing of its own.
func (w *outboxWriter) Close() error { return nil }

// notify wakes the relay of this process, if it waits. The first commit
// while no relay has started in this process schedules warnIfNoRelay.
func (o *Outbox) notify() {
	select {
	case o.wake <- struct{}{}:
	default:
	}
	if !o.relayStarted.Load() {
		o.noRelayCheck.Do(func() { time.AfterFunc(noRelayGrace*o.cfg.PollInterval, o.warnIfNoRelay) })
	}
}

// noRelayGrace is how many PollIntervals after the first commit
// warnIfNoRelay waits for a relay to start (the router starts its plugins
// and its handlers at the same time).
const noRelayGrace = 5

// warnIfNoRelay logs, once, that messages were committed to the outbox
// while no relay ran in this process: without one (RouterPlugin, Run)
// they stay in the table and nothing says so, unless another process
// relays it.
func (o *Outbox) warnIfNoRelay() {
	if o.relayStarted.Load() {
		return
	}
	logger := o.logger.get()
	if il := o.inboxLogger.Load(); il != nil && o.logger.nop() {
		logger = il.get().With(o.logger.fields)
	}
	logger.Info("Inbox outbox: messages were committed to the outbox and no relay runs in this process, so they "+
		"stay in the table until one does: add router.AddPlugin(ob.RouterPlugin) or run ob.Run (ignore this when "+
		"another process relays this table)", nil) // the logger names the table (outbox_table)
}

// Stats reads the outbox's depth, the age of its oldest message and the
// number of dead letters, in three statements: the age and the first
// message's last error through the primary key, then the dead letters and
// the depth, counts of every row, which a large table makes slow (MariaDB:
// about 1.3 s a million rows). The oldest message is the oldest of the
// first 100 by id: a message's id and created_at are both taken as it is
// written (a row written by hand with an older created_at behind them is
// not seen). When a count fails (ctx ends first), Stats returns what it
// read before, with -1 for the counts it could not make, and the error: the
// age of a backlog stays known while its depth cannot be counted in time. A
// dialect for another database server than the DB's gives an error wrapping
// ErrDialectMismatch; other errors wrap the driver's. Safe for concurrent
// use.
func (o *Outbox) Stats(ctx context.Context) (OutboxStats, error) {
	if err := o.checkReadServer(ctx); err != nil {
		return OutboxStats{}, err
	}
	var (
		s         OutboxStats
		oldestU   sql.NullInt64
		lastError sql.NullString
	)
	t, err := o.pinTarget(ctx)
	if err != nil {
		return s, err
	}
	if err := o.cfg.DB.QueryRowxContext(ctx, t.sql.stats).Scan(&oldestU, &lastError); err != nil {
		return s, fmt.Errorf("inbox: outbox stats of %s: %w", t.table, poolerHint(err))
	}
	s.OldestAge = time.Duration(max(oldestU.Int64, 0)) * time.Microsecond
	s.FirstLastError = lastError.String
	s.DeadLettered, s.Pending = -1, -1
	if err := o.cfg.DB.QueryRowxContext(ctx, t.sql.dead).Scan(&s.DeadLettered); err != nil {
		return s, fmt.Errorf("inbox: outbox stats of %s: count the dead letters: %w", t.table, poolerHint(err))
	}
	if err := o.cfg.DB.QueryRowxContext(ctx, t.sql.pending).Scan(&s.Pending); err != nil {
		return s, fmt.Errorf("inbox: outbox stats of %s: count the pending messages: %w", t.table, poolerHint(err))
	}
	return s, nil
}
