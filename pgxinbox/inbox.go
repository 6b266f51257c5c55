package pgxinbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/jmoiron/sqlx"
	"go.opentelemetry.io/otel/trace"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/backend"
)

// Config configures an Inbox. It has the fields of inbox.Config that mean
// the same here (their documentation there is complete; differences are
// stated below), with a pgx pool instead of a *sqlx.DB and an outbox
// factory that takes a pgx.Tx.
type Config struct {
	// Pool is the pool that holds the inbox table and the handler's
	// business tables. Each message in flight holds one of its connections
	// for its transaction, from the claim to the COMMIT. Behind a
	// transaction-mode pooler (PgBouncer before 1.21), configure the pool
	// with default_query_exec_mode=exec or simple_protocol (in the
	// connection string or ConnConfig.DefaultQueryExecMode): pgx's default
	// statement cache prepares named statements that do not survive the
	// pooler's change of server connection (pgx's documented limit).
	// Default: none; required (inbox.ErrInvalidConfig without it).
	Pool *pgxpool.Pool

	// Dialect is inbox.PostgreSQL or inbox.PostgreSQLPartitioned; any other
	// is inbox.ErrInvalidConfig.
	// Default: inbox.PostgreSQL.
	Dialect inbox.Dialect

	// Table, Consumer and MessageID are inbox.Config's.
	// Default: "watermill_inbox"; the Watermill handler name; msg.UUID.
	Table     string
	Consumer  string
	MessageID func(msg *message.Message) (string, error)

	// IsoLevel is the isolation level of the message's transaction
	// (pgx.ReadCommitted, pgx.RepeatableRead, pgx.Serializable or
	// pgx.ReadUncommitted), as inbox.Config.TxOptions: a concurrent
	// duplicate fails with SQLSTATE 40001 above READ COMMITTED, and
	// inbox.PostgreSQLPartitioned needs READ COMMITTED.
	// Default: "", the server's default (READ COMMITTED unless configured).
	IsoLevel pgx.TxIsoLevel

	// Logger, OnProcessed, OnDuplicate, OnFailed and TracerProvider are
	// inbox.Config's. The span's statements are pgx's: add a pgx tracer
	// (ConnConfig.Tracer, for example otelpgx) to the pool for their spans.
	// Default: watermill.NopLogger{}; nil hooks; no tracing.
	Logger         watermill.LoggerAdapter
	OnProcessed    func(inbox.Event)
	OnDuplicate    func(inbox.Event)
	OnFailed       func(inbox.Event)
	TracerProvider trace.TracerProvider

	// ReusedIDs, Fingerprint and OnReusedID are inbox.Config's: a message id
	// already processed with other content is refused (an error wrapping
	// inbox.ErrMessageIDReused), or with inbox.ReusedIDsWarn logged and
	// skipped. The claim stores the fingerprint in the batch that begins the
	// transaction (no round trip added); a duplicate reads the stored one.
	// Default: inbox.ReusedIDsRefuse; the payload; nil.
	ReusedIDs   inbox.ReusedIDCheck
	Fingerprint func(msg *message.Message) []byte
	OnReusedID  func(inbox.Event)

	// Outbox returns a publisher that writes to an outbox in the given
	// transaction, as inbox.Config.Outbox does for database/sql: with
	// watermill-sql v4, wsql.NewPublisher(wsql.TxFromPgx(tx), …). The
	// messages the handler returns are published through it before the
	// commit, and inbox.OutboxFromContext returns it in the handler. It is
	// called once per claimed message, from every handler goroutine at
	// once: it must be cheap and safe for concurrent use.
	// Default: nil, returned messages go to the router.
	Outbox func(tx pgx.Tx) (message.Publisher, error)

	// OutboxTables is inbox.Config's: the tables Outbox writes, checked by
	// Verify, RouterPlugin and before the first claim (ErrTableNotFound for
	// a missing one).
	// Default: nil, no outbox table is checked.
	OutboxTables []string

	// CommitTimeout is inbox.Config's: it bounds the outbox publish and
	// COMMIT once the handler returned nil (pgx cancels a COMMIT whose
	// context ends, and closes its connection: the COMMIT is then in doubt,
	// inbox.ErrCommitTimeout). It also bounds the ROLLBACK.
	// Default: 10 s (inbox.DefaultCommitTimeout).
	CommitTimeout time.Duration
}

// Instrument returns cfg with its outcome hooks (OnProcessed, OnDuplicate,
// OnFailed and OnReusedID) replaced by those instrument sets on an
// inbox.Config that holds them: an adapter for hook wrappers written for
// inbox.Config, the metrics module's Metrics.Instrument first among them:
//
//	ib, err := pgxinbox.New(pgxinbox.Config{Pool: pool}.Instrument(m.Instrument))
//
// Hooks already set in cfg are what instrument receives, so they still
// run as it runs them, with cfg's Table, ReusedIDs and Fingerprint (set
// them before calling Instrument). instrument nil returns cfg as it is.
func (cfg Config) Instrument(instrument func(inbox.Config) inbox.Config) Config {
	if instrument == nil {
		return cfg
	}
	// With the settings a hook wrapper may read (the metrics module leaves
	// inbox_reused_ids_detected out under ReusedIDsOff).
	hooks := instrument(inbox.Config{OnProcessed: cfg.OnProcessed, OnDuplicate: cfg.OnDuplicate,
		OnFailed: cfg.OnFailed, OnReusedID: cfg.OnReusedID, ReusedIDs: cfg.ReusedIDs, Fingerprint: cfg.Fingerprint, Table: cfg.Table})
	cfg.OnProcessed, cfg.OnDuplicate, cfg.OnFailed, cfg.OnReusedID =
		hooks.OnProcessed, hooks.OnDuplicate, hooks.OnFailed, hooks.OnReusedID
	return cfg
}

// Inbox is the transactional inbox over a pgx pool. Its Middleware makes a
// Watermill handler an idempotent consumer exactly as inbox.Inbox's does
// (the same flow, semantics, errors, hooks and spans; see package inbox),
// with the handler's transaction a pgx.Tx (TxFromContext). The embedded
// *inbox.Inbox provides Middleware, InitializeSchema, Verify and
// RouterPlugin; they read the catalog through DB. Create it with New. It is
// safe for concurrent use.
type Inbox struct {
	*inbox.Inbox
	db *sqlx.DB
}

// newCore is package inbox's constructor for an inbox over a backend.
var newCore = backend.NewInbox.(func(inbox.Config, backend.Options) (*inbox.Inbox, error))

// New returns an Inbox for cfg. Like inbox.New it checks the configuration
// and builds every statement without touching the database; an invalid cfg
// gives an error that wraps inbox.ErrInvalidConfig (and each problem's
// sentinel, as inbox.New's).
func New(cfg Config) (*Inbox, error) {
	if cfg.Pool == nil {
		return nil, fmt.Errorf("%w: pgxinbox.Config.Pool is required", inbox.ErrInvalidConfig)
	}
	if cfg.Dialect == nil {
		cfg.Dialect = inbox.PostgreSQL
	}
	if cfg.Dialect != inbox.PostgreSQL && cfg.Dialect != inbox.PostgreSQLPartitioned {
		return nil, fmt.Errorf("%w: pgxinbox.Config.Dialect must be inbox.PostgreSQL or inbox.PostgreSQLPartitioned, got %s",
			inbox.ErrInvalidConfig, cfg.Dialect)
	}
	txOptions, err := sqlTxOptions(cfg.IsoLevel)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", inbox.ErrInvalidConfig, err)
	}
	if cfg.CommitTimeout == 0 {
		cfg.CommitTimeout = inbox.DefaultCommitTimeout
	}
	db := DB(cfg.Pool)
	core, err := newCore(inbox.Config{
		DB:             db,
		Dialect:        cfg.Dialect,
		Table:          cfg.Table,
		Consumer:       cfg.Consumer,
		MessageID:      cfg.MessageID,
		TxOptions:      txOptions,
		Logger:         cfg.Logger,
		OnProcessed:    cfg.OnProcessed,
		OnDuplicate:    cfg.OnDuplicate,
		OnFailed:       cfg.OnFailed,
		TracerProvider: cfg.TracerProvider,
		ReusedIDs:      cfg.ReusedIDs,
		Fingerprint:    cfg.Fingerprint,
		OnReusedID:     cfg.OnReusedID,
		CommitTimeout:  cfg.CommitTimeout,
		OutboxTables:   cfg.OutboxTables,
	}, backend.Options{
		New: func(st backend.Statements) (backend.Backend, error) {
			return &pgxBackend{
				pool:            cfg.Pool,
				st:              st,
				begin:           pgx.TxOptions{BeginQuery: st.Begin},
				outbox:          cfg.Outbox,
				rollbackTimeout: cfg.CommitTimeout,
			}, nil
		},
		Outbox: cfg.Outbox != nil,
		PoolExhausted: func() bool {
			s := cfg.Pool.Stat()
			return s.AcquiredConns() >= s.MaxConns()
		},
	})
	if err != nil {
		db.Close()
		return nil, err
	}
	return &Inbox{Inbox: core, db: db}, nil
}

// sqlTxOptions maps a pgx isolation level to the database/sql options that
// package inbox validates (and renders as BEGIN).
func sqlTxOptions(l pgx.TxIsoLevel) (*sql.TxOptions, error) {
	switch l {
	case "":
		return nil, nil
	case pgx.ReadCommitted:
		return &sql.TxOptions{Isolation: sql.LevelReadCommitted}, nil
	case pgx.RepeatableRead:
		return &sql.TxOptions{Isolation: sql.LevelRepeatableRead}, nil
	case pgx.Serializable:
		return &sql.TxOptions{Isolation: sql.LevelSerializable}, nil
	case pgx.ReadUncommitted:
		return &sql.TxOptions{Isolation: sql.LevelReadUncommitted}, nil
	}
	return nil, fmt.Errorf("pgxinbox.Config.IsoLevel %q is not a PostgreSQL isolation level", string(l))
}

// DB returns the *sqlx.DB over the pool that the Inbox reads the catalog
// with, made by New with the package's DB(pool). It borrows the pool's
// connections (pgx's stdlib.OpenDBFromPool, which keeps none idle) and is
// closed by Close. For the Outbox (made before the Inbox), the Purger, the
// stats, metrics' WatchTable and your DDL, prefer one DB(pool) made at
// startup and kept for the whole process: what still uses this one after
// Close fails (a WatchTable scrape, a purge round).
func (ib *Inbox) DB() *sqlx.DB { return ib.db }

// Close releases what the Inbox holds (see inbox.Inbox.Close) and closes
// DB; it does not close the pool. Call it after the router that runs the
// middleware has closed. It is safe to call more than once.
func (ib *Inbox) Close() error {
	return errors.Join(ib.Inbox.Close(), ib.db.Close())
}

// DB wraps pool for the parts of package inbox that take a *sqlx.DB
// (Purge, NewPurger, Stats, CountExpired, inbox.New itself): the one-line
// adapter sqlx.NewDb(stdlib.OpenDBFromPool(pool), "pgx"), whose
// SetMaxOpenConns is pool's MaxConns. The result borrows pool's connections
// and keeps none idle; closing it does not close pool. Keep one per pool
// rather than one per call. database/sql reports the pool's limit (the
// adapter alone reports none): a purge round, which needs two connections
// at once, is refused on a pool of one (inbox.ErrInvalidConfig) instead of
// waiting for a second one for ever, the pool's only connection held.
func DB(pool *pgxpool.Pool) *sqlx.DB {
	db := stdlib.OpenDBFromPool(pool)
	db.SetMaxOpenConns(int(pool.Config().MaxConns))
	return sqlx.NewDb(db, "pgx")
}

// TxFromContext returns the pgx transaction that the middleware opened for
// the message being handled, and true; or nil and false when ctx does not
// come from a message an Inbox of this package claimed (inbox.TxFromContext
// returns the database/sql one). Call it with msg.Context() in the handler.
// The rules of inbox.TxFromContext hold: every write through it commits or
// rolls back with the inbox row; the handler must not end it (no Commit,
// no Rollback, no COMMIT or ROLLBACK statement: a handler that does and
// returns nil is nacked with inbox.ErrTransactionEnded, and what it
// committed stays committed), it may start nested transactions (tx.Begin:
// savepoints), and it is valid only until the handler returns. Its
// connection stays with the message until the middleware commits or rolls
// back, even after the handler's own Commit or Rollback; from then on its
// statements, and those of its savepoints, fail with pgx.ErrTxClosed (an
// AfterCommit function's, a goroutine's: the connection serves other
// messages), except through Conn() and LargeObjects(), which reach pgx's
// connection directly. Like every pgx.Tx it is not safe for concurrent use.
// inbox.OutboxFromContext and inbox.AfterCommit work on the same context.
// When it returns false, return MissingTxError(ctx) from the handler: it
// says why (a message claimed by an inbox.Inbox, whose transaction
// inbox.TxFromContext returns, or no inbox middleware at all).
func TxFromContext(ctx context.Context) (pgx.Tx, bool) {
	h, ok := backend.HandleFromContext(ctx)
	if !ok {
		return nil, false
	}
	tx, ok := h.(pgx.Tx)
	return tx, ok
}

// MissingTxError returns the error a handler should return when
// TxFromContext(ctx) reports false, and nil when it reports true. The error
// wraps inbox.ErrNoTx and says why there is no pgx.Tx: the message was
// claimed by an inbox.Inbox (database/sql), whose transaction
// inbox.TxFromContext returns; or ctx carries no inbox transaction at all,
// because no Inbox's Middleware runs around the handler or ctx is not
// msg.Context(). The router nacks the message; the error is not transient
// (inbox.IsTransient). It is safe for concurrent use.
//
//	tx, ok := pgxinbox.TxFromContext(msg.Context())
//	if !ok {
//		return pgxinbox.MissingTxError(msg.Context())
//	}
func MissingTxError(ctx context.Context) error {
	if _, ok := TxFromContext(ctx); ok {
		return nil
	}
	if _, ok := inbox.TxFromContext(ctx); ok {
		return fmt.Errorf("%w: the message was claimed by an inbox.Inbox (database/sql), whose transaction is a *sqlx.Tx: "+
			"call inbox.TxFromContext, or make the Inbox with pgxinbox.New for a pgx.Tx", inbox.ErrNoTx)
	}
	return fmt.Errorf("%w: no pgxinbox Inbox.Middleware runs around this handler (add it with router.AddMiddleware(ib.Middleware) "+
		"or to the handler), or the context is not msg.Context()", inbox.ErrNoTx)
}
