package inbox

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"hash/fnv"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/watermill-inbox/inbox/internal/backend"
)

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
	logger      *componentLogger
	onProcessed func(Event)
	onDuplicate func(Event)
	onFailed    func(Event)
	onReusedID  func(Event)
	outbox      func(*sqlx.Tx) (message.Publisher, error)

	reusedIDs     ReusedIDCheck
	fingerprintOf func(*message.Message) []byte // Config.Fingerprint
	// fingerprints is fingerprintsUnresolved until the first check of the
	// table before a claim (resolveFingerprints) finds whether it has the
	// fingerprint column, then fingerprintsOn or fingerprintsOff for good.
	fingerprints atomic.Int32
	// changedFingerprints holds the claimed fingerprints of failed
	// deliveries whose handler changed the message (deliveryFingerprint).
	changedFingerprints changedFingerprints
	// recentFingerprints spares a duplicate of a key this inbox committed
	// lately the read of its stored fingerprint.
	recentFingerprints recentFingerprints
	tracer             trace.Tracer // nil without Config.TracerProvider

	commitTimeout time.Duration
	prepare       bool // prepare the claim and heldSQL on DB (Config.PrepareStatements, or the dialect's default)

	backend   txBackend // sqlBackend, or nativeBackend (package pgxinbox)
	hasOutbox bool      // Config.Outbox, or the native backend's own outbox

	// Built once in New.
	claimSQL            string
	claimFingerprintSQL string // claimSQL storing the fingerprint (bind parameter 3)
	storedFingerprint   string // the query of a key's stored fingerprint
	keyLockSQL          string // with locksKeys: the dialect's key lock, taken before the claim
	heldSQL             string // with checksHeld: the dialect's pre-commit check
	// quotedTable is the inbox table as the outbox writers' claim names it
	// (outboxClaim.table).
	quotedTable string
	// foreignCheckSQL is the read of the claim before a Publish through
	// another package's outbox publisher (checkBeforeForeignPublish):
	// heldSQL where checksHeld, the claim's count on SQLite, "" otherwise.
	foreignCheckSQL string
	statuslessSQL   string // without checksHeld: the dialect's check for a driver that gives no status
	statuslessNoted sync.Once
	locksKeys       bool
	checksHeld      bool

	// claimStmt is claimSQL prepared on DB, on first use (the table may not
	// exist when New runs). database/sql re-prepares it once per pooled
	// connection and then reuses it in every transaction on that
	// connection: one round trip per claim on MySQL (an unprepared Exec with
	// arguments is prepare, execute, close) and no re-parsing on SQLite.
	claimMu   sync.Mutex
	claimStmt *sqlx.Stmt
	heldStmt  *sqlx.Stmt // heldSQL prepared, the same way
	fpStmt    *sqlx.Stmt // storedFingerprint prepared, the same way, once the fingerprints are on
	// keyLocking, with locksKeys, is resolved on first use, and again
	// after a failed locked claim; keyLockMu serialises its resolution. Not
	// under claimMu: a delivery forgets it while its transaction holds a
	// connection, and resolving it waits for one.
	keyLocking atomic.Pointer[keyLocking]
	keyLockMu  sync.Mutex
	// claimFunctionNoted: a resolution found no claim function and said
	// so (once per Inbox).
	claimFunctionNoted atomic.Bool
	// recheckKeyLocking is how long a resolution without the claim
	// function holds before the next delivery looks for it again
	// (claimFunctionRecheck; tests shorten it).
	recheckKeyLocking time.Duration
	verified          atomic.Bool     // the table passed verifySchema; checked before the first claim
	server            serverCheck     // the dialect matches DB's server; checked before the tables
	dialectInferred   bool            // Config.Dialect was nil: inferred from DB.DriverName()
	outboxTables      []qualifiedName // Config.OutboxTables: checked with the inbox table
	tableFailures     atomic.Int32    // consecutive deliveries that met a table error (waitAfterTableError)
	refusedClaims     atomic.Int32    // consecutive claims refused for the database's state: read-only, no partition (readOnlyClaim, missingPartitionClaim)
	// refusedOutputs counts, per handler (delivery.handlerKey → an
	// *atomic.Int32), consecutive deliveries whose returned messages had
	// nowhere to go (publishToOutbox), until one of that handler's
	// deliveries commits: not refusedClaims, which the claim before the
	// handler reset, nor one count for the Inbox, which another handler's
	// commits reset, so that the wait never grew past its first 100 ms.
	refusedOutputs sync.Map
	// anyRefusedOutputs is set once refusedOutputs holds a count, so that a
	// commit, the per-message path, looks it up only then.
	anyRefusedOutputs atomic.Bool
	poolExhausted     func() bool // every connection of the pool the transactions use is in use

	hooks *hooks // test seams; nil outside tests
}

// keyLocking is how deliveries take the dialect's key lock.
type keyLocking struct {
	// table is the table name the lock's hash is keyed by (keyLockHash):
	// resolved by the database (canonicalTable), so that instances that
	// spell the table differently ("inbox", "public.inbox") still exclude
	// each other.
	table qualifiedName
	// lockedClaim is the dialect's one statement that takes the key lock
	// and claims (Dialect.lockedClaim), "" when the two run as two
	// statements.
	lockedClaim string
	// resolved is when it was read from the catalog.
	resolved time.Time
}

// claimFunctionRecheck is how often an Inbox that found no claim function
// (Dialect.lockedClaim) looks for it again, so that a function added by a
// migration while the application runs is used within this time, without a
// restart: one catalog read a minute, and none once it is found.
const claimFunctionRecheck = time.Minute

// resolveKeyLocking returns how deliveries take the key lock, reading the
// catalog on first use, after forgetKeyLocking, and while no claim function
// was found, every recheckKeyLocking. Like preparedClaim, it must run before
// the message's transaction begins.
func (ib *Inbox) resolveKeyLocking(ctx context.Context) (keyLocking, error) {
	fresh := func(k *keyLocking) bool {
		return k != nil && (k.lockedClaim != "" || time.Since(k.resolved) < ib.recheckKeyLocking)
	}
	if k := ib.keyLocking.Load(); fresh(k) {
		return *k, nil
	}
	ib.keyLockMu.Lock()
	defer ib.keyLockMu.Unlock()
	if k := ib.keyLocking.Load(); fresh(k) {
		return *k, nil
	}
	k := keyLocking{resolved: time.Now()}
	err := withReadTx(ctx, ib.db, ib.dialect, func(q sqlx.QueryerContext) (err error) {
		if k.table, err = canonicalTable(ctx, q, ib.dialect, ib.table); err != nil {
			return err
		}
		// As the table is spelled: the function resolves as the table does.
		if k.lockedClaim, err = ib.dialect.lockedClaim(ctx, q, ib.table, ib.fingerprintsOn()); err != nil {
			return fmt.Errorf("find claim function: %w", err)
		}
		return nil
	})
	if err != nil {
		return k, err
	}
	// Not with a native backend (pgxinbox), which sends the key lock and
	// the claim in one batch with BEGIN and calls no claim function.
	if _, native := ib.backend.(nativeBackend); k.lockedClaim == "" && !native && ib.claimFunctionNoted.CompareAndSwap(false, true) {
		if create := ib.dialect.claimFunctionSQL(ib.table, ib.fingerprintsOn()); create != "" {
			// A table migrated by hand (the fingerprint column added
			// without its overload, a function left out): each claim
			// takes one round trip more, which nothing else tells.
			ib.logger.get().Info("Inbox: the table's claim function is missing or not as the inbox makes it, so each claim"+
				" takes two statements (one round trip more); create it with: "+create+" (InitializeSchema does)",
				watermill.LogFields{"table": ib.table.String(), "claim_function": "missing"})
		}
	}
	ib.keyLocking.Store(&k)
	return k, nil
}

// forgetKeyLocking makes the next delivery resolve the key locking again:
// after a locked claim failed, in case its function was dropped or replaced.
func (ib *Inbox) forgetKeyLocking() { ib.keyLocking.Store(nil) }

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
	if err := ib.server.check(ctx, ib); err != nil {
		return err
	}
	if err := ib.verifyTables(ctx); err != nil {
		return err
	}
	ib.verified.Store(true)
	return nil
}

// held runs heldSQL in tx and reports whether the claim's row is there.
// stmt is the prepared query, or nil when not prepared.
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
// is the prepared claim, or nil when preparing failed; fingerprint is the
// content's, nil when the fingerprints are off. sameFingerprint reports a
// processed key that the claim found stored with the same fingerprint, or
// none (Dialect.claimFlagsOtherFingerprint): a duplicate that needs no read.
func (ib *Inbox) claim(ctx context.Context, tx *sqlx.Tx, stmt *sqlx.Stmt, consumer, id string, fingerprint []byte) (n int64, sameFingerprint bool, err error) {
	var res sql.Result
	args := []any{consumer, id}
	if fingerprint != nil {
		args = append(args, fingerprint)
	}
	if stmt == nil {
		// Not preparable (a missing table, a connection error): run it
		// unprepared so the error comes from the statement itself, and try
		// preparing again next time.
		res, err = tx.ExecContext(ctx, ib.claimQuery(), args...)
	} else {
		txStmt := tx.Tx.StmtContext(ctx, stmt.Stmt)
		res, err = txStmt.ExecContext(ctx, args...)
		// Closing a transaction's statement keeps the underlying
		// prepared statement for the next transaction on this connection.
		txStmt.Close()
	}
	if n, err = execRowsAffected(res, err); err != nil || fingerprint == nil || !ib.dialect.claimFlagsOtherFingerprint() {
		return n, false, err
	}
	if claimed, _ := ib.dialect.claimed(n); !claimed {
		other, idErr := res.LastInsertId()
		sameFingerprint = idErr == nil && other == 0
	}
	return n, sameFingerprint, nil
}

// execRowsAffected returns the rows affected of an Exec's result, or its
// error.
func execRowsAffected(res sql.Result, err error) (int64, error) {
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
func (ib *Inbox) preparedClaim(ctx context.Context) (claim, held, fingerprint *sqlx.Stmt) {
	if !ib.prepare {
		return nil, nil, nil
	}
	ib.claimMu.Lock()
	defer ib.claimMu.Unlock()
	if ib.claimStmt == nil {
		// The fingerprints are resolved before the first claim, for good.
		ib.claimStmt, _ = ib.db.PreparexContext(ctx, ib.claimQuery())
	}
	if ib.checksHeld && ib.heldStmt == nil && ib.claimStmt != nil {
		ib.heldStmt, _ = ib.db.PreparexContext(ctx, ib.heldSQL)
	}
	if ib.fingerprintsOn() && ib.fpStmt == nil && ib.claimStmt != nil {
		ib.fpStmt, _ = ib.db.PreparexContext(ctx, ib.storedFingerprint)
	}
	return ib.claimStmt, ib.heldStmt, ib.fpStmt
}

// preparesOn returns the database the inbox prepares its statements on,
// or nil when it does not prepare them (see Config.PrepareStatements) or
// runs on another driver than database/sql.
func (ib *Inbox) preparesOn() *sql.DB {
	if !ib.prepare || ib.db == nil {
		return nil
	}
	return ib.db.DB
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
	return closeStmts(&ib.claimStmt, &ib.heldStmt, &ib.fpStmt)
}

// closeStmts closes the prepared statements that stmts point to and sets
// them to nil; a nil one is left. It returns their errors, joined.
func closeStmts(stmts ...**sqlx.Stmt) error {
	var errs []error
	for _, stmt := range stmts {
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
	inferred := cfg.Dialect == nil
	logger := cfg.Logger // nil: the router's, from RouterPlugin on
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, invalidConfig(err)
	}
	table, _ := parseTableName(cfg.Table) // checked by Validate
	ib := &Inbox{
		db:            cfg.DB,
		dialect:       cfg.Dialect,
		table:         table,
		consumer:      cfg.Consumer,
		messageID:     cfg.MessageID,
		onProcessed:   cfg.OnProcessed,
		onDuplicate:   cfg.OnDuplicate,
		onFailed:      cfg.OnFailed,
		onReusedID:    cfg.OnReusedID,
		outbox:        cfg.Outbox,
		reusedIDs:     cfg.ReusedIDs,
		fingerprintOf: cfg.Fingerprint,
		commitTimeout: cfg.CommitTimeout,
		prepare:       cfg.PrepareStatements || cfg.Dialect.preparesByDefault(),
		claimSQL:      cfg.Dialect.claimSQL(table),

		claimFingerprintSQL: cfg.Dialect.claimFingerprintSQL(table),
		storedFingerprint:   cfg.Dialect.storedFingerprintSQL(table),

		recheckKeyLocking: claimFunctionRecheck,
		dialectInferred:   inferred,
	}
	if ib.fingerprintOf == nil {
		ib.fingerprintOf = payloadOf
	}
	if ib.reusedIDs == ReusedIDsOff {
		ib.fingerprints.Store(fingerprintsOff)
	}
	ib.backend = sqlBackend{ib}
	ib.hasOutbox = cfg.Outbox != nil
	ib.poolExhausted = func() bool { return sqlPoolExhausted(ib.db) }
	for _, name := range cfg.OutboxTables {
		t, _ := parseTableName(name) // checked by Validate
		ib.outboxTables = append(ib.outboxTables, t)
	}
	ib.keyLockSQL, ib.locksKeys = cfg.Dialect.keyLock()
	ib.heldSQL, ib.checksHeld = cfg.Dialect.preCommitCheck(table)
	ib.quotedTable = table.quoted(cfg.Dialect)
	switch {
	case ib.checksHeld:
		ib.foreignCheckSQL = ib.heldSQL
	case cfg.Dialect == SQLite:
		ib.foreignCheckSQL = claimCountSQL(ib.quotedTable)
	}
	ib.statuslessSQL, _ = cfg.Dialect.statuslessCheck(table)
	ib.txOptions = cfg.Dialect.txOptions(cfg.TxOptions)
	if cfg.TracerProvider != nil {
		ib.tracer = cfg.TracerProvider.Tracer("github.com/watermill-inbox/inbox")
	}
	var fields watermill.LogFields
	if ib.consumer != "" {
		fields = watermill.LogFields{"consumer": ib.consumer}
	}
	ib.logger = newComponentLogger(logger, fields)
	return ib, nil
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
// message is claimed in it. Before any of it, it checks that the dialect is
// for the server DB reaches, as Verify does (ErrDialectMismatch). Errors
// wrap the driver's error. It works behind a transaction-mode connection
// pooler.
//
// For PostgreSQLPartitioned it also creates the partitions, at the table's
// PartitionInterval (weekly for a new table), that cover yesterday to
// DefaultPartitionsAhead days after today (CreatePartitions).
func (ib *Inbox) InitializeSchema(ctx context.Context) error {
	if err := ib.server.check(ctx, ib); err != nil {
		return err
	}
	if err := initializeSchema(ctx, ib.db, ib.dialect, ib.table); err != nil {
		return poolerHint(err)
	}
	if len(ib.outboxTables) == 0 {
		ib.verified.Store(true) // checked by initializeSchema: the middleware need not check again
	}
	ib.forgetKeyLocking() // it may have added the claim function
	if err := ib.resolveFingerprints(ctx); err != nil {
		return err // with poolerHint's hint
	}
	return poolerHint(ib.dialect.maintainSchema(ctx, ib.db, ib.table))
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

// txBackend is how the flow (delivery.run) reaches the database. The flow
// is one for every backend; a backend begins a delivery's transaction and
// claims its key (in one round trip where it can pipeline the two), and
// gives the flow a claimedTx to drive. sqlBackend is database/sql's; a
// pgx-native backend plugs in here.
type txBackend interface {
	// beginClaim does what must precede the claim outside any transaction
	// (the table check, preparing statements: they take a connection, and
	// the transaction may hold the last one), begins the delivery's
	// transaction on d.txCtx and claims d's key under d.sctx. claimed false
	// is a duplicate. A non-nil claimedTx, also with an error, is open and
	// left to the flow to roll back.
	beginClaim(d *delivery) (tx claimedTx, claimed bool, err error)
}

// claimedTx is a delivery's open transaction, as the flow drives it.
type claimedTx interface {
	// newState sets s to what the handler's context carries
	// (TxFromContext, OutboxFromContext), calling Config.Outbox.
	newState(ib *Inbox, s *txState) error
	// stillClaimed runs the dialect's pre-commit check (true where the
	// dialect has none).
	stillClaimed(ctx context.Context, consumer, id string) (bool, error)
	// storedFingerprint reads the fingerprint stored with a key the claim
	// found processed: nil when the row has none (written before the
	// column existed); backend.ErrKeyGone when the row is gone (a purge
	// deleted it after the claim saw it).
	storedFingerprint(ctx context.Context, consumer, id string) ([]byte, error)
	// ended reports, without a round trip, whether the transaction has
	// already ended on the server: the handler committed or rolled it back
	// itself. False when the driver cannot tell.
	ended() bool
	commit() error
	// rollback rolls back; after commit, or a rollback, it does nothing.
	rollback() error
}

// lastStatementCommitter is a claimedTx that can send the transaction's
// last statement with its COMMIT, in one round trip (nativeTx).
type lastStatementCommitter interface {
	// commitWith runs query with args and then COMMIT: stmtErr is query's
	// error (COMMIT did not run, the transaction is still open); otherwise
	// commitErr is what commit would have returned.
	commitWith(query string, args []any) (stmtErr, commitErr error)
}

// sqlBackend is the database/sql backend.
type sqlBackend struct{ ib *Inbox }

// beforeBegin does what every backend must do before a delivery's
// transaction begins, on DB: the table check before the first claim, and
// with the dialect's key lock, resolving how it is taken (both take a
// connection, and the transaction may hold the last one).
func (ib *Inbox) beforeBegin(d *delivery) (lock keyLocking, err error) {
	err = ib.verifyOnce(d.sctx)
	if err == nil {
		err = ib.resolveFingerprints(d.sctx)
	}
	if err != nil {
		// One line, for the router's log of every nacked message; Verify
		// (or Inbox.RouterPlugin) prints the whole report with its DDL.
		if errors.Is(err, ErrTableNotFound) || errors.Is(err, ErrIncompatibleTable) || errors.Is(err, ErrDialectMismatch) ||
			errors.Is(err, ErrInvalidConfig) {
			// Nothing about the message is wrong: wait, so that the
			// broker's redeliveries do not spin, and nack it (transient).
			ib.waitAfterTableError(d.sctx)
			return lock, &misconfiguredError{fmt.Errorf("inbox: %q/%q: %w (Inbox.Verify reports the fix; "+
				"add Inbox.RouterPlugin to the router to fail at startup instead)", d.consumer, d.id, firstLine{err})}
		}
		return lock, d.failedBegin(&wrapped{msg: fmt.Sprintf("inbox: %q/%q", d.consumer, d.id), err: poolerHint(err)})
	}
	if ib.tableFailures.Load() != 0 {
		ib.tableFailures.Store(0)
	}
	if ib.locksKeys {
		if lock, err = ib.resolveKeyLocking(d.sctx); err != nil {
			return lock, d.failedBegin(fmt.Errorf("inbox: %q/%q: %w", d.consumer, d.id, poolerHint(err)))
		}
	}
	return lock, nil
}

func (b sqlBackend) beginClaim(d *delivery) (claimedTx, bool, error) {
	ib := b.ib
	lock, err := ib.beforeBegin(d)
	if err != nil {
		return nil, false, err
	}
	// Before BEGIN: Config.Fingerprint is user code, and a panic in it must
	// not leave a transaction (a pooled connection, SQLite's write lock)
	// that nothing rolls back.
	d.fingerprint = ib.deliveryFingerprint(d)
	var stmt, heldStmt, fpStmt *sqlx.Stmt // nil: run unprepared
	if lock.lockedClaim == "" {
		stmt, heldStmt, fpStmt = ib.preparedClaim(d.sctx)
	}
	d.txStart = time.Now() // Event.Duration: from here, the wait for a connection included
	conn, tx, place, err := ib.beginOnConn(d.txCtx)
	if err != nil && ib.maybeLostConn(d.txCtx, err) {
		conn, tx, place, err = ib.retryBegin(d, err)
	}
	if err != nil {
		if isReadOnlyRefusal(err) { // SQLite's BEGIN IMMEDIATE takes the write lock
			return nil, false, d.readOnlyClaim(err)
		}
		return nil, false, d.failedBegin(fmt.Errorf("inbox: begin transaction for %q/%q: %w", d.consumer, d.id, withCause(d.txCtx, err)))
	}
	t := &d.sqlTx
	*t = sqlTx{ib: ib, conn: conn, tx: tx, place: place, ctx: d.txCtx, heldStmt: heldStmt, fpStmt: fpStmt}
	ib.hooks.begun()
	var n int64
	if lock.lockedClaim != "" {
		// The key lock and the claim in one statement: one round trip.
		args := []any{d.consumer, d.id, keyLockHash(lock.table, d.consumer, d.id)}
		if d.fingerprint != nil {
			args = append(args, d.fingerprint)
		}
		n, err = execRowsAffected(tx.ExecContext(d.sctx, lock.lockedClaim, args...))
		if err != nil {
			ib.forgetKeyLocking() // in case its function was dropped or replaced
		}
	} else {
		if ib.locksKeys {
			if _, err := tx.ExecContext(d.sctx, ib.keyLockSQL, keyLockHash(lock.table, d.consumer, d.id)); err != nil {
				return t, false, d.failedBegin(fmt.Errorf("inbox: lock key %q/%q: %w", d.consumer, d.id, err))
			}
		}
		n, t.sameFingerprint, err = ib.claim(d.sctx, tx, stmt, d.consumer, d.id, d.fingerprint)
	}
	if err != nil {
		if isReadOnlyRefusal(err) {
			return t, false, d.readOnlyClaim(err)
		}
		if isMissingPartition(err, d.ib.table.name) {
			return t, false, d.missingPartitionClaim(err)
		}
		if isPrivilegeRefusal(err) {
			return t, false, d.refusedPrivilegeClaim(err)
		}
		if isUndefinedTable(err) {
			return t, false, d.missingTableClaim(err)
		}
		// Name the table: a missing one is the most common first error.
		return t, false, fmt.Errorf("inbox: claim %q/%q in table %s: %w", d.consumer, d.id, ib.table, poolerHint(err))
	}
	ib.claimSucceeded()
	claimed, ok := ib.dialect.claimed(n)
	if !ok {
		return t, false, fmt.Errorf("%w: %d (claim %q/%q)", ErrUnexpectedRowsAffected, n, d.consumer, d.id)
	}
	return t, claimed, nil
}

// refusedOutputsOf returns the count of refusedOutputs of the handler key.
func (ib *Inbox) refusedOutputsOf(key string) *atomic.Int32 {
	if n, ok := ib.refusedOutputs.Load(key); ok {
		return n.(*atomic.Int32)
	}
	n, _ := ib.refusedOutputs.LoadOrStore(key, new(atomic.Int32))
	ib.anyRefusedOutputs.Store(true)
	return n.(*atomic.Int32)
}

// claimSucceeded ends a run of claims refused as read-only: the next one
// waits the shortest backoff again.
func (ib *Inbox) claimSucceeded() {
	if ib.refusedClaims.Load() != 0 {
		ib.refusedClaims.Store(0)
	}
}

// readOnlyClaim returns the error of a claim that the database refused as
// a write in a read-only transaction or server (isReadOnlyRefusal): a
// replica, or a failover in progress; the message is not at fault. It is
// transient (misconfiguredError), and the delivery waits before it returns
// it, once its transaction is rolled back (100 ms doubling to 5 s over
// consecutive such claims), as for a missing table, so that
// a poison filter keeps the topic and the broker's redeliveries do not
// spin.
func (d *delivery) readOnlyClaim(err error) error {
	d.waitAfterEnd = &d.ib.refusedClaims
	return &misconfiguredError{fmt.Errorf("inbox: claim %q/%q in table %s: %w (a read-only transaction or server:"+
		" a replica, a failover in progress, default_transaction_read_only, a read-only SQLite file): %w",
		d.consumer, d.id, d.ib.table, ErrDatabaseReadOnly, err)}
}

// failedBegin returns the error of a delivery whose connection, BEGIN, key
// lock or table check failed, before its claim: nothing about the message was read or
// written, so whatever the cause it is transient (misconfiguredError where
// IsTransient would not say so by itself), and the delivery waits before it
// returns it, as for a read-only claim (readOnlyClaim's backoff), so that a
// poison filter keeps the topic and the broker's redeliveries do not spin.
// Such causes were poisoned every message that came while they lasted: a
// database restarting behind a proxy that accepts connections and closes
// them (pgx's "unexpected EOF" while connecting; go-sql-driver's plain
// "invalid connection", its retry's and its ping's), a host name that did
// not resolve for a while (a failover's DNS change, a Kubernetes service
// with no ready pod), a TLS or authentication setting changed under a
// running service.
func (d *delivery) failedBegin(err error) error {
	d.waitAfterEnd = &d.ib.refusedClaims
	if IsTransient(err) {
		return err
	}
	return &misconfiguredError{err}
}

// missingPartitionClaim returns the error of a claim that no partition of
// a PostgreSQLPartitioned table accepts (isMissingPartition): none covers
// the database's current time, because nothing made partitions ahead (no
// Purger round, InitializeSchema, CreatePartitions or `inbox partitions`
// for DefaultPartitionsAhead days). The message is not at fault: the error
// wraps ErrIncompatibleTable, is transient, and the delivery waits as for a
// read-only claim (readOnlyClaim). It was not transient, and a poison queue
// filter drained the topic.
func (d *delivery) missingPartitionClaim(err error) error {
	d.waitAfterEnd = &d.ib.refusedClaims
	return &misconfiguredError{fmt.Errorf("inbox: claim %q/%q in table %s: %w: no partition holds the database's current"+
		" time; create partitions ahead (a Purger, InitializeSchema, inbox.CreatePartitions, `inbox partitions`): %w",
		d.consumer, d.id, d.ib.table, ErrIncompatibleTable, err)}
}

// missingTableClaim returns the error of a claim that found no inbox table
// (isUndefinedTable): dropped or renamed after the table's first check
// passed (a migration, a restore, an operator). The message is not at
// fault: the error wraps ErrTableNotFound and is transient, as the first
// check's is, the delivery waits as after that check, and the next
// delivery checks the table again, with its fix. It was the claim's error,
// not transient: the default poison filter took every message, acked, and
// the topic drained into the poison queue.
func (d *delivery) missingTableClaim(err error) error {
	d.ib.verified.Store(false)
	d.waitAfterEnd = &d.ib.tableFailures // once rolled back: the transaction holds a connection
	return &misconfiguredError{fmt.Errorf("inbox: claim %q/%q: %w: %s (dropped or renamed since the inbox checked it;"+
		" InitializeSchema, or Inbox.Verify for the fix): %w", d.consumer, d.id, ErrTableNotFound, d.ib.table, err)}
}

// refusedPrivilegeClaim returns the error of a claim the database refused
// for a privilege the session lacks (isPrivilegeRefusal): a GRANT missing
// on the inbox table, a role changed, or a SET ROLE that a handler left on
// its pooled connection. The message is not at fault: the error is
// transient and the delivery waits as for a read-only claim
// (readOnlyClaim). It was not transient, and a poison queue filter drained
// the topic.
func (d *delivery) refusedPrivilegeClaim(err error) error {
	d.waitAfterEnd = &d.ib.refusedClaims
	return &misconfiguredError{fmt.Errorf("inbox: claim %q/%q in table %s: the database user lacks a privilege on it"+
		" (a missing GRANT: the claim needs SELECT and INSERT on it, and UPDATE on MySQL/MariaDB, on the fingerprint column too when it has one; or a SET ROLE a handler"+
		" left on its connection): %w",
		d.consumer, d.id, d.ib.table, err)}
}

// staleStatement returns the error of a delivery whose statements before
// the handler (the key lock, the table's first check, the catalog reads,
// the claim) failed on a prepared statement missing on the server
// connection, or already there (26000, 42P05): pgx's statement cache
// behind a transaction-mode pooler, or a handler's DEALLOCATE ALL or
// DISCARD ALL on that connection a message before. The message is not at
// fault, and the transaction's connection is discarded (database/sql never
// prepares Config.PrepareStatements' statements again on a connection that
// has them; pgx drops a failed statement from its own cache), so the
// redelivery prepares its statements afresh: the error is transient, with
// the pooler hint, and the delivery waits as for a read-only claim
// (readOnlyClaim), so that a misconfigured pooler's claims do not spin.
// The message was poisoned before, and under Config.PrepareStatements
// every later claim on that connection failed. A handler's own statement
// failing so stays the handler's error (not transient: one that EXECUTEs a
// statement it never prepared fails on every delivery).
func (d *delivery) staleStatement(err error) error {
	if t, ok := d.tx.(*sqlTx); ok {
		t.discardConn = true
	}
	var misconfigured *misconfiguredError
	if errors.As(err, &misconfigured) {
		return err
	}
	d.waitAfterEnd = &d.ib.refusedClaims
	return &misconfiguredError{poolerHint(err)}
}

// beginOnConn begins a message's transaction on a connection it holds as a
// database/sql Conn, so that ended can read the driver connection's
// transaction status (Conn.Raw) without a round trip. As DB.BeginTx does,
// it tries again, at most twice, when the connection turns out dead
// (driver.ErrBadConn).
//
// On SQLite it first takes its place in the database's writerQueue, which
// the returned queuedWrite holds until the transaction ends.
func (ib *Inbox) beginOnConn(ctx context.Context) (*sqlx.Conn, *sqlx.Tx, queuedWrite, error) {
	var place queuedWrite
	if ib.dialect.server() == serverSQLite {
		var err error
		if place, err = sqliteWriterQueue(ib.db.DB).enter(ctx); err != nil {
			return nil, nil, place, err
		}
	}
	for try := 0; ; try++ {
		conn, err := ib.db.Connx(ctx)
		if err != nil {
			place.leave()
			return nil, nil, place, err
		}
		tx, err := conn.BeginTxx(ctx, ib.txOptions)
		if err == nil {
			return conn, tx, place, nil
		}
		conn.Close()
		if try == 2 || !errors.Is(err, driver.ErrBadConn) {
			place.leave()
			return nil, nil, place, err
		}
	}
}

// sqlTx is a delivery's transaction through database/sql.
type sqlTx struct {
	ib       *Inbox
	conn     *sqlx.Conn // the connection tx runs on; closed (back to the pool) when tx ends
	tx       *sqlx.Tx
	place    queuedWrite     // SQLite: the transaction's place in the writerQueue, left when it ends
	ctx      context.Context // the transaction's context (delivery.txCtx)
	heldStmt *sqlx.Stmt      // the pre-commit check, prepared; nil when not prepared
	fpStmt   *sqlx.Stmt      // the stored fingerprint's read, prepared; nil when not prepared
	// sameFingerprint: the claim found the key stored with the same
	// fingerprint or none (MySQL/MariaDB), so storedFingerprint need not read.
	sameFingerprint bool
	// discardConn is set when the connection must not go back to the pool:
	// its prepared statements are not the server's (staleStatement), or its
	// ROLLBACK was refused on the ended context (rollback).
	discardConn bool
	// endedEarly is set when ended found the transaction already ended:
	// the final ROLLBACK may then fail (lib/pq refuses one outside a
	// transaction) without meaning anything. Atomic: the handler's
	// goroutines may publish to the outbox, which asks ended, at once.
	endedEarly atomic.Bool
	// failedSeen is whether the last ended found the transaction failed
	// (PostgreSQL's 'E': a statement failed in it, and COMMIT will roll it
	// back), so that the COMMIT's error can say why.
	failedSeen atomic.Bool
}

// abortedBeforeCommit reports whether the pre-commit check found the
// transaction failed (a statement of the handler failed and the handler
// returned nil without its error).
func (t *sqlTx) abortedBeforeCommit() bool { return t.failedSeen.Load() }

func (t *sqlTx) newState(ib *Inbox, s *txState) error {
	s.tx = t.tx
	if ib.outbox == nil {
		return nil
	}
	return s.setPublisher(t.tx, func() (message.Publisher, error) { return ib.outbox(t.tx) })
}

func (t *sqlTx) stillClaimed(ctx context.Context, consumer, id string) (bool, error) {
	if !t.ib.checksHeld {
		return true, nil
	}
	return t.ib.held(ctx, t.tx, t.heldStmt, consumer, id)
}

func (t *sqlTx) storedFingerprint(ctx context.Context, consumer, id string) ([]byte, error) {
	if t.sameFingerprint {
		return nil, nil // matches: the claim said so
	}
	var fp []byte
	var err error
	if t.fpStmt == nil {
		err = t.tx.QueryRowxContext(ctx, t.ib.storedFingerprint, consumer, id).Scan(&fp)
	} else {
		txStmt := t.tx.Tx.StmtContext(ctx, t.fpStmt.Stmt)
		err = txStmt.QueryRowContext(ctx, consumer, id).Scan(&fp)
		txStmt.Close()
	}
	if errors.Is(err, sql.ErrNoRows) {
		return nil, backend.ErrKeyGone
	}
	return fp, err
}

// endedByClaimRead is ended for a driver connection that gives no
// transaction status (a wrapper that hides it): the dialect's
// statuslessCheck asks the server, one round trip, whether the transaction
// that made the claim is still open (not after the handler's ROLLBACK or
// COMMIT), and a transaction database/sql has ended (tx.Commit,
// tx.Rollback) is ended. Where the dialect has no such check (MySQL's
// pre-commit check runs anyway; SQLite refuses the COMMIT), or the check
// fails otherwise (an aborted transaction, whose COMMIT reports it), it is
// not. Like the status it stands for, it does not see a ROLLBACK followed
// by a BEGIN.
func (t *sqlTx) endedByClaimRead() bool {
	if t.ib.statuslessSQL == "" {
		return false
	}
	t.ib.statuslessNoted.Do(func() {
		t.ib.logger.get().Info("Inbox: the database/sql driver connection gives no transaction status (an instrumentation"+
			" wrapper that keeps it unexported?): before each COMMIT and outbox write the inbox reads its claim, one"+
			" round trip more, so that a handler's ROLLBACK is not acked", nil)
	})
	n, err := execRowsAffected(t.tx.ExecContext(t.ctx, t.ib.statuslessSQL))
	switch {
	case errors.Is(err, sql.ErrTxDone):
		return t.ctx.Err() == nil // not the commit bound's rollback
	case err != nil:
		// PostgreSQL refuses the read in a failed transaction: the status
		// a driver that gives none cannot tell (failedTxError).
		t.failedSeen.Store(hasSQLState(err, "25P02"))
		return false
	}
	return n == 0
}

// claimHeldOnConn runs query, a count of the claim's row (bind parameters:
// consumer, id), on the transaction's driver connection inside Conn.Raw, so
// that database/sql holds the connection from the query to the last row
// read: through the Tx, it gives the connection back once the query is
// sent, and a statement another goroutine runs on the transaction before
// the rows are read breaks a go-sql-driver/mysql connection. It reports
// whether the count is above 0.
func (t *sqlTx) claimHeldOnConn(ctx context.Context, query, consumer, id string) (held bool, err error) {
	rawErr := t.conn.Raw(func(dc any) error {
		var n int64
		n, err = driverQueryCount(ctx, dc, query, consumer, id)
		held = n > 0
		return nil
	})
	if rawErr != nil {
		return false, rawErr
	}
	return held, err
}

// doneByDatabaseSQL reports whether database/sql has ended the Tx (the
// handler's tx.Commit or tx.Rollback): a statement on it is then refused
// with sql.ErrTxDone before anything is sent. Otherwise the statement, a
// SELECT 1, runs: a round trip, so only where a failure is already known.
func (t *sqlTx) doneByDatabaseSQL(ctx context.Context) bool {
	_, err := t.tx.ExecContext(ctx, "SELECT 1")
	return errors.Is(err, sql.ErrTxDone)
}

// driverQueryCount runs query, whose one row's first column is a count, on
// the driver connection dc with args, and returns the count: through the
// connection's QueryerContext, or, when it declines (driver.ErrSkip, as
// go-sql-driver/mysql does for arguments without interpolateParams), a
// statement it prepares.
func driverQueryCount(ctx context.Context, dc any, query string, args ...string) (int64, error) {
	named := make([]driver.NamedValue, len(args))
	for i, a := range args {
		named[i] = driver.NamedValue{Ordinal: i + 1, Value: a}
	}
	var rows driver.Rows
	err := driver.ErrSkip
	if q, ok := dc.(driver.QueryerContext); ok {
		rows, err = q.QueryContext(ctx, query, named)
	}
	if errors.Is(err, driver.ErrSkip) {
		var stmt driver.Stmt
		var perr error
		if p, ok := dc.(driver.ConnPrepareContext); ok {
			stmt, perr = p.PrepareContext(ctx, query)
		} else if c, ok := dc.(driver.Conn); ok {
			stmt, perr = c.Prepare(query)
		} else {
			return 0, fmt.Errorf("inbox: the driver connection %T cannot prepare a statement", dc)
		}
		if perr != nil {
			return 0, perr
		}
		defer stmt.Close()
		if sq, ok := stmt.(driver.StmtQueryContext); ok {
			rows, err = sq.QueryContext(ctx, named)
		} else {
			values := make([]driver.Value, len(args))
			for i, a := range args {
				values[i] = a
			}
			//lint:ignore SA1019 a driver statement without StmtQueryContext has only this
			rows, err = stmt.Query(values)
		}
	}
	if err != nil {
		return 0, err
	}
	defer rows.Close()
	dest := make([]driver.Value, len(rows.Columns()))
	if err := rows.Next(dest); err != nil {
		return 0, err // io.EOF included: a count has a row
	}
	switch v := dest[0].(type) {
	case int64:
		return v, nil
	case []byte:
		return strconv.ParseInt(string(v), 10, 64)
	case string:
		return strconv.ParseInt(v, 10, 64)
	default:
		return 0, fmt.Errorf("inbox: a count of type %T", dest[0])
	}
}

// ended asks the driver connection, through Conn.Raw, what the server last
// said about its transaction (see driverTxEnded); where it cannot tell,
// endedByClaimRead decides.
func (t *sqlTx) ended() bool {
	var status byte
	var known bool
	_ = t.conn.Raw(func(dc any) error {
		status, known = driverTxStatus(dc)
		return nil
	})
	ended := known && status == 'I'
	// As of this check: a handler that rolled back to a savepoint after
	// the failure has a working transaction again.
	t.failedSeen.Store(known && status == 'E')
	if !known {
		ended = t.endedByClaimRead()
	}
	if ended {
		t.endedEarly.Store(true) // the transaction does not open again
	}
	return ended
}

// commit commits and gives the connection back to the pool. A COMMIT that
// the driver refuses for want of a transaction (SQLite), or that
// database/sql refuses because the handler called tx.Commit or tx.Rollback
// (sql.ErrTxDone while the transaction's context is live: not a rollback
// for an ended context), is ErrTransactionEnded.
func (t *sqlTx) commit() error {
	err := t.tx.Commit()
	t.conn.Close()
	t.place.leave()
	if err != nil && (commitFoundNoTx(err) || (errors.Is(err, sql.ErrTxDone) && t.ctx.Err() == nil)) {
		t.endedEarly.Store(true)
		return fmt.Errorf("%w: %w", ErrTransactionEnded, err)
	}
	return err
}

// rollback ignores sql.ErrTxDone: the transaction committed, was rolled
// back, or was rolled back by database/sql when its context ended. It gives
// the connection back to the pool. A ROLLBACK the driver refused to send
// because the transaction's context had ended (pgx's stdlib: "context
// already done", before database/sql's own rollback on that context ran)
// leaves the transaction open on its connection, which is then discarded
// (Conn.Raw returning driver.ErrBadConn): closing it ends the transaction
// on the server. Nothing was committed, so nothing is in doubt. It was
// reported as a failed rollback, which IsTransient accepts, and a handler's
// permanent error returned after a Timeout middleware's deadline was
// redelivered for ever instead of poisoned.
func (t *sqlTx) rollback() error {
	err := t.tx.Rollback()
	if err != nil && t.ctx.Err() != nil && errors.Is(err, t.ctx.Err()) {
		t.discardConn, err = true, nil
	}
	if t.discardConn {
		t.conn.Raw(func(any) error { return driver.ErrBadConn }) //nolint:errcheck // it returns the ErrBadConn it is given
	}
	t.conn.Close()
	t.place.leave()
	if err != nil && !errors.Is(err, sql.ErrTxDone) && !t.endedEarly.Load() {
		return err
	}
	return nil
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
func (ib *Inbox) retryBegin(d *delivery, firstErr error) (*sqlx.Conn, *sqlx.Tx, queuedWrite, error) {
	if !ib.logger.nop() {
		fields := d.fields()
		fields["error"] = firstErr.Error()
		ib.logger.get().Debug("Inbox: BEGIN lost its connection, retrying once", fields)
	}
	d.span.AddEvent("inbox.begin_retried", trace.WithAttributes(attribute.String("error", firstErr.Error())))
	ctx := d.txCtx
	conn, tx, place, err := ib.beginOnConn(ctx)
	if err != nil && ib.maybeLostConn(ctx, err) {
		if pingErr := ib.db.PingContext(ctx); pingErr == nil || IsTransient(pingErr) {
			err = &lostConnError{err}
		}
	}
	return conn, tx, place, err
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
