package inbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"hash/fnv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
)

// Config configures an Inbox. Pass it by value to New; the zero value of
// every optional field selects its documented default.
type Config struct {
	// DB is the database that holds the inbox table and the handler's
	// business tables. Required. Wrap a *sql.DB with sqlx.NewDb(db, driver),
	// and a pgx pool with sqlx.NewDb(stdlib.OpenDBFromPool(pool), "pgx").
	// Behind a transaction-mode pooler (PgBouncer), use lib/pq as it is or
	// pgx with default_query_exec_mode=exec or simple_protocol: pgx's
	// default statement cache cannot work there (pgx's documented limit).
	DB *sqlx.DB

	// Dialect is the SQL dialect of DB. Default: inferred from
	// DB.DriverName(): "postgres", "pgx", "pgx/v4", "pgx/v5" give PostgreSQL, "mysql"
	// gives MySQL, "sqlite" and "sqlite3" give SQLite. Any other driver name
	// needs an explicit Dialect (ErrUnknownDialect).
	Dialect Dialect

	// Table is the inbox table, optionally qualified by a schema (PostgreSQL)
	// or database (MySQL, SQLite attached database): "billing.inbox".
	// Default: "watermill_inbox" (DefaultTable). It must match
	// ^[A-Za-z_][A-Za-z0-9_]{0,62}(\.[A-Za-z_][A-Za-z0-9_]{0,62})?$ and is
	// quoted by the inbox; anything else is ErrInvalidTableName. Several
	// consumers may share one table.
	Table string

	// Consumer is the name under which this inbox records processed
	// messages: the same message id is processed once per consumer. Default:
	// the Watermill handler name (message.HandlerNameFromCtx), read for each
	// message, so every handler of a router is its own consumer. Set it when
	// a handler is renamed, or to make two handlers share one key space. It
	// must be stable across restarts and hosts: never derive it from a host
	// name or process id. At most MaxKeyLength bytes of valid UTF-8.
	Consumer string

	// MessageID returns the id under which a message is deduplicated.
	// Default: msg.UUID, which Watermill publishers carry across the broker
	// (the Kafka marshaler puts it in the "_watermill_message_uuid" header).
	// Use a business key (an event id in the payload or metadata) when
	// producers may re-send the same event with a new UUID. The id must be
	// 1 to MaxKeyLength bytes of valid UTF-8 without NUL bytes; otherwise the
	// handler is not called and the error wraps ErrInvalidMessageID. An error
	// returned by MessageID is returned (wrapped) to the router, which nacks.
	// It is called from every handler goroutine at once: it must be safe for
	// concurrent use.
	MessageID func(msg *message.Message) (string, error)

	// TxOptions are the options of the transaction that holds the claim and
	// the handler's writes. Default: nil, the database's default isolation
	// level (READ COMMITTED on PostgreSQL, REPEATABLE READ on MySQL/MariaDB
	// InnoDB, SERIALIZABLE on SQLite). The claim is correct at every level;
	// at REPEATABLE READ or SERIALIZABLE on PostgreSQL a concurrent duplicate
	// fails with a serialization error (SQLSTATE 40001) instead of being
	// skipped: the message is nacked and its redelivery is skipped (IsTransient
	// reports such errors). ReadOnly must be false; on PostgreSQL and
	// MySQL/MariaDB the isolation must be the default or one of the four SQL
	// standard levels (their drivers refuse sql.LevelSnapshot,
	// LevelWriteCommitted or LevelLinearizable at every BEGIN, lib/pq and
	// go-sql-driver Snapshot included; SQLite ignores the level); and with
	// PostgreSQLPartitioned it must be READ COMMITTED (or the default): New
	// refuses anything else with ErrInvalidConfig. New keeps a copy: changing
	// *TxOptions afterwards changes nothing.
	TxOptions *sql.TxOptions

	// Logger receives a Debug line for each duplicate skipped, with the
	// fields message_uuid, handler_name, consumer and message_id. Nothing is
	// logged per processed message (the router logs its ack at Trace), and
	// errors are returned to the router, which logs them, not logged here.
	// Default: watermill.NopLogger.
	Logger watermill.LoggerAdapter

	// OnProcessed, if set, is called after a message's transaction
	// committed. OnDuplicate, if set, is called after a duplicate was
	// detected and its transaction rolled back (the handler was not called).
	// OnFailed, if set, is called after the handler or the commit failed and
	// the message is about to be nacked; Event.Err holds the error. They run
	// synchronously on the handler's goroutine, possibly concurrently with
	// each other, so they must be fast and safe for concurrent use: count,
	// observe Event.Duration in a histogram, do not block.
	OnProcessed func(Event)
	OnDuplicate func(Event)
	OnFailed    func(Event)

	// TracerProvider, if set, makes the middleware start one span per
	// message, "inbox" (OpenTelemetry API; attributes inbox.consumer,
	// inbox.message_id, messaging.message.id, db.system), as a child of the
	// span in msg.Context() (Watermill's OpenTelemetry middleware puts one
	// there), with the events inbox.claimed, inbox.duplicate,
	// inbox.committed and inbox.begin_retried (MySQL: a BEGIN retried after
	// its connection was lost, with the first error), and the error status
	// on failure or panic. The
	// statements and the handler run under it, so spans of an instrumented
	// database/sql driver and of the handler nest inside. Pass
	// otel.GetTracerProvider() to use the global one. Default: nil, no spans
	// and no cost.
	TracerProvider trace.TracerProvider

	// Outbox, if set, returns a publisher that writes to an outbox in the
	// given transaction: typically a watermill-sql Publisher on tx, wrapped
	// by Watermill's forwarder.NewPublisher, or any publisher of yours that
	// writes through tx. The inbox calls it once per claimed message, right
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
	// is returned (nack). It is called from every handler goroutine at once:
	// it must be safe for concurrent use. Default: nil, returned messages go
	// to the router.
	Outbox func(tx *sqlx.Tx) (message.Publisher, error)

	// CommitTimeout bounds what runs after the handler returned nil: the
	// outbox publish, the pre-commit check (MySQL/MariaDB) and COMMIT. From
	// the moment the handler returns nil, the message's context no longer
	// governs the transaction: a deadline (middleware.Timeout) or a
	// cancellation (router shutdown) that fires then does not abort the
	// COMMIT, so a message whose transaction committed is acked. When the
	// bound passes first, the message is nacked with an error wrapping
	// ErrCommitTimeout (transient; the COMMIT is in doubt, and the redelivery
	// is skipped if it took effect). pgx honours the bound during COMMIT
	// itself; lib/pq and go-sql-driver/mysql do not take a context at
	// COMMIT, which then ends by the driver's own network timeouts (MySQL's
	// readTimeout DSN parameter). Must not be negative.
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
	// statement with arguments as prepare, execute, close).
	// Default: false.
	PrepareStatements bool
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
	// Duration is the time from the start of BEGIN to the end of the
	// transaction's COMMIT or ROLLBACK, handler included.
	Duration time.Duration
	// Err is the error returned to the router, for OnFailed only.
	Err error
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
			errs = append(errs, fmt.Errorf("Config.Consumer: %w", err))
		}
	}
	if c.CommitTimeout < 0 {
		errs = append(errs, fmt.Errorf("inbox: Config.CommitTimeout must not be negative, got %v", c.CommitTimeout))
	}
	if c.TxOptions != nil && c.TxOptions.ReadOnly {
		errs = append(errs, errors.New("inbox: Config.TxOptions.ReadOnly must be false: the claim writes"))
	}
	if c.TxOptions != nil {
		d := c.Dialect
		if d == nil && c.DB != nil {
			d, _ = dialectForDriver(c.DB.DriverName()) // an unknown driver is reported above
		}
		if d != nil && !isolationSupported(d, c.TxOptions.Isolation) {
			errs = append(errs, fmt.Errorf("inbox: Config.TxOptions.Isolation %v: not run on %v (a driver refuses it at every BEGIN)", c.TxOptions.Isolation, d))
		}
	}
	if c.Dialect == PostgreSQLPartitioned && c.TxOptions != nil &&
		c.TxOptions.Isolation != sql.LevelDefault && c.TxOptions.Isolation != sql.LevelReadCommitted {
		errs = append(errs, fmt.Errorf("inbox: PostgreSQLPartitioned needs READ COMMITTED, got Config.TxOptions.Isolation %v", c.TxOptions.Isolation))
	}
	return errors.Join(errs...)
}

// isolationSupported reports whether isolation level l runs on dialect d:
// the four SQL standard levels and the default on PostgreSQL and
// MySQL/MariaDB, whose drivers (pgx, lib/pq, go-sql-driver/mysql) refuse
// every other level at BEGIN with an error that carries no server code
// (pgx runs sql.LevelSnapshot as REPEATABLE READ, but lib/pq refuses it:
// ask for LevelRepeatableRead, which on PostgreSQL is snapshot isolation).
// SQLite drivers ignore the level (SQLite transactions are always
// SERIALIZABLE), so any is accepted there.
func isolationSupported(d Dialect, l sql.IsolationLevel) bool {
	switch l {
	case sql.LevelDefault, sql.LevelReadUncommitted, sql.LevelReadCommitted, sql.LevelRepeatableRead, sql.LevelSerializable:
		return true
	}
	return d == SQLite
}

// Inbox is the transactional inbox: its Middleware makes a Watermill handler
// an idempotent consumer. Create it with New. It is safe for concurrent use
// by any number of handlers, routers and goroutines.
type Inbox struct {
	db          *sqlx.DB
	dialect     Dialect
	table       qualifiedName
	consumer    string
	messageID   func(*message.Message) (string, error)
	txOptions   *sql.TxOptions
	logger      watermill.LoggerAdapter
	onProcessed func(Event)
	onDuplicate func(Event)
	onFailed    func(Event)
	outbox      func(*sqlx.Tx) (message.Publisher, error)
	tracer      trace.Tracer // nil without Config.TracerProvider

	commitTimeout time.Duration
	prepare       bool // prepare the claim and heldSQL on DB (Config.PrepareStatements, or the dialect's default)

	claimSQL   string // built once in New
	keyLockSQL string // "" unless the dialect needs a key lock before the claim
	heldSQL    string // "" unless the dialect must check the claim is still held before COMMIT
	nopLogger  bool   // Logger is watermill.NopLogger: skip building log fields

	// claimStmt is claimSQL prepared on DB, on first use (the table may not
	// exist when New runs). database/sql re-prepares it once per pooled
	// connection and then reuses it in every transaction on that
	// connection: one round trip per claim on MySQL (an unprepared Exec with
	// arguments is prepare, execute, close) and no re-parsing on SQLite.
	claimMu   sync.Mutex
	claimStmt *sqlx.Stmt
	heldStmt  *sqlx.Stmt     // heldSQL prepared, the same way
	lockTable *qualifiedName // canonicalTable of table, for the key lock; resolved on first use
	verified  atomic.Bool    // the table passed verifySchema; checked before the first claim

	hooks *hooks // test seams; nil outside tests
}

// keyLockTable returns the table name the key lock hashes: resolved by the
// database, so that instances that spell the table differently ("inbox",
// "public.inbox") still exclude each other. Like preparedClaim, it must run
// before the message's transaction begins.
func (ib *Inbox) keyLockTable(ctx context.Context) (qualifiedName, error) {
	ib.claimMu.Lock()
	defer ib.claimMu.Unlock()
	if ib.lockTable != nil {
		return *ib.lockTable, nil
	}
	var t qualifiedName
	err := withReadTx(ctx, ib.db, ib.dialect, func(q sqlx.QueryerContext) (err error) {
		t, err = canonicalTable(ctx, q, ib.dialect, ib.table)
		return err
	})
	if err != nil {
		return t, err
	}
	ib.lockTable = &t
	return t, nil
}

// verifyOnce checks the table with verifySchema before the inbox's first
// claim, and again until a check passes: a table made by hand that could
// merge or truncate ids is refused before any message is claimed in it. Like
// preparedClaim, it must run before the message's transaction begins.
func (ib *Inbox) verifyOnce(ctx context.Context) error {
	if ib.verified.Load() {
		return nil
	}
	ib.claimMu.Lock()
	defer ib.claimMu.Unlock()
	if ib.verified.Load() {
		return nil
	}
	if err := verifySchema(ctx, ib.db, ib.dialect, ib.table); err != nil {
		return err
	}
	ib.verified.Store(true)
	return nil
}

// held runs heldSQL in tx and reports whether the claim's row is there.
// stmt is the prepared query, or nil when preparing failed.
func (ib *Inbox) held(ctx context.Context, tx *sqlx.Tx, stmt *sqlx.Stmt, consumer, id string) (bool, error) {
	var n int
	var err error
	if stmt == nil {
		err = tx.GetContext(ctx, &n, ib.heldSQL, consumer, id)
	} else {
		txStmt := tx.Tx.StmtContext(ctx, stmt.Stmt)
		err = txStmt.QueryRowContext(ctx, consumer, id).Scan(&n)
		txStmt.Close()
	}
	return n > 0, err
}

// claim runs the claim statement in tx and returns its rows affected. stmt
// is the prepared claim, or nil when preparing failed.
func (ib *Inbox) claim(ctx context.Context, tx *sqlx.Tx, stmt *sqlx.Stmt, consumer, id string) (int64, error) {
	var res sql.Result
	var err error
	if stmt == nil {
		// Not preparable (a missing table, a connection error): run it
		// unprepared so the error comes from the statement itself, and try
		// preparing again next time.
		res, err = tx.ExecContext(ctx, ib.claimSQL, consumer, id)
	} else {
		txStmt := tx.Tx.StmtContext(ctx, stmt.Stmt)
		res, err = txStmt.ExecContext(ctx, consumer, id)
		// Closing a transaction's statement keeps the underlying
		// prepared statement for the next transaction on this connection.
		txStmt.Close()
	}
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}

// preparedClaim returns the prepared claim and the prepared heldSQL (nil
// when the dialect has none), preparing them on first use; nil for one that
// could not be prepared. It must run before the message's transaction
// begins: preparing takes a connection from the pool, and the transaction
// may hold the last one.
func (ib *Inbox) preparedClaim(ctx context.Context) (claim, held *sqlx.Stmt) {
	if !ib.prepare {
		return nil, nil
	}
	ib.claimMu.Lock()
	defer ib.claimMu.Unlock()
	if ib.claimStmt == nil {
		ib.claimStmt, _ = ib.db.PreparexContext(ctx, ib.claimSQL)
	}
	if ib.heldSQL != "" && ib.heldStmt == nil && ib.claimStmt != nil {
		ib.heldStmt, _ = ib.db.PreparexContext(ctx, ib.heldSQL)
	}
	return ib.claimStmt, ib.heldStmt
}

// Close releases the prepared statements on every connection of DB (the
// claim on MySQL/MariaDB and SQLite, and on PostgreSQL with
// Config.PrepareStatements; nothing otherwise). It does not close DB. Call it when the Inbox is no longer used, after the
// router that runs its middleware has closed: a message still in flight
// then fails with "sql: statement is closed", which is not transient (see
// IsTransient), so a poison queue would take it. An Inbox that lives as
// long as its DB need not be closed. It is safe to call more than once.
func (ib *Inbox) Close() error {
	ib.claimMu.Lock()
	defer ib.claimMu.Unlock()
	var errs []error
	for _, stmt := range []**sqlx.Stmt{&ib.claimStmt, &ib.heldStmt} {
		if *stmt != nil {
			errs = append(errs, (*stmt).Close())
			*stmt = nil
		}
	}
	return errors.Join(errs...)
}

// New returns an Inbox for cfg. It checks the configuration and builds every
// statement, but does not touch the database: call InitializeSchema, or
// create the table with the DDL in schema/, before messages arrive. An
// invalid cfg gives an error that wraps ErrInvalidConfig and each problem's
// own sentinel (ErrInvalidTableName, ErrUnknownDialect, ErrInvalidConsumer).
func New(cfg Config) (*Inbox, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	table, _ := parseTableName(cfg.Table) // checked by Validate
	ib := &Inbox{
		db:            cfg.DB,
		dialect:       cfg.Dialect,
		table:         table,
		consumer:      cfg.Consumer,
		messageID:     cfg.MessageID,
		logger:        cfg.Logger,
		onProcessed:   cfg.OnProcessed,
		onDuplicate:   cfg.OnDuplicate,
		onFailed:      cfg.OnFailed,
		outbox:        cfg.Outbox,
		commitTimeout: cfg.CommitTimeout,
		prepare:       cfg.PrepareStatements || cfg.Dialect.preparesByDefault(),
		claimSQL:      cfg.Dialect.claimSQL(table),
		keyLockSQL:    cfg.Dialect.keyLockSQL(),
		heldSQL:       cfg.Dialect.heldSQL(table),
	}
	if cfg.TxOptions != nil {
		opts := *cfg.TxOptions // a copy: what Validate checked is what runs
		ib.txOptions = &opts
	}
	if cfg.Dialect == PostgreSQLPartitioned {
		// Pinned, never left to the server's default_transaction_isolation:
		// at REPEATABLE READ the snapshot would be taken before the key lock
		// is granted. Validate refused any other explicit level.
		opts := sql.TxOptions{Isolation: sql.LevelReadCommitted}
		if cfg.TxOptions != nil {
			opts.ReadOnly = cfg.TxOptions.ReadOnly
		}
		ib.txOptions = &opts
	}
	_, ib.nopLogger = ib.logger.(watermill.NopLogger)
	if cfg.TracerProvider != nil {
		ib.tracer = cfg.TracerProvider.Tracer("github.com/watermill-inbox/inbox")
	}
	if ib.consumer != "" {
		ib.logger = ib.logger.With(watermill.LogFields{"consumer": ib.consumer})
	}
	return ib, nil
}

// Middleware is a Watermill handler middleware (message.HandlerMiddleware):
// add it to a router with router.AddMiddleware(ib.Middleware), or to one
// handler with handler.AddMiddleware(ib.Middleware).
//
// Before its first claim it checks the table once, as Verify does: a
// missing or incompatible table makes every message fail with an error
// wrapping ErrTableNotFound or ErrIncompatibleTable (not transient) until a
// check passes; add RouterPlugin to the router to fail at startup instead.
//
// For each message it begins a transaction on Config.DB with the message's
// context and inserts (consumer, message id) into the inbox table, letting
// the primary key decide:
//   - a new row: the handler runs with the transaction in msg.Context()
//     (TxFromContext). If it returns nil, the transaction commits and the
//     handler's messages are returned to the router; if the commit fails,
//     the commit error is returned (the router nacks, never acks; a COMMIT
//     whose connection was lost is in doubt, and IsTransient reports it as
//     transient: the redelivery skips the message if it committed, and the
//     messages the handler returned are then lost unless Config.Outbox
//     wrote them in the transaction). On
//     MySQL/MariaDB the inbox first checks, in the transaction, that its
//     claim is still held: a deadlock or snapshot-isolation conflict whose
//     error the handler ignored has rolled everything back already, and
//     the error is then ErrTxRolledBack. If the
//     handler returns an error, the transaction rolls back and that same
//     error is returned (errors.Is/As match it). If it panics, the
//     transaction rolls back and the panic continues.
//   - no new row (already processed by this consumer): the transaction rolls
//     back, the handler is not called and the middleware returns nil, nil, so
//     the router acks. A concurrent delivery of the same key waits on the
//     key's row lock until the first transaction ends.
//
// An invalid message id or consumer is returned as an error wrapping
// ErrInvalidMessageID or ErrInvalidConsumer before anything is written.
// A nested inbox is refused with ErrNestedInbox, a claim that reports an
// impossible row count with ErrUnexpectedRowsAffected. Database errors are
// wrapped with the operation and the key; errors.As still reaches the
// driver's error type, and IsTransient tells those worth a redelivery.
// Outbox errors are returned wrapped, as are handler messages returned
// without a publish topic when Config.Outbox is set. It is safe for
// concurrent use: every handler goroutine may run it at once.
//
// The message's context governs the transaction until the handler returns:
// a deadline or cancellation before then rolls it back (the error wraps the
// context's). Once the handler returned nil, it does not: the outbox
// publish, the pre-commit check and COMMIT run to completion under
// Config.CommitTimeout (ErrCommitTimeout past it), so a committed message is
// acked even when the message's deadline fires during COMMIT.
//
// When it returns, msg.Context() is again the context the message came in
// with. Put it inside (after) Recoverer, PoisonQueue and Retry, so each retry
// gets a fresh transaction and a poisoned message is not marked processed.
func (ib *Inbox) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		return ib.handle(msg, h)
	}
}

func (ib *Inbox) handle(msg *message.Message, h message.HandlerFunc) (produced []*message.Message, err error) {
	ctx := msg.Context()
	start := time.Now()
	var consumer, id string
	// Every error returned to the router is reported to OnFailed once.
	defer func() {
		if err != nil {
			ib.failed(msg, consumer, id, start, err)
		}
	}()

	if _, nested := TxFromContext(ctx); nested {
		// The inner claim would wait forever on the outer transaction's
		// uncommitted row of the same key.
		return nil, fmt.Errorf("%w (message %q)", ErrNestedInbox, msg.UUID)
	}
	consumer = ib.consumer
	if consumer == "" {
		consumer = message.HandlerNameFromCtx(ctx)
		if err := checkKey(consumer, ErrInvalidConsumer, ErrEmptyConsumer, nil); err != nil {
			return nil, fmt.Errorf("%w (message %q: set Config.Consumer or run the middleware in a router)", err, msg.UUID)
		}
	}
	id, err = ib.messageID(msg)
	if err != nil {
		return nil, fmt.Errorf("inbox: message id of message %q: %w", msg.UUID, err)
	}
	if err := checkKey(id, ErrInvalidMessageID, ErrEmptyMessageID, ErrMessageIDTooLong); err != nil {
		return nil, fmt.Errorf("%w (message %q, consumer %q)", err, msg.UUID, consumer)
	}

	if ib.tracer == nil {
		return ib.transact(ctx, ctx, msg, h, consumer, id, start, nil)
	}
	// sctx carries the inbox span: every statement, and the handler, run
	// under it, so database and handler spans nest inside.
	sctx, span := ib.tracer.Start(ctx, "inbox", trace.WithSpanKind(trace.SpanKindInternal), trace.WithAttributes(
		attribute.String("inbox.consumer", consumer),
		attribute.String("inbox.message_id", id),
		attribute.String("messaging.message.id", msg.UUID),
		attribute.String("db.system", ib.dialect.String()),
	))
	panicked := true
	defer func() {
		if panicked { // not recovered here, so the handler's stack stays intact
			span.SetStatus(codes.Error, "handler panicked")
			span.End()
		}
	}()
	produced, err = ib.transact(sctx, ctx, msg, h, consumer, id, start, span)
	panicked = false
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
	return produced, err
}

// transact runs one claimed-or-duplicate transaction for a validated key.
// sctx is the context for statements and the handler (ctx with the inbox
// span, when tracing); ctx is the message's own, restored on return. span
// is nil when not tracing.
//
// The transaction lives on txCtx: sctx's values, and sctx's end until the
// handler has returned (a deadline then rolls the transaction back and ends
// a handler stuck on the pool), but not after the handler returned nil:
// from there only Config.CommitTimeout can end it, so that a deadline firing
// during COMMIT cannot make a committed message look failed.
func (ib *Inbox) transact(sctx, ctx context.Context, msg *message.Message, h message.HandlerFunc,
	consumer, id string, start time.Time, span trace.Span) (produced []*message.Message, err error) {
	if err := ib.verifyOnce(sctx); err != nil {
		// One line, for the router's log of every nacked message; Verify
		// (or Inbox.RouterPlugin) prints the whole report with its DDL.
		return nil, fmt.Errorf("inbox: %q/%q: %w (Inbox.Verify reports the fix)", consumer, id, firstLine{err})
	}
	stmt, heldStmt := ib.preparedClaim(sctx) // nil: run unprepared
	var lockTable qualifiedName
	if ib.keyLockSQL != "" {
		if lockTable, err = ib.keyLockTable(sctx); err != nil {
			return nil, fmt.Errorf("inbox: %q/%q: %w", consumer, id, err)
		}
	}
	txCtx, cancelTx := context.WithCancelCause(context.WithoutCancel(sctx))
	defer cancelTx(nil)
	followMessage := context.AfterFunc(sctx, func() { cancelTx(context.Cause(sctx)) })
	defer followMessage()
	tx, err := ib.db.BeginTxx(txCtx, ib.txOptions)
	if err != nil && ib.maybeLostConn(txCtx, err) {
		tx, err = ib.retryBegin(txCtx, msg, consumer, id, span, err)
	}
	if err != nil {
		return nil, fmt.Errorf("inbox: begin transaction for %q/%q: %w", consumer, id, withCause(txCtx, err))
	}
	// Until the transaction has ended by our Commit or Rollback, it must be
	// rolled back on every path, a panic in the handler included, so that
	// no connection stays checked out and nothing partial is committed.
	ended := false
	panicking := true
	defer func() {
		if ended {
			return
		}
		rbErr := tx.Rollback()
		if rbErr != nil && errors.Is(rbErr, sql.ErrTxDone) {
			rbErr = nil // already rolled back by database/sql (context ended)
		}
		if panicking {
			// No error to return: the panic goes on to Recoverer or the
			// router, which nack the message.
			if rbErr != nil {
				ib.logger.Error("Inbox rollback failed after handler panic", rbErr, ib.fields(msg, consumer, id))
			}
			ib.failed(msg, consumer, id, start, fmt.Errorf("inbox: handler panicked on %q/%q", consumer, id))
			return
		}
		if rbErr != nil {
			err = errors.Join(err, fmt.Errorf("inbox: rollback %q/%q: %w", consumer, id, &rollbackError{rbErr}))
		}
	}()

	ib.hooks.begun()
	if ib.keyLockSQL != "" {
		if _, err := tx.ExecContext(sctx, ib.keyLockSQL, keyLockHash(lockTable, consumer, id)); err != nil {
			panicking = false
			return nil, fmt.Errorf("inbox: lock key %q/%q: %w", consumer, id, err)
		}
	}
	n, err := ib.claim(sctx, tx, stmt, consumer, id)
	panicking = false
	if err != nil {
		// Name the table: a missing one (InitializeSchema not run) is the
		// most common first error.
		return nil, fmt.Errorf("inbox: claim %q/%q in table %s: %w", consumer, id, ib.table, err)
	}
	claimed, ok := ib.dialect.claimed(n)
	if !ok {
		return nil, fmt.Errorf("%w: %d (claim %q/%q)", ErrUnexpectedRowsAffected, n, consumer, id)
	}
	if span != nil {
		if claimed {
			span.AddEvent("inbox.claimed")
		} else {
			span.AddEvent("inbox.duplicate")
		}
	}
	if !claimed {
		ended = true
		if err := tx.Rollback(); err != nil && !errors.Is(err, sql.ErrTxDone) {
			// The key is known to be processed, but a failed rollback means
			// the connection is in doubt: nack; the redelivery is skipped.
			return nil, fmt.Errorf("inbox: rollback duplicate %q/%q: %w", consumer, id, &rollbackError{err})
		}
		if !ib.nopLogger {
			ib.logger.Debug("Inbox: duplicate message skipped", ib.fields(msg, consumer, id))
		}
		if ib.onDuplicate != nil {
			ib.onDuplicate(Event{Message: msg, Consumer: consumer, MessageID: id, Duration: time.Since(start)})
		}
		return nil, nil
	}

	// panicking is true again around every call of user code: the Outbox
	// factory, the handler, the outbox publisher.
	state := &txState{tx: tx}
	if ib.outbox != nil {
		panicking = true
		state.publisher, err = ib.outbox(tx)
		panicking = false
		if err != nil {
			return nil, fmt.Errorf("inbox: outbox publisher for %q/%q: %w", consumer, id, err)
		}
	}
	msg.SetContext(contextWithTx(sctx, state))
	defer msg.SetContext(ctx)
	defer state.end() // whatever way the transaction ends

	panicking = true
	produced, err = h(msg)
	panicking = false
	if err != nil {
		// Rolled back by the deferred function. The handler's error is
		// returned as it is, so that errors.Is/As match it.
		return nil, err
	}
	// The handler returned nil: from here the message's context no longer
	// governs the transaction, CommitTimeout does.
	if !followMessage() {
		// The message's context ended before the handler returned, and
		// database/sql has rolled the transaction back.
		return nil, fmt.Errorf("inbox: commit %q/%q: the message context ended before the handler returned: %w",
			consumer, id, context.Cause(sctx))
	}
	commitBound := time.AfterFunc(ib.commitTimeout, func() { cancelTx(ErrCommitTimeout) })
	defer commitBound.Stop()
	if ib.outbox != nil && len(produced) > 0 {
		panicking = true
		err := ib.publishToOutbox(msg, state, produced)
		panicking = false
		if err != nil {
			return nil, fmt.Errorf("inbox: %q/%q: %w", consumer, id, ib.commitTimedOut(txCtx, err))
		}
		produced = nil // sent by the outbox, not by the router
	}

	if ib.heldSQL != "" {
		held, err := ib.held(txCtx, tx, heldStmt, consumer, id)
		if err != nil {
			return nil, fmt.Errorf("inbox: commit %q/%q: check the claim: %w", consumer, id, ib.commitTimedOut(txCtx, err))
		}
		if !held {
			return nil, fmt.Errorf("inbox: commit %q/%q: %w", consumer, id, ErrTxRolledBack)
		}
	}
	ended = true
	if err := tx.Commit(); err != nil {
		if ib.maybeLostConn(txCtx, err) {
			// The COMMIT was sent, or it would have failed with
			// driver.ErrBadConn: it is in doubt.
			err = &lostConnError{err}
		}
		return nil, fmt.Errorf("inbox: commit %q/%q: %w", consumer, id, ib.commitTimedOut(txCtx, err))
	}
	if span != nil {
		span.AddEvent("inbox.committed")
	}
	ib.runAfterCommit(msg, state, consumer, id)
	if ib.onProcessed != nil {
		ib.onProcessed(Event{Message: msg, Consumer: consumer, MessageID: id, Duration: time.Since(start)})
	}
	return produced, nil
}

// withCause returns err, from a call on ctx, joined with ctx's cause when ctx
// has ended and err does not already wrap it: ctx's Err() is
// context.Canceled whatever ended it, and the caller must still be able to
// tell a deadline (errors.Is(err, context.DeadlineExceeded)).
func withCause(ctx context.Context, err error) error {
	if cause := context.Cause(ctx); cause != nil && !errors.Is(err, cause) {
		return fmt.Errorf("%w: %w", cause, err)
	}
	return err
}

// firstLine is err with its text cut at the first line break.
type firstLine struct{ err error }

func (e firstLine) Error() string {
	s, _, _ := strings.Cut(e.err.Error(), "\n")
	return strings.TrimSuffix(s, ":")
}
func (e firstLine) Unwrap() error { return e.err }

// commitTimedOut returns err wrapped with ErrCommitTimeout when the commit
// bound ended txCtx, and err unchanged otherwise.
func (ib *Inbox) commitTimedOut(txCtx context.Context, err error) error {
	if errors.Is(context.Cause(txCtx), ErrCommitTimeout) {
		return fmt.Errorf("%w after %v (the COMMIT is in doubt): %w", ErrCommitTimeout, ib.commitTimeout, err)
	}
	return err
}

// maybeLostConn reports whether err, from the BEGIN or COMMIT of a
// message's transaction, may be a connection lost after the statement was
// sent, which the dialect's driver reports without a database error code
// (go-sql-driver/mysql's plain "invalid connection"): an error IsTransient
// does not already accept, that carries no code, while ctx is still live.
func (ib *Inbox) maybeLostConn(ctx context.Context, err error) bool {
	return ib.dialect.uncodedBoundaryErrIsLostConn() && ctx.Err() == nil && !IsTransient(err) && !anyInChain(err, hasDatabaseCode)
}

// retryBegin begins the transaction again after the first BEGIN failed
// with firstErr, which maybeLostConn accepted: a connection lost after
// START TRANSACTION was sent (a server going down), which database/sql does
// not retry; nothing has started. If the retry fails the same way, a ping
// tells a lost connection from a misconfiguration that fails every
// connection without a code (TLS, an authentication plugin): if the ping
// succeeds, or fails with a transient error (connection refused), the
// error is a lostConnError, which IsTransient accepts; otherwise it stays
// as it is. The retry is logged at Debug and recorded on the span.
func (ib *Inbox) retryBegin(ctx context.Context, msg *message.Message, consumer, id string, span trace.Span,
	firstErr error) (*sqlx.Tx, error) {
	if !ib.nopLogger {
		fields := ib.fields(msg, consumer, id)
		fields["error"] = firstErr.Error()
		ib.logger.Debug("Inbox: BEGIN lost its connection, retrying once", fields)
	}
	if span != nil {
		span.AddEvent("inbox.begin_retried", trace.WithAttributes(attribute.String("error", firstErr.Error())))
	}
	tx, err := ib.db.BeginTxx(ctx, ib.txOptions)
	if err != nil && ib.maybeLostConn(ctx, err) {
		if pingErr := ib.db.PingContext(ctx); pingErr == nil || IsTransient(pingErr) {
			err = &lostConnError{err}
		}
	}
	return tx, err
}

// publishToOutbox publishes the handler's returned messages through the
// outbox of its transaction, to the handler's publish topic.
func (ib *Inbox) publishToOutbox(msg *message.Message, state *txState, produced []*message.Message) error {
	topic := message.PublishTopicFromCtx(msg.Context())
	if topic == "" {
		return fmt.Errorf("handler returned %d messages but has no publish topic (add it with router.AddHandler)", len(produced))
	}
	if err := state.publisher.Publish(topic, produced...); err != nil {
		return fmt.Errorf("outbox publish to %q: %w", topic, err)
	}
	return nil
}

// runAfterCommit runs the functions registered with AfterCommit. The
// transaction has committed, so a panic is logged, not propagated: the
// message must be acked.
func (ib *Inbox) runAfterCommit(msg *message.Message, state *txState, consumer, id string) {
	for _, f := range state.end() {
		func() {
			defer func() {
				if r := recover(); r != nil {
					ib.logger.Error("Inbox after-commit function panicked", fmt.Errorf("panic: %v", r), ib.fields(msg, consumer, id))
				}
			}()
			f()
		}()
	}
}

func (ib *Inbox) failed(msg *message.Message, consumer, id string, start time.Time, err error) {
	if ib.onFailed != nil {
		ib.onFailed(Event{Message: msg, Consumer: consumer, MessageID: id, Duration: time.Since(start), Err: err})
	}
}

func (ib *Inbox) fields(msg *message.Message, consumer, id string) watermill.LogFields {
	return watermill.LogFields{
		"message_uuid": msg.UUID,
		"handler_name": message.HandlerNameFromCtx(msg.Context()),
		"consumer":     consumer,
		"message_id":   id,
	}
}

// checkKey validates a consumer name or message id: 1 to MaxKeyLength bytes
// of valid UTF-8 without NUL (PostgreSQL text cannot hold NUL). The error
// wraps kind, plus empty or tooLong when those apply and are non-nil.
func checkKey(s string, kind, empty, tooLong error) error {
	switch {
	case s == "":
		if empty != nil {
			return fmt.Errorf("%w: %w", kind, empty)
		}
		return fmt.Errorf("%w: empty", kind)
	case len(s) > MaxKeyLength:
		if tooLong != nil {
			return fmt.Errorf("%w: %w: %d bytes, at most %d", kind, tooLong, len(s), MaxKeyLength)
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

// InitializeSchema creates the inbox table and its purge index if they do
// not exist, with exactly the DDL of schema/ (for the configured table
// name). When both exist it only reads the catalog and runs no DDL, so it
// takes no table lock (on PostgreSQL even CREATE INDEX IF NOT EXISTS would
// queue behind running handlers) and needs no CREATE privilege. It is
// idempotent and safe to run from several processes at once (on SQLite, with
// a busy_timeout in the DSN; without one a concurrent starter may get
// SQLITE_BUSY and must retry): on
// PostgreSQL the DDL runs in one transaction under a transaction-scoped
// advisory lock keyed by the table name (concurrent CREATE TABLE IF NOT
// EXISTS can otherwise fail on pg_type's unique index); on MySQL the table
// and index are one CREATE TABLE IF NOT EXISTS statement; on SQLite each
// statement is atomic and IF NOT EXISTS. It does not create a PostgreSQL
// schema or MySQL database named in Table. Then it checks the table as
// Verify does, so that a table a migration or a DBA made differently, or a
// concurrent starter's, is refused (ErrIncompatibleTable) before any
// message is claimed in it. Errors wrap the driver's error. It works behind
// a transaction-mode connection pooler.
//
// For PostgreSQLPartitioned it also creates the daily partitions from
// yesterday to DefaultPartitionsAhead days after today (CreatePartitions).
func (ib *Inbox) InitializeSchema(ctx context.Context) error {
	if err := initializeSchema(ctx, ib.db, ib.dialect, ib.table); err != nil {
		return err
	}
	if ib.dialect != PostgreSQLPartitioned {
		return nil
	}
	return ensurePartitions(ctx, ib.db, ib.table)
}

// ensurePartitions creates the partitions from yesterday (by the database
// clock) to DefaultPartitionsAhead days after today.
func ensurePartitions(ctx context.Context, db dbConn, t qualifiedName) error {
	var now time.Time
	if err := sqlx.GetContext(ctx, db, &now, "SELECT now()"); err != nil {
		return fmt.Errorf("inbox: create partitions of %s: %w", t, err)
	}
	return createPartitions(ctx, db, t, now.AddDate(0, 0, -1), DefaultPartitionsAhead+2)
}

// keyLockHash is the advisory lock key of one inbox key: a 64-bit FNV-1a
// hash of table, consumer and message id. A collision only makes two
// unrelated deliveries wait for each other.
func keyLockHash(t qualifiedName, consumer, id string) int64 {
	h := fnv.New64a()
	h.Write([]byte(t.String()))
	h.Write([]byte{0})
	h.Write([]byte(consumer))
	h.Write([]byte{0})
	h.Write([]byte(id))
	return int64(h.Sum64())
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
