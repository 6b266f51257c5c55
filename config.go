package inbox

import (
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
	"go.opentelemetry.io/otel/trace"
)

// Config configures an Inbox. Pass it by value to New; the zero value of
// every optional field selects its documented default.
type Config struct {
	// DB is the database that holds the inbox table and the handler's
	// business tables, so that both commit in one transaction. Wrap a
	// *sql.DB with sqlx.NewDb(db, driver), and a pgx pool with
	// sqlx.NewDb(stdlib.OpenDBFromPool(pool), "pgx"). Each message in flight
	// holds one of its pooled connections for its transaction. Behind a
	// transaction-mode pooler (PgBouncer), use lib/pq as it is or pgx with
	// default_query_exec_mode=exec or simple_protocol: pgx's default
	// statement cache cannot work there (pgx's documented limit).
	// Default: none; required (ErrInvalidConfig without it).
	DB *sqlx.DB

	// Dialect is the SQL dialect of DB: PostgreSQL, PostgreSQLPartitioned,
	// MySQL (also MariaDB) or SQLite. PostgreSQLPartitioned is never
	// inferred: set it for a table range-partitioned on processed_at (by
	// week for a new table, DefaultPartitionInterval, or by day; see
	// PartitionInterval). With a nil Dialect,
	// a driver name other than the ones below is ErrUnknownDialect.
	// Default: inferred from DB.DriverName(): "postgres", "pgx", "pgx/v4",
	// "pgx/v5" give PostgreSQL, "mysql" gives MySQL, "sqlite" and "sqlite3"
	// give SQLite.
	Dialect Dialect

	// Table is the inbox table, optionally qualified by a schema (PostgreSQL)
	// or database (MySQL, SQLite attached database): "billing.inbox".
	// Several consumers may share one table. It must match
	// ^[A-Za-z_][A-Za-z0-9_]{0,62}(\.[A-Za-z_][A-Za-z0-9_]{0,62})?$ and is
	// quoted by the inbox (never pass it quoted); anything else is
	// ErrInvalidTableName.
	// Default: "watermill_inbox" (DefaultTable).
	Table string

	// Consumer is the name under which this inbox records processed
	// messages: the same message id is processed once per consumer. Set it
	// when a handler is renamed, or to make two handlers share one key
	// space. It must be stable across restarts and hosts: never derive it
	// from a host name or process id. At most MaxKeyLength bytes of valid
	// UTF-8 without NUL (ErrInvalidConsumer from New otherwise).
	// Default: the Watermill handler name (message.HandlerNameFromCtx), read
	// for each message, so every handler of a router is its own consumer; a
	// message without one fails with ErrEmptyConsumer.
	Consumer string

	// MessageID returns the id under which a message is deduplicated. Use a
	// business key (an event id in the payload or metadata; see
	// MessageIDFromMetadata) when producers may re-send the same event with
	// a new UUID, or when they are not Watermill publishers. The id must be
	// 1 to MaxKeyLength bytes of valid UTF-8 without NUL bytes; otherwise the
	// handler is not called and the error wraps ErrInvalidMessageID. An error
	// returned by MessageID is returned (wrapped) to the router, which nacks.
	// It is called from every handler goroutine at once: it must be safe for
	// concurrent use.
	// Default: msg.UUID, which Watermill publishers carry across the broker
	// (in the "_watermill_message_uuid" header).
	MessageID func(msg *message.Message) (string, error)

	// TxOptions are the options of the transaction that holds the claim and
	// the handler's writes, chiefly its isolation level. The claim is
	// correct at every level; at REPEATABLE READ or SERIALIZABLE on
	// PostgreSQL a concurrent duplicate fails with a serialization error
	// (SQLSTATE 40001) instead of being skipped: the message is nacked and
	// its redelivery is skipped (IsTransient reports such errors). ReadOnly
	// must be false; on PostgreSQL and MySQL/MariaDB the isolation must be
	// the default or one of the four SQL standard levels (their drivers
	// refuse sql.LevelSnapshot, LevelWriteCommitted or LevelLinearizable at
	// every BEGIN, lib/pq and go-sql-driver Snapshot included; SQLite
	// ignores the level); and with PostgreSQLPartitioned it must be READ
	// COMMITTED (or the default): New refuses anything else with
	// ErrInvalidConfig. New keeps a copy: changing *TxOptions afterwards
	// changes nothing.
	// Default: nil, the database's default isolation level (READ COMMITTED
	// on PostgreSQL, REPEATABLE READ on MySQL/MariaDB InnoDB, SERIALIZABLE
	// on SQLite).
	TxOptions *sql.TxOptions

	// Logger receives a Debug line for each duplicate skipped, with the
	// fields message_uuid, handler_name, consumer and message_id; at Info,
	// each id reused for other content under ReusedIDsWarn, and once the
	// ALTER TABLE that adds a missing fingerprint column (so set one: with
	// the default both go nowhere, and only OnReusedID reports a reuse). Nothing is
	// logged per processed message (the router logs its ack at Trace), and
	// errors are returned to the router, which logs them, not logged here.
	// It must be safe for concurrent use.
	// Default: the router's logger from RouterPlugin on (so that a panic in
	// a hook or an AfterCommit function is logged somewhere), otherwise
	// watermill.NopLogger{}.
	Logger watermill.LoggerAdapter

	// OnProcessed, OnDuplicate and OnFailed report each message's outcome,
	// for metrics. OnProcessed is called after a message's transaction
	// committed (and its AfterCommit functions ran). OnDuplicate is called
	// after a duplicate was detected and its transaction rolled back (the
	// handler was not called). OnFailed is called for every message about to
	// be nacked: the middleware returns an error (a refused id, the
	// handler's error, a failed commit) or the handler panicked; Event.Err
	// holds the error. They run synchronously on the handler's goroutine,
	// possibly concurrently with each other, so they must be fast and safe
	// for concurrent use: count, observe Event.Duration in a histogram, do
	// not block. A panic in one is logged (Logger, Error) and changes no
	// outcome: the message is acked or nacked as it would have been, and the
	// delivery's other hooks still run.
	// Default: nil, not called.
	OnProcessed func(Event)
	OnDuplicate func(Event)
	OnFailed    func(Event)

	// OnReusedID reports a delivery whose message id was already processed
	// with other content (see ReusedIDs), after its transaction rolled back:
	// with ReusedIDsRefuse before OnFailed (Event.Err wraps
	// ErrMessageIDReused), with ReusedIDsWarn before OnDuplicate. It runs as
	// the other hooks do: synchronously, and concurrently with them.
	// Default: nil, not called.
	OnReusedID func(Event)

	// ReusedIDs says what a delivery whose message id was already processed
	// with other content does: a producer that reuses an id (a fixed UUID in
	// a retry loop, a counter that restarted, an id copied from the consumed
	// message) would otherwise have a real event skipped as a duplicate.
	// The claim stores a fingerprint of the content (Config.Fingerprint) in
	// the table's fingerprint column, with no statement of its own; a
	// duplicate reads the stored one (one more statement, on the duplicate
	// path only) and compares; a duplicate of one of the 4,096 keys this
	// Inbox committed last matches from memory, without the read (content
	// that differs from memory, or a key not held, still reads). A row
	// written without a fingerprint (before
	// the column existed) matches every content. A table without the column
	// (made before this version, or by hand) keeps working with the check
	// off: the first check of the table (Verify, InitializeSchema or the
	// first claim) logs, at Info, the ALTER TABLE that adds it; the inbox
	// uses the column from its next start. Semantics 15 of the design
	// contract.
	// Default: ReusedIDsRefuse.
	ReusedIDs ReusedIDCheck

	// Fingerprint returns the part of a message that identifies its event,
	// for ReusedIDs: leave out what a producer changes when it sends the
	// same event again (a timestamp or trace id in the payload). The inbox
	// stores the first 16 bytes of its SHA-256. It is called before the
	// transaction begins and, for a delivery that fails, once more after its
	// rollback (to tell whether the handler changed what it is taken of,
	// below), from every handler goroutine at once: it must be safe for
	// concurrent use, cheap enough to run twice, and must not modify msg. A
	// panic in it fails the delivery (nacked, OnFailed's Event.Err naming
	// Config.Fingerprint) before anything is written.
	// A handler that changed what it is taken of (decoded msg.Payload in
	// place) and failed does not change what is stored: a later delivery
	// of the key whose content is the changed one (a Retry's next attempt,
	// watermill-kafka's resent copy) claims with the fingerprint the failed
	// one claimed with.
	// Changing Fingerprint on a live table changes what every earlier row
	// is compared with: deploy it with ReusedIDsWarn for the broker's
	// redelivery window (docs/reused-ids.md).
	// Default: msg.Payload (metadata is not compared: brokers and
	// middlewares add to it).
	Fingerprint func(msg *message.Message) []byte

	// TracerProvider makes the middleware start one span per message,
	// "inbox" (OpenTelemetry API; attributes inbox.consumer,
	// inbox.message_id, messaging.message.id, db.system), as a child of the
	// span in msg.Context() (Watermill's OpenTelemetry middleware puts one
	// there), with the events inbox.claimed, inbox.duplicate,
	// inbox.committed and inbox.begin_retried (MySQL: a BEGIN retried after
	// its connection was lost, with the first error), and the error status
	// on failure or panic. The statements and the handler run under it, so
	// spans of an instrumented database/sql driver and of the handler nest
	// inside. Pass otel.GetTracerProvider() to use the global one.
	// Default: nil, no spans and no cost.
	TracerProvider trace.TracerProvider

	// Outbox returns a publisher that writes to an outbox in the given
	// transaction, so that messages are sent if and only if the message's
	// transaction commits: typically a watermill-sql Publisher on tx, wrapped
	// by Watermill's forwarder.NewPublisher, or any publisher of yours that
	// writes through tx. With watermill-sql v4:
	// wsql.NewPublisher(wsql.TxFromStdSQL(tx.Tx), wsql.PublisherConfig{…}, logger)
	// (its queue schemas with DeleteOnAck keep the outbox table bounded);
	// with v3: wsql.NewPublisher(tx, …). On MySQL/MariaDB with the default
	// schema wrap it with package mysqloutbox; on SQLite use the adapters of
	// package sqliteoutboxv4 (v3: sqliteoutbox). docs/outbox.md has each
	// setup in full. The inbox calls it once per claimed message, right
	// after the claim (so it must be cheap: watermill-sql's NewPublisher is).
	// Then:
	//   - the messages the handler returns are published through it, to the
	//     handler's publish topic (message.PublishTopicFromCtx), before the
	//     commit, and none are returned to the router: they are sent if and
	//     only if the message's transaction commits, so a failed publish can
	//     no longer lose them (without Outbox, the router publishes them after
	//     the commit, and if that fails the redelivery is skipped as a
	//     duplicate);
	//   - handlers can publish to any topic through OutboxFromContext.
	// An error from Outbox or from publishing rolls the transaction back and
	// is returned (nack); so is an error when the handler returns messages
	// but has no publish topic. It is called from every handler goroutine
	// at once: it must be safe for concurrent use.
	// Default: nil, returned messages go to the router.
	Outbox func(tx *sqlx.Tx) (message.Publisher, error)

	// OutboxTables names the tables the Outbox publisher writes (with
	// package pgxinbox, its Config.Outbox's), so that Verify, RouterPlugin,
	// "inbox schema -verify" and the middleware's check before its first
	// claim refuse a missing one with ErrTableNotFound, instead of every
	// message failing at its outbox publish. watermill-sql names a topic's
	// table "watermill_" + topic: with Watermill's forwarder and
	// ForwarderTopic "outbox", []string{"watermill_outbox"}; the v3 offsets
	// schemas also write "watermill_offsets_" + topic, which only the
	// relay's subscriber needs. Each name follows the rules of Table
	// (ErrInvalidTableName otherwise). The inbox cannot read these names
	// from the Outbox function itself.
	// Default: nil, no outbox table is checked.
	OutboxTables []string

	// CommitTimeout bounds what runs after the handler returned nil: the
	// outbox publish, the pre-commit check (MySQL/MariaDB) and COMMIT. From
	// the moment the handler returns nil, the message's context no longer
	// governs the transaction: a deadline (middleware.Timeout) or a
	// cancellation (router shutdown) that fires then does not abort the
	// COMMIT, so a message whose transaction committed is acked. When the
	// bound passes first, the message is nacked with an error wrapping
	// ErrCommitTimeout (transient; the COMMIT is in doubt, and the redelivery
	// is skipped if it took effect). pgx and lib/pq honour the bound during
	// COMMIT itself (both watch the context the transaction began with;
	// lib/pq cancels the COMMIT, SQLSTATE 57014); go-sql-driver/mysql does
	// not take a context at COMMIT, which then ends by the driver's own
	// network timeouts (MySQL's readTimeout DSN parameter). Must not be
	// negative.
	// Default: 10 s (DefaultCommitTimeout).
	CommitTimeout time.Duration

	// PrepareStatements makes the inbox prepare its claim on PostgreSQL once
	// per pooled connection (a named server-side prepared statement) and
	// reuse it, which saves lib/pq one round trip per message (pgx's
	// database/sql adapter caches statements by itself unless told not to).
	// Leave it false behind a transaction-mode connection pooler such as
	// PgBouncer before 1.21 (or without max_prepared_statements): a named
	// statement outlives the transaction, the pooler hands the next
	// transaction another server connection, and the statement is missing
	// there or, worse, another client's statement of the same name runs.
	// On MySQL/MariaDB and SQLite the claim is always prepared (database/sql
	// keeps the statement per connection; MySQL sends an unprepared
	// statement with arguments as prepare, execute, close). With
	// PostgreSQLPartitioned and the table's claim function, the call of
	// that function is not prepared.
	// Default: false.
	PrepareStatements bool
}

// ReusedIDCheck is what the inbox does with a delivery whose message id was
// already processed with other content (Config.ReusedIDs).
type ReusedIDCheck int

const (
	// ReusedIDsRefuse fails the delivery with an error wrapping
	// ErrMessageIDReused and calls OnReusedID and OnFailed: the message is
	// nacked, not acked as a duplicate.
	ReusedIDsRefuse ReusedIDCheck = iota
	// ReusedIDsWarn logs the reuse at Info ("Inbox: message id reused for
	// other content; skipped as a duplicate"), calls OnReusedID and then
	// skips the delivery as a duplicate (acked, OnDuplicate).
	ReusedIDsWarn
	// ReusedIDsOff stores no fingerprint and compares none: every delivery
	// of a processed id is a duplicate, as in versions before the check.
	ReusedIDsOff
)

// String returns "refuse", "warn" or "off".
func (c ReusedIDCheck) String() string {
	switch c {
	case ReusedIDsRefuse:
		return "refuse"
	case ReusedIDsWarn:
		return "warn"
	case ReusedIDsOff:
		return "off"
	}
	return "ReusedIDCheck(" + strconv.Itoa(int(c)) + ")"
}

// DefaultCommitTimeout is Config.CommitTimeout when it is zero.
const DefaultCommitTimeout = 10 * time.Second

// Event describes one message's outcome, for the Config hooks.
type Event struct {
	// Message is the message handled. Do not modify it.
	Message *message.Message
	// Consumer and MessageID are the inbox key of the message.
	Consumer  string
	MessageID string
	// Duration is the time from the start of BEGIN (the wait for a
	// connection of the pool included) to the end of the transaction's
	// COMMIT or ROLLBACK, handler included; 0 when the message was refused
	// before BEGIN (an invalid message id, a missing or incompatible
	// table), whose wait before the redelivery it does not count either.
	Duration time.Duration
	// Err is the error returned to the router: set for OnFailed, and for
	// OnReusedID under ReusedIDsRefuse (it wraps ErrMessageIDReused); nil
	// otherwise.
	Err error
	// ReusedIDsDetected reports whether the inbox detected reused message
	// ids when it handled the message (Inbox.ReusedIDsDetected): false
	// under ReusedIDsOff, and on a table without the fingerprint column,
	// where a reused id is skipped as a duplicate with nothing to tell.
	// Known once the table was checked: it means something only when
	// Duration is above 0 (a message refused before BEGIN has it false).
	ReusedIDsDetected bool
}

func (c *Config) setDefaults() {
	if c.Dialect == nil && c.DB != nil {
		// An unknown driver name is reported by Validate.
		c.Dialect, _ = dialectForDriver(c.DB.DriverName())
	}
	if c.Table == "" {
		c.Table = DefaultTable
	}
	if c.MessageID == nil {
		c.MessageID = messageUUID
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
	if c.CommitTimeout == 0 {
		c.CommitTimeout = DefaultCommitTimeout
	}
}

func messageUUID(msg *message.Message) (string, error) { return msg.UUID, nil }

// Validate reports every problem of the configuration at once, joined with
// errors.Join; nil means valid. Each problem wraps its own sentinel where it
// has one (ErrInvalidTableName, ErrUnknownDialect, ErrInvalidConsumer); the
// joined error does not wrap ErrInvalidConfig, which New adds. It is called by New after defaults are set,
// so a zero optional field is not a problem there; called directly, it
// checks the fields as they are, except that an empty Table, a nil Dialect
// that can be inferred, a nil MessageID and a nil Logger are accepted as
// "use the default".
func (c Config) Validate() error {
	errs := validateTarget("Config", c.DB, c.Dialect, c.Table)
	if c.Consumer != "" {
		if err := checkKey(c.Consumer, ErrInvalidConsumer, nil, nil); err != nil {
			errs = append(errs, &wrapped{msg: "inbox: Config.Consumer", err: err})
		}
	}
	for _, name := range c.OutboxTables {
		if _, err := parseTableName(name); err != nil {
			errs = append(errs, fmt.Errorf("Config.OutboxTables: %w", err))
		}
	}
	if c.CommitTimeout < 0 {
		errs = append(errs, fmt.Errorf("inbox: Config.CommitTimeout must not be negative, got %v", c.CommitTimeout))
	}
	if c.ReusedIDs < ReusedIDsRefuse || c.ReusedIDs > ReusedIDsOff {
		errs = append(errs, fmt.Errorf("inbox: Config.ReusedIDs must be ReusedIDsRefuse, ReusedIDsWarn or ReusedIDsOff, got %v", c.ReusedIDs))
	}
	if c.TxOptions != nil && c.TxOptions.ReadOnly {
		errs = append(errs, errors.New("inbox: Config.TxOptions.ReadOnly must be false: the claim writes"))
	}
	if c.TxOptions != nil {
		d := c.Dialect
		if d == nil && c.DB != nil {
			d, _ = dialectForDriver(c.DB.DriverName()) // an unknown driver is reported above
		}
		if d != nil {
			if err := d.checkIsolation(c.TxOptions.Isolation); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// checkKey validates a consumer name or message id: 1 to MaxKeyLength bytes
// of valid UTF-8 without NUL (PostgreSQL text cannot hold NUL). The error
// wraps kind, plus empty or tooLong when those apply and are non-nil.
func checkKey(s string, kind, empty, tooLong error) error {
	switch {
	case s == "":
		if empty != nil {
			return &wrapped{msg: kind.Error(), also: kind, err: empty}
		}
		return fmt.Errorf("%w: empty", kind)
	case len(s) > MaxKeyLength:
		if tooLong != nil {
			return &wrapped{msg: kind.Error(), also: kind, err: fmt.Errorf("%w: %d bytes, at most %d", tooLong, len(s), MaxKeyLength)}
		}
		return fmt.Errorf("%w: %d bytes, at most %d", kind, len(s), MaxKeyLength)
	case !utf8.ValidString(s):
		return fmt.Errorf("%w: %q is not valid UTF-8", kind, s)
	case containsNUL(s):
		return fmt.Errorf("%w: %q contains a NUL byte", kind, s)
	}
	return nil
}

func containsNUL(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] == 0 {
			return true
		}
	}
	return false
}

// validateTarget checks the database, dialect and table fields that Config
// and PurgeConfig share; what names the struct in messages.
func validateTarget(what string, db *sqlx.DB, d Dialect, table string) []error {
	var errs []error
	if db == nil {
		errs = append(errs, fmt.Errorf("inbox: %s.DB is required", what))
	} else if d == nil {
		if _, err := dialectForDriver(db.DriverName()); err != nil {
			errs = append(errs, err)
		}
	}
	if table != "" {
		if _, err := parseTableName(table); err != nil {
			errs = append(errs, err)
		}
	}
	return errs
}

// resolveTarget returns d, or the dialect inferred from db when d is nil,
// and the parsed table name (DefaultTable when table is empty).
func resolveTarget(db *sqlx.DB, d Dialect, table string) (Dialect, qualifiedName, error) {
	if d == nil {
		var err error
		if d, err = dialectForDriver(db.DriverName()); err != nil {
			return nil, qualifiedName{}, err
		}
	}
	if table == "" {
		table = DefaultTable
	}
	t, err := parseTableName(table)
	return d, t, err
}
