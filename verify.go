package inbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
)

// Verify checks that the inbox table exists and has the shape the inbox
// relies on, reading only the catalog (no DDL, no lock on the table). It
// returns nil for a table made by InitializeSchema or from schema/, an error
// wrapping ErrTableNotFound for a missing table, and one wrapping
// ErrIncompatibleTable that names every problem and the DDL that fixes it
// for a table that could merge, truncate or reject message ids (see
// ErrIncompatibleTable). Other errors are the database's, wrapped.
//
// First it checks that the dialect matches the database server behind DB
// (one query, once per Inbox): a dialect for another server (a PostgreSQL
// database opened under the driver name "mysql", Config.Dialect MySQL on
// SQLite) gives an error wrapping ErrDialectMismatch that names both and
// the fix, instead of the syntax errors the first statement would give.
//
// Call it at startup when your migrations own the table, before the router
// consumes (or add Inbox.RouterPlugin to the router), so that a missing or
// wrong table stops the process instead of nacking every message. The
// middleware runs the same checks once before its first claim, and
// InitializeSchema runs them too. It is safe for
// concurrent use and works behind a transaction-mode connection pooler (on
// PostgreSQL it reads in one short transaction).
//
// It also finds whether the table has the fingerprint column that detects
// reused message ids (Config.ReusedIDs): without it the check is off and
// Verify logs, once, at Info, the ALTER TABLE that adds it
// (AddFingerprintColumnSQL); a missing column is not an error. On
// PostgreSQLPartitioned it also looks for the table's claim function (the
// overload that stores the fingerprint, when the column is there), and
// logs, once, at Info, the CREATE FUNCTION when it is missing or not as
// InitializeSchema makes it: each claim then takes one round trip more
// (not with pgxinbox, which calls none).
// Both lines go to Config.Logger (with the default, nowhere until
// RouterPlugin gives the router's): a readiness check that wants them
// reads ReusedIDsDetected after Verify, or runs inbox schema -verify,
// which prints them.
//
// Last it checks that the database takes writes: a statement that writes
// nothing (an INSERT of no row), in a transaction begun as a
// message's and rolled back; a replica or read-only sessions give an error
// wrapping ErrDatabaseReadOnly instead of a router whose every claim is
// refused.
//
// With Config.OutboxTables it also checks that each of those tables exists
// (an error wrapping ErrTableNotFound that names the outbox table). A
// prepared-statement error that a transaction-mode pooler causes (SQLSTATE
// 42P05 or 26000, pgx's default statement cache behind PgBouncer) comes
// back with the fix.
func (ib *Inbox) Verify(ctx context.Context) error {
	if err := ib.server.check(ctx, ib); err != nil {
		return err
	}
	if err := ib.verifyTables(ctx); err != nil {
		return err
	}
	ib.verified.Store(true) // the middleware need not check again
	if err := ib.resolveFingerprints(ctx); err != nil {
		return err
	}
	if ib.dialect.claimFunctionSQL(ib.table, false) != "" {
		// Logs, once, a claim function that is missing.
		if _, err := ib.resolveKeyLocking(ctx); err != nil {
			return fmt.Errorf("inbox: verify %s: %w", ib.table, err)
		}
	}
	return ib.verifyWritable(ctx)
}

// verifyWritable checks that the database takes writes in a transaction
// begun as a message's is (Config.IsoLevel; on SQLite in its place among
// the writers): it runs the dialect's write probe, which writes nothing,
// and rolls back. A refusal gives an error wrapping ErrDatabaseReadOnly; a
// database too busy to tell (a lock it could not take) passes.
func (ib *Inbox) verifyWritable(ctx context.Context) error {
	err := ib.inRolledBackTx(ctx, func(tx *sqlx.Tx) error {
		if setup := ib.dialect.writeProbeLockTimeout(); setup != "" {
			if _, err := tx.ExecContext(ctx, setup); err != nil {
				return err
			}
		}
		if _, err := tx.ExecContext(ctx, ib.dialect.writeProbeSQL(ib.table)); err != nil {
			return err
		}
		if ib.fingerprints.Load() != fingerprintsOn {
			return nil
		}
		if probe := ib.dialect.fingerprintWriteProbeSQL(ib.table); probe != "" {
			if _, err := tx.ExecContext(ctx, probe); err != nil {
				if isPrivilegeRefusal(err) {
					return ib.fingerprintNotGrantedError(err)
				}
				return err
			}
		}
		return nil
	})
	switch {
	case err == nil:
		return nil
	case errors.Is(err, ErrIncompatibleTable):
		return err // the fingerprint column's privileges
	case isConflict(err) || hasSQLState(err, "57014"):
		// Busy or locked (SQLite while another process writes, a lock
		// wait PostgreSQL or MySQL gave up on, by the dialect's bound or a
		// role's lock_timeout or statement_timeout): Verify read only the
		// catalog before it had this check, which never waits, and a busy
		// SQLite file failed the router's start. PostgreSQL takes the
		// table's lock before it checks for a read-only transaction, so
		// the dialect's lock-free read decides there.
		return ib.verifyNotReadOnlyTx(ctx, err)
	case isReadOnlyRefusal(err):
		return fmt.Errorf("%w: a write to %s in a transaction begun as a message's was refused (DB reaches a replica,"+
			" a server being demoted in a failover, or read-only sessions: default_transaction_read_only,"+
			" transaction_read_only, SQLite's query_only or a read-only file): %w", ErrDatabaseReadOnly, ib.table, err)
	default:
		return fmt.Errorf("inbox: check that %s takes writes: %w", ib.table, poolerHint(err))
	}
}

// verifyTables checks the inbox table and Config.OutboxTables, in one
// read-only unit of work.
func (ib *Inbox) verifyTables(ctx context.Context) error {
	err := withReadTx(ctx, ib.db, ib.dialect, func(q sqlx.QueryerContext) error {
		if err := verifyTable(ctx, q, ib.dialect, ib.table); err != nil {
			return err
		}
		return verifyOutboxTables(ctx, q, ib.dialect, ib.outboxTables)
	})
	return poolerHint(err)
}

// VerifyTimeout bounds the check that Inbox.RouterPlugin runs.
const VerifyTimeout = 30 * time.Second

// RouterPlugin is a Watermill router plugin that runs Verify before the
// router subscribes to anything: add it with router.AddPlugin(ib.RouterPlugin),
// and router.Run returns Verify's error (errors.Is matches ErrTableNotFound,
// ErrIncompatibleTable and ErrDialectMismatch through the router's wrapping;
// the outbox tables of Config.OutboxTables are checked too) instead of
// starting handlers that would nack every message. The check is bounded by
// VerifyTimeout. Router plugins run once, in router.Run, before its
// handlers start (a Watermill convention). A database that refuses writes
// (ErrDatabaseReadOnly: a failover in progress, or a DSN that reaches a
// replica) is checked again every second, logged at Info, until it takes
// them or VerifyTimeout ends. Without a Config.Logger, the inbox logs to the
// router's logger from then on.
func (ib *Inbox) RouterPlugin(r *message.Router) error {
	ib.logger.adoptRouters(r)
	ctx, cancel := context.WithTimeout(context.Background(), VerifyTimeout)
	defer cancel()
	for {
		err := ib.Verify(ctx)
		if !errors.Is(err, ErrDatabaseReadOnly) {
			return err
		}
		ib.logger.get().Info("Inbox: the database refuses writes; waiting for it to take them (a failover in progress?)",
			watermill.LogFields{"error": err.Error()})
		select {
		case <-ctx.Done():
			return err
		case <-time.After(readOnlyRecheck):
		}
	}
}

// verifyNotReadOnlyTx asks, with the dialect's lock-free read
// (readOnlyTxSQL), whether a transaction begun as a message's refuses
// writes, after the write probe met lockErr: ErrDatabaseReadOnly when it
// does, nil when it does not or nothing tells.
func (ib *Inbox) verifyNotReadOnlyTx(ctx context.Context, lockErr error) error {
	query := ib.dialect.readOnlyTxSQL()
	if query == "" {
		return nil
	}
	var readOnly bool
	err := ib.inRolledBackTx(ctx, func(tx *sqlx.Tx) error { return tx.QueryRowContext(ctx, query).Scan(&readOnly) })
	switch {
	case err != nil:
		return fmt.Errorf("inbox: check that %s takes writes: %w", ib.table, err)
	case readOnly:
		return fmt.Errorf("%w: transactions begun as a message's are read-only (DB reaches a replica, or sessions with"+
			" default_transaction_read_only); the write to %s met a lock first: %w", ErrDatabaseReadOnly, ib.table, lockErr)
	}
	return nil
}

// inRolledBackTx runs f in a transaction begun as a message's is (on
// SQLite in its place among the writers) and rolls it back: f's error, or
// else BEGIN's or ROLLBACK's.
func (ib *Inbox) inRolledBackTx(ctx context.Context, f func(tx *sqlx.Tx) error) error {
	conn, tx, place, err := ib.beginOnConn(ctx)
	if err != nil {
		return err
	}
	defer place.leave()
	defer conn.Close()
	if err := f(tx); err != nil {
		_ = tx.Rollback() // f's error says what went wrong
		return err
	}
	if err := tx.Rollback(); err != nil {
		return fmt.Errorf("roll back: %w", err)
	}
	return nil
}

// readOnlyRecheck is how long RouterPlugin waits before it checks again
// whether a database that refused writes takes them.
const readOnlyRecheck = time.Second

// serverKind is a database server family, as a message names it.
type serverKind string

const (
	serverPostgreSQL serverKind = "PostgreSQL"
	serverMySQL      serverKind = "MySQL/MariaDB"
	serverSQLite     serverKind = "SQLite"
)

// serverFix is what a mismatch message tells the user to configure for a
// server family: the dialects and the driver names that infer one.
var serverFix = map[serverKind]string{
	serverPostgreSQL: `Dialect to inbox.PostgreSQL (or inbox.PostgreSQLPartitioned), or leave it nil and use the driver name "pgx" or "postgres" (sqlx.NewDb(db, "pgx"))`,
	serverMySQL:      `Dialect to inbox.MySQL, or leave it nil and use the driver name "mysql" (sqlx.NewDb(db, "mysql"))`,
	serverSQLite:     `Dialect to inbox.SQLite, or leave it nil and use the driver name "sqlite" or "sqlite3" (sqlx.NewDb(db, "sqlite"))`,
}

// Probes of the server: each is valid SQL on some servers only, and a
// probe that fails is itself an answer. version() exists on PostgreSQL
// ("PostgreSQL 15.5 on ...") and MySQL/MariaDB ("8.0.36", "10.11.6-MariaDB-..."),
// not on SQLite; sqlite_version() only on SQLite.
const (
	versionProbe = "SELECT version()"
	sqliteProbe  = "SELECT sqlite_version()"
)

// mysqlVersion matches the start of MySQL's and MariaDB's version().
var mysqlVersion = regexp.MustCompile(`^[0-9]+\.[0-9]+`)

// identifyServer returns the server family behind db and its version as
// the server reports it ("15.5", "10.11.6-MariaDB-...", "3.46.0"), or
// "" when no probe identifies it (a server of another kind, or one that
// cannot be reached: the statements after it report that). It runs the
// probe that succeeds on the server want first: one query when the dialect
// matches. Each probe is one statement outside any transaction.
func identifyServer(ctx context.Context, db *sqlx.DB, want serverKind) (serverKind, string) {
	probes := []string{versionProbe, sqliteProbe}
	if want == serverSQLite {
		probes = []string{sqliteProbe, versionProbe}
	}
	for _, probe := range probes {
		var v string
		if err := db.QueryRowContext(ctx, probe).Scan(&v); err != nil {
			continue
		}
		switch {
		case probe == sqliteProbe:
			return serverSQLite, v
		case strings.HasPrefix(v, "PostgreSQL "):
			// "PostgreSQL 15.5 (Debian 15.5-0+deb12u1) on x86_64-pc-linux-gnu, compiled by ..."
			return serverPostgreSQL, strings.Fields(v)[1]
		case mysqlVersion.MatchString(v):
			return serverMySQL, v
		}
		return "", v
	}
	return "", ""
}

// serverMismatch identifies the server behind db (identifyServer) and
// returns its family ("" when no probe identifies it) and, when dialect d
// is for another family, an error wrapping ErrDialectMismatch that names
// both, db's driver type, how d was chosen (how), and the configuration
// that fixes it.
func serverMismatch(ctx context.Context, db *sqlx.DB, d Dialect, how, config string) (serverKind, error) {
	want := d.server()
	found, version := identifyServer(ctx, db, want)
	if found == "" || found == want {
		return found, nil
	}
	return found, fmt.Errorf("%w: the dialect is %s (%s), which is for %s, but DB (driver %T) is %s (version %s): set %s.%s",
		ErrDialectMismatch, d, how, want, db.Driver(), found, version, config, serverFix[found])
}

// serverCheck is a check, run on first use and remembered once it has an
// answer, that a dialect matches the server behind a DB: an Inbox's (Verify,
// InitializeSchema, the middleware's first message) and an Outbox's (Verify,
// InitializeSchema, Stats, RequeueDeadLetters), so that later calls cost
// nothing. It is safe for concurrent use.
type serverCheck struct {
	mu   sync.Mutex
	done bool  // the check had an answer
	err  error // the mismatch found, or nil
}

// once returns the remembered answer, or runs f, remembering its error
// when it reports that it had an answer (known). f runs without the lock:
// callers that meet no answer yet each run their own (reads, bounded by
// each caller's context), so that a caller waiting on a server that does
// not answer (a relay round with a long context) does not hold back
// another whose context is shorter (Stats, which the metrics module
// scrapes with a deadline). The first answer is kept.
func (c *serverCheck) once(f func() (known bool, err error)) error {
	c.mu.Lock()
	done, err := c.done, c.err
	c.mu.Unlock()
	if done {
		return err
	}
	known, err := f()
	if !known {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.done {
		c.done, c.err = true, err
	}
	return c.err
}

// checkServer returns nil when o's dialect is for the server behind its DB
// (or the server cannot be identified), and otherwise an error wrapping
// ErrDialectMismatch (serverMismatch). A mismatch gave the driver's syntax
// errors (an Outbox or "inbox requeue -dialect mysql" on PostgreSQL), or,
// on the relay's catalog read, a table taken for present. Sessions the
// Outbox cannot use give an error wrapping ErrInvalidConfig
// (sessionProblem), as the Inbox's check gives.
func (o *Outbox) checkServer(ctx context.Context) error {
	return o.server.once(func() (bool, error) {
		known, err := o.checkSessions(ctx, sessionOutbox)
		if !known || err != nil || o.dialect.server() != serverSQLite {
			return known, err
		}
		// A SQLite file opened read-only (mode=ro, a read-only file or
		// mount): the relay read and published its messages, failed to
		// record them, and sent them again every round. A DELETE of no row
		// of the outbox table asks for the write lock, and is refused there
		// (SQLITE_READONLY); before the table exists, the next use asks.
		t := o.target().table
		_, err = o.cfg.DB.ExecContext(ctx, "DELETE FROM "+t.quoted(o.dialect)+" WHERE 0")
		switch {
		case isReadOnlyRefusal(err):
			return true, fmt.Errorf("%w: the SQLite database of OutboxConfig.DB cannot be written (opened with mode=ro, a read-only"+
				" file or mount): the relay could read and publish its messages but not record them, and would send them again"+
				" every round; open it read-write: %w", ErrInvalidConfig, err)
		case err != nil:
			return false, nil
		}
		return true, nil
	})
}

// checkSessions checks that o's dialect is for the server behind its DB
// (serverMismatch) and that its sessions can serve use (sessionProblem).
func (o *Outbox) checkSessions(ctx context.Context, use sessionUse) (known bool, err error) {
	how := "OutboxConfig.Dialect"
	if o.dialectInferred {
		how = fmt.Sprintf("inferred from DB's driver name %q", o.cfg.DB.DriverName())
	}
	found, err := serverMismatch(ctx, o.cfg.DB, o.dialect, how, "OutboxConfig")
	if found == "" || err != nil {
		return found != "", err
	}
	return sessionProblem(ctx, o.cfg.DB, found, use, "OutboxConfig.DB")
}

// checkReadServer is checkServer for what only reads (Stats, which a
// monitoring pool that cannot write may run): the dialect, and the session
// settings that break reads (sessionReads), not those only the relay's
// writes need (sessionOutboxReads).
func (o *Outbox) checkReadServer(ctx context.Context) error {
	return o.readServer.once(func() (bool, error) { return o.checkSessions(ctx, sessionOutboxReads) })
}

// check returns nil when ib's dialect is for the server behind ib's DB (or
// the server cannot be identified), and otherwise an error wrapping
// ErrDialectMismatch that names both, DB's driver type, and the
// configuration that fixes it. The server's own answer decides, not the
// driver's type, which a wrapping driver (an instrumented database/sql
// driver) hides. Sessions the inbox cannot use give an error wrapping
// ErrInvalidConfig (sessionProblem).
func (c *serverCheck) check(ctx context.Context, ib *Inbox) error {
	return c.once(func() (bool, error) {
		how := "Config.Dialect"
		if ib.dialectInferred {
			how = fmt.Sprintf("inferred from DB's driver name %q", ib.db.DriverName())
		}
		found, err := serverMismatch(ctx, ib.db, ib.dialect, how, "Config")
		if found == "" || err != nil {
			return found != "", err
		}
		return sessionProblem(ctx, ib.db, found, sessionInbox, "DB")
	})
}

// sessionUse is what a session check is for: what the sessions must allow.
type sessionUse int

const (
	sessionInbox  sessionUse = iota // the claims and the handlers' transactions
	sessionOutbox                   // the relay, its reads, deletes and writers
	sessionReads                    // Purge and Stats: reads, and deletes by key
	// sessionOutboxReads is Outbox.Stats: reads outside a transaction of
	// its own, which autocommit off leaves open on the pooled session (the
	// next read there sees its old snapshot).
	sessionOutboxReads
)

// sessionProblem reads a session of db, on a server of kind, and returns an
// error wrapping ErrInvalidConfig that names the setting, the configuration
// field and the fix when its sessions cannot serve use; known is false when
// the session could not be read (the next use asks again).
//   - MySQL/MariaDB: strings sent in another character set than the server
//     reads them in (@@character_set_client from the DSN or init_connect,
//     against @@character_set_connection: every string parameter is
//     converted on its way in, message ids, consumers, topics, UUIDs);
//     completion_type other than NO_CHAIN (each COMMIT opens the session's
//     next transaction: a BEGIN with an isolation level then fails, 1568,
//     and statements meant to commit alone run in a transaction nobody
//     commits); the driver's columnsWithAlias=true (every column named
//     table.column: no read of the library's finds its columns); for the
//     inbox and the outbox, autocommit off; for the outbox,
//     sql_safe_updates (its DELETE by a JSON_TABLE join is refused, 1175,
//     after the broker has the messages) and no default database (the same
//     DELETE fails with 1046): the relay sent its batch again every round.
//   - PostgreSQL: a client_encoding other than UTF8 (a DSN's, a role's or a
//     database's setting): the server converts every string, and an id
//     stored by a UTF8 session was another id to a LATIN1 one, whose
//     instance processed the message again.
//   - SQLite: read_uncommitted on, for the inbox and the outbox (with a
//     shared cache the relay read a handler's outputs before it committed,
//     and sent those of a transaction that rolled back); for the outbox,
//     query_only (the relay published, then failed to record it, and sent
//     its batch again every round).
func sessionProblem(ctx context.Context, db sqlx.QueryerContext, kind serverKind, use sessionUse, field string) (known bool, err error) {
	switch kind {
	case serverMySQL:
		return mysqlSessionProblem(ctx, db, use, field)
	case serverPostgreSQL:
		// A SQL_ASCII database converts nothing: its bytes are compared as
		// they are whatever the client's encoding.
		var encoding, serverEncoding string
		if err := db.QueryRowxContext(ctx, "SELECT current_setting('client_encoding'), current_setting('server_encoding')").
			Scan(&encoding, &serverEncoding); err != nil {
			return false, nil
		}
		if encoding != "UTF8" && serverEncoding != "SQL_ASCII" {
			return true, fmt.Errorf("%w: the PostgreSQL sessions of %s have client_encoding %s (from the DSN, or an ALTER ROLE or"+
				" ALTER DATABASE ... SET client_encoding): the server converts every string between it and the database's"+
				" UTF8, so a message id or consumer is stored other than it is, and one stored by a UTF8 session is not"+
				" found by this one, which processes the message again; use client_encoding UTF8 (the drivers' default)",
				ErrInvalidConfig, field, encoding)
		}
	case serverSQLite:
		var readUncommitted, queryOnly int
		if err := db.QueryRowxContext(ctx, "SELECT (SELECT read_uncommitted FROM pragma_read_uncommitted),"+
			" (SELECT query_only FROM pragma_query_only)").Scan(&readUncommitted, &queryOnly); err != nil {
			return false, nil
		}
		switch {
		case readUncommitted != 0 && use != sessionReads:
			// It does something only with a shared cache, which no
			// statement tells: refused either way.
			return true, fmt.Errorf("%w: the SQLite connections of %s have read_uncommitted on (PRAGMA read_uncommitted, from the"+
				" DSN): with a shared cache they read other connections' writes before those commit, and the outbox relay"+
				" sent a handler's outputs whose transaction then rolled back (without a shared cache it does nothing); leave"+
				" read_uncommitted off", ErrInvalidConfig, field)
		case queryOnly != 0 && use == sessionOutbox:
			return true, fmt.Errorf("%w: the SQLite connections of %s have query_only on (PRAGMA query_only, from the DSN): the"+
				" relay could read and publish its messages but not record them, and sent them again every round; use"+
				" connections that can write", ErrInvalidConfig, field)
		}
	}
	return true, nil
}

// mysqlSessionProblem is sessionProblem on MySQL/MariaDB.
func mysqlSessionProblem(ctx context.Context, db sqlx.QueryerContext, use sessionUse, field string) (known bool, err error) {
	// The last column, of a table (a derived one: nothing is read),
	// tells the driver's columnsWithAlias by its name.
	rows, err := db.QueryContext(ctx, "SELECT @@autocommit, @@character_set_client, @@character_set_connection, @@completion_type,"+
		" @@sql_safe_updates, DATABASE(), one.c FROM (SELECT 1 AS c) AS one")
	if err != nil {
		return false, nil
	}
	defer rows.Close()
	columns, err := rows.Columns()
	if err != nil || !rows.Next() {
		return false, nil
	}
	var autocommit, safeUpdates int
	var clientCharset, connectionCharset, completion string
	var database sql.NullString
	var none int
	if err := rows.Scan(&autocommit, &clientCharset, &connectionCharset, &completion, &safeUpdates, &database, &none); err != nil {
		return false, nil
	}
	outbox := use == sessionOutbox
	switch {
	case strings.Contains(columns[len(columns)-1], "."):
		return true, fmt.Errorf("%w: the MySQL connections of %s name each column table.column (the DSN's columnsWithAlias=true):"+
			" the library's reads do not find their columns; leave columnsWithAlias out of the DSN (a pool of its own for"+
			" the inbox if the application needs it)", ErrInvalidConfig, field)
	case clientCharset != connectionCharset:
		return true, fmt.Errorf("%w: the MySQL sessions of %s send strings in character set %s (@@character_set_client,"+
			" from the DSN's character_set_client or the server's init_connect) but the server reads them in %s"+
			" (@@character_set_connection), so it would convert every message id, consumer, topic, UUID and metadata"+
			" value on its way in (a latin1 client's id \"ü\" was stored as four bytes); use sessions whose two character"+
			" sets match (the driver's default, utf8mb4, or the DSN's charset=…)", ErrInvalidConfig, field, clientCharset, connectionCharset)
	case completion != "NO_CHAIN" && completion != "0":
		return true, fmt.Errorf("%w: the MySQL sessions of %s have completion_type %s (from the DSN's completion_type or the"+
			" server's): each COMMIT then opens the session's next transaction at once (CHAIN) or ends the session (RELEASE),"+
			" so the next transaction that begins with an isolation level on that session fails (1568: transaction"+
			" characteristics can't be changed while a transaction is in progress), and the statements meant to commit on"+
			" their own (the purge's DELETEs, Stats' reads) run in a transaction nobody commits; use sessions with"+
			" completion_type NO_CHAIN (MySQL's default)", ErrInvalidConfig, field, completion)
	case autocommit == 0 && use != sessionReads:
		// For the inbox: the statement after a deadlock that rolled the
		// message's transaction back (an error the handler ignored)
		// opens a new transaction of its own, which no status,
		// @@in_transaction or read of the claim tells from the message's.
		return true, fmt.Errorf("%w: the MySQL sessions of %s have autocommit off (@@autocommit = 0, from the DSN's"+
			" autocommit=0 or the server's init_connect/autocommit setting): the inbox cannot then tell a transaction the"+
			" database rolled back from a new one, and would commit a handler's later writes and outputs with the message"+
			" not processed, and a statement the outbox runs outside a transaction of its own (Stats) leaves one open on"+
			" its pooled session, where the relay's next round fails (1568); use sessions with autocommit on (MySQL's"+
			" default)", ErrInvalidConfig, field)
	case safeUpdates != 0 && outbox:
		return true, fmt.Errorf("%w: the MySQL sessions of %s have sql_safe_updates on (the DSN's sql_safe_updates=1, the"+
			" client's --safe-updates or init_connect): the relay's DELETE of the messages it sent is refused (1175) after"+
			" the broker has them, and it would send them again every round; use sessions with sql_safe_updates off",
			ErrInvalidConfig, field)
	case !database.Valid && outbox:
		return true, fmt.Errorf("%w: the MySQL sessions of %s have no default database (the DSN names none): the relay's"+
			" DELETE of the messages it sent fails (1046) after the broker has them, and it would send them again every"+
			" round; name the database in the DSN (…/dbname)", ErrInvalidConfig, field)
	}
	return true, nil
}

// verifySchema runs verifyTable in a read-only unit of work.
func verifySchema(ctx context.Context, db *sqlx.DB, d Dialect, t qualifiedName) error {
	return withReadTx(ctx, db, d, func(q sqlx.QueryerContext) error {
		return verifyTable(ctx, q, d, t)
	})
}

// verifyTable checks table t through q (catalog reads only) with
// d.checkTable. A missing table gives an error wrapping ErrTableNotFound
// with the DDL that creates it; problems give one error wrapping
// ErrIncompatibleTable that lists each with its fix, then the canonical DDL.
func verifyTable(ctx context.Context, q sqlx.QueryerContext, d Dialect, t qualifiedName) error {
	problems, err := d.checkTable(ctx, q, t)
	canonical, _ := SchemaSQL(d, t.String()) // t passed the name pattern
	switch {
	case errors.Is(err, ErrTableNotFound):
		return fmt.Errorf("%w: run InitializeSchema, or apply the DDL of SchemaSQL:\n%s", err, canonical)
	case err != nil:
		return fmt.Errorf("inbox: verify table %q: %w", t.String(), err)
	case len(problems) == 0:
		return nil
	}
	var b strings.Builder
	plural := "s"
	if len(problems) == 1 {
		plural = ""
	}
	fmt.Fprintf(&b, "table %q (%s) has %d problem%s:", t.String(), d, len(problems), plural)
	// A fix of several lines (a table to recreate) is printed once, below
	// the list, however many problems it fixes.
	var scripts []string
	for _, p := range problems {
		if !strings.Contains(p.fix, "\n") {
			fmt.Fprintf(&b, "\n  - %s; fix: %s", p.what, p.fix)
			continue
		}
		n := slices.Index(scripts, p.fix)
		if n < 0 {
			scripts, n = append(scripts, p.fix), len(scripts)
		}
		fmt.Fprintf(&b, "\n  - %s; fix: script %d below", p.what, n+1)
	}
	for i, s := range scripts {
		fmt.Fprintf(&b, "\nscript %d:\n%s", i+1, s)
	}
	fmt.Fprintf(&b, "\ncanonical DDL for comparison:\n%s", canonical)
	return fmt.Errorf("%w: %s", ErrIncompatibleTable, b.String())
}

// nameList formats names for a message: ("consumer", "message_id").
func nameList(names []string) string {
	quoted := make([]string, len(names))
	for i, n := range names {
		quoted[i] = strconv.Quote(n)
	}
	return "(" + strings.Join(quoted, ", ") + ")"
}

// tableProblem is one thing wrong with an existing inbox table.
type tableProblem struct {
	what string // what is wrong, e.g. `column "message_id" has collation "utf8mb4_general_ci", which compares case-insensitively`
	fix  string // the DDL that fixes it, e.g. "ALTER TABLE ... MODIFY ..."; several lines for a table to recreate
}

// problems collects tableProblems.
type problems []tableProblem

func (ps *problems) add(fix, format string, args ...any) {
	*ps = append(*ps, tableProblem{what: fmt.Sprintf(format, args...), fix: fix})
}

// tableNotFound is checkTable's error for a missing table.
func tableNotFound(t qualifiedName) error {
	return fmt.Errorf("%w: %q", ErrTableNotFound, t.String())
}

// oldName is the name a recreate script renames t to: t's name with
// "_old", within 63 bytes.
func oldName(t qualifiedName) qualifiedName {
	name := t.name
	if len(name) > 59 {
		name = name[:59]
	}
	return qualifiedName{schema: t.schema, name: name + "_old"}
}

// keyColumns is the primary key, in order; partitionedKey that of a
// PostgreSQLPartitioned table.
var (
	keyColumns     = []string{"consumer", "message_id"}
	partitionedKey = []string{"consumer", "message_id", "processed_at"}
)

const processedAt = "processed_at"

// --- PostgreSQL ---

// --- MySQL / MariaDB ---

// --- SQLite ---
