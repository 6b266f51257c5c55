package inbox

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"net"
	"reflect"
	"slices"
	"strings"
	"sync"
	"syscall"

	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/puddle/v2"
)

// IsTransient reports whether err is a failure that says nothing about the
// message itself, so that a redelivery of the same message can succeed: a
// serialization failure or deadlock that made the database roll the
// transaction back, a lock or statement timeout, a lost or refused
// connection, a server shutting down, a busy SQLite database, or a message
// context that ended (deadline or cancellation, as when a router stops).
//
// Whatever the inbox returns, its transaction was rolled back or, for a
// COMMIT in doubt (below), possibly committed; so a transient error is
// always safe to nack: the redelivery either processes the message or, if
// its transaction (or a concurrent delivery's) committed, skips it as a
// duplicate. Use it to keep such errors away from a poison queue, which is
// meant for messages that can never succeed:
//
//	poison, err := middleware.PoisonQueueWithFilter(pub, "poison", func(err error) bool {
//		return !inbox.IsTransient(err)
//	})
//
// It looks through the whole error chain (errors.Unwrap, errors.Join), so it
// works on what the middleware, a handler or Purge returns. It recognises
// errors by code, never by text:
//
//   - PostgreSQL (any driver whose errors have a SQLState() string method,
//     such as pgx's *pgconn.PgError and lib/pq's *pq.Error): class 08
//     (connection exception), 40001 (serialization_failure), 40P01
//     (deadlock_detected), 40003 (statement_completion_unknown), 55P03
//     (lock_not_available), 57014 (query_canceled, which includes
//     statement_timeout), 57P01-57P03 (admin or crash shutdown, cannot
//     connect now), 57P05 (idle_session_timeout closed a pooled session),
//     53300 (too_many_connections), 25P03
//     (idle_in_transaction_session_timeout), 25P04 (transaction_timeout,
//     PostgreSQL 17), 0A000 when its routine is RevalidateCachedQuery
//     ("cached plan must not change result type": a statement prepared
//     before a schema change; the driver prepares it again), and the server out of a
//     resource: 53000, 53100 (disk_full), 58030 (io_error). PostgreSQL documents 40001 and
//     40P01 as the errors an application should retry. Not 26000 and 42P05
//     (a prepared statement missing, or already there) in general: a
//     handler that EXECUTEs a statement it never prepared, or PREPAREs one
//     twice, fails so on every delivery; the inbox's own claim failing so
//     is transient (misconfiguredError), and its connection is discarded.
//   - MySQL and MariaDB through github.com/go-sql-driver/mysql
//     (*mysql.MySQLError, matched by type without importing the driver):
//     1213 (ER_LOCK_DEADLOCK), 1205 (ER_LOCK_WAIT_TIMEOUT), 1020
//     (ER_CHECKREAD: MariaDB's snapshot isolation, innodb_snapshot_isolation,
//     ON by default since 11.6, rolled back a REPEATABLE READ transaction
//     that wrote a row changed since its snapshot), 3101 (MySQL Group
//     Replication rolled back a transaction that failed certification),
//     1040 (too many connections), 1203 and 1226 (the user's connection or
//     query limit: max_user_connections, MAX_USER_CONNECTIONS,
//     MAX_QUERIES_PER_HOUR), 1053 (server shutdown), 1317 (query
//     interrupted by KILL QUERY, as 57014 on PostgreSQL), 1927 (MariaDB
//     connection killed), 1969 (MariaDB max_statement_time exceeded), 3024
//     (MySQL max_execution_time exceeded) and 4031 (MySQL 8.0.24+ closed
//     a connection idle past wait_timeout), 1021 (ER_DISK_FULL), 1041
//     (ER_OUT_OF_RESOURCES) and 1114 (ER_RECORD_FILE_FULL). The driver's
//     mysql.ErrInvalidConn is a plain error value that cannot be told apart
//     without importing the driver: alone (from Purge, or a handler's
//     statement outside the inbox) it is not transient; from the
//     middleware it is when it comes with a failed ROLLBACK, or at BEGIN or
//     COMMIT as described below.
//   - SQLite: SQLITE_BUSY, SQLITE_LOCKED, SQLITE_FULL, SQLITE_IOERR and
//     SQLITE_NOMEM, with their extended codes,
//     from modernc.org/sqlite (*sqlite.Error) and github.com/mattn/go-sqlite3
//     (sqlite3.Error). A full database is an outage for every message, but
//     a message too large for the space left (SQLITE_FULL under
//     max_page_count, 53100 or 1114 for one huge row) fails each try while
//     smaller ones pass, and is retried for as long as the space lacks: a
//     poison filter of your own decides when to give up on such a message.
//   - database/sql and the network: driver.ErrBadConn, sql.ErrConnDone,
//     ECONNRESET, ECONNREFUSED, EPIPE, a net.Error
//     that is a timeout, a temporary DNS failure, and a failed dial, read or
//     write (*net.OpError). Not the net package's errors about an address
//     (*net.AddrError, *net.ParseError, url.Parse's *url.Error, a name that
//     does not resolve): they are errors of the message. Nor a bare
//     io.ErrUnexpectedEOF, which is what json.Decoder and binary.Read
//     return for a truncated payload.
//   - Any error with a SafeToRetry() bool method that reports true (but
//     pgx's "conn busy", below): pgx's
//     errors that happened before anything was sent to the server, such as
//     "conn closed" when a transaction's connection was lost earlier (a
//     COMMIT after a statement whose connection error the handler ignored).
//     Outside a transaction pgx's database/sql adapter turns the same errors
//     into driver.ErrBadConn, so that database/sql retries them.
//   - context.DeadlineExceeded and context.Canceled.
//   - The inbox's ErrTxRolledBack: MySQL/MariaDB rolled the transaction back
//     on a deadlock or conflict whose error the handler ignored.
//   - A failed ROLLBACK of the inbox's transaction, whatever its error: the
//     connection is lost (go-sql-driver's plain "invalid connection" when
//     the server closed it during the handler), so the database ends the
//     transaction without committing it.
//   - On MySQL/MariaDB, a BEGIN or COMMIT of the inbox's transaction whose
//     connection was lost after the statement was sent: go-sql-driver's
//     plain "invalid connection", with no MySQLError number (the
//     middleware treats any error without a database code so on the MySQL
//     dialect). After a COMMIT the client does not know whether the server
//     committed: the redelivery settles it, skipping the message as a
//     duplicate if the COMMIT took effect and processing it if not. A BEGIN
//     that failed so started nothing; the middleware retries it once.
//   - Any error of the middleware's own steps before the claim (the table
//     check, a connection, BEGIN, the key lock): nothing about the message
//     was read or written, so the delivery's error is transient whatever
//     its cause (a database restarting behind a proxy that closes
//     connections, a host name that does not resolve for a while, a TLS or
//     authentication setting changed under a running service), and the
//     delivery waits first (100 ms doubling to 5 s over consecutive ones).
//     PostgreSQL drivers report a lost
//     connection as a network or SafeToRetry error (above); pgx's
//     ErrTxCommitRollback, a COMMIT that PostgreSQL turned into ROLLBACK
//     after a failed statement the handler ignored, stays not transient:
//     the statement's error, which could tell, is gone. On PostgreSQL a
//     COMMIT whose connection was lost after it was sent (a network error,
//     pgx's "conn closed", driver.ErrBadConn) is in doubt in the same way,
//     and transient by the rules above.
//   - The inbox's ErrCommitTimeout: the outbox publish, the pre-commit check
//     or COMMIT outlived Config.CommitTimeout, and the COMMIT is in doubt.
//   - A panic that Watermill's Recoverer turned into a
//     middleware.RecoveredPanicError, when its value is an error that is
//     transient by these rules (sqlx's Must* methods panic with the
//     statement's error: a context.Canceled at a shutdown, a deadlock);
//     any other panic is not.
//   - Setup mistakes that say nothing about the message: ErrNoTx (a
//     handler's MissingTxError), a nested inbox (ErrNestedInbox, as the
//     middleware returns it), a missing or incompatible table at message
//     time; a poison filter drained the topic with them.
//   - A shutdown, so that a deploy does not poison the messages in flight:
//     a closed pgxpool.Pool (puddle's ErrClosedPool, which pgxpool returns
//     as it is), a closed *sql.DB (database/sql's "sql: database is
//     closed", matched by identity with the value database/sql returns,
//     never by text), sql.ErrConnDone, and the message context that the
//     router's Close ended (context.Canceled, above).
//   - The middleware's error for a duplicate whose row a purge deleted
//     between the claim and the read of its stored fingerprint
//     (Config.ReusedIDs; PostgreSQL's claim does not lock a row it finds):
//     the redelivery claims the key again and processes the message.
//   - The middleware's error for a claim that failed on a fingerprint
//     column dropped while the process ran (it wraps ErrIncompatibleTable):
//     the check turns off, and the redelivery is processed without it.
//   - The middleware's error for a claim that the database refused as a
//     write in a read-only transaction or server (a hot standby or a
//     replica the DSN points to by mistake, a primary demoted during a
//     failover, default_transaction_read_only, a read-only SQLite file;
//     the codes are isReadOnlyRefusal's: PostgreSQL 25006, MySQL/MariaDB
//     1290, 1792 and 1836, SQLITE_READONLY): nothing about the message is
//     wrong, and it waits as below. The same for a claim refused for a
//     privilege the session lacks (a GRANT missing on the inbox table, a
//     SET ROLE a handler left on its pooled connection; the codes are
//     isPrivilegeRefusal's: PostgreSQL 42501, MySQL/MariaDB 1044, 1142 and
//     1143, SQLITE_AUTH).
//   - The middleware's error for a message that met a missing or
//     incompatible table (ErrTableNotFound, ErrIncompatibleTable, also
//     those of Config.OutboxTables), a dialect for another server
//     (ErrDialectMismatch), MySQL sessions the inbox or the outbox cannot
//     use (ErrInvalidConfig: autocommit off, another character_set_client,
//     completion_type CHAIN), or an outbox table whose id hands out ids
//     its pending rows hold (PostgreSQL's identity restarted by hand: the
//     unique violation on that table), at message time: nothing about the
//     message is wrong, so a poison filter built on IsTransient keeps the
//     topic's messages (a redelivery succeeds once the table is fixed)
//     instead of draining it. The middleware waits before it returns that
//     error, 100 ms doubling to 5 s over consecutive such deliveries, so
//     that a broker's immediate redelivery does not spin. The same
//     sentinels from Verify, InitializeSchema or RouterPlugin stay not
//     transient: they stop the process at startup.
//
// Never transient, whatever else the chain holds (a failed ROLLBACK after
// them): bugs of the handler that a redelivery repeats. The inbox's
// ErrTransactionEnded (the handler committed or rolled back the inbox
// transaction itself), and pgx's "conn busy" (pgconn's lock error for a
// connection used while rows of an earlier query were still open, or
// "conn uninitialized"), which pgx marks SafeToRetry but exports no
// sentinel for: it is recognised by its type, as a lock error that does
// not wrap pgconn.ErrConnClosed (a closed connection's stays transient).
//
// Everything else is not transient, including the inbox's own
// ErrInvalidMessageID and ErrInvalidConsumer (the message can never be
// claimed), ErrTableNotFound and ErrIncompatibleTable from Verify,
// InitializeSchema and RouterPlugin (see above) and constraint
// violations other than the outbox table's above. IsTransient(nil) is false. It is safe
// for concurrent use.
func IsTransient(err error) bool {
	if err == nil {
		return false
	}
	// Bugs of the handler first: whatever else the chain holds (a failed
	// ROLLBACK after them), a redelivery runs the same handler.
	if errors.Is(err, ErrTransactionEnded) || anyInChain(err, isPgconnMisuse) {
		return false
	}
	if isShutdown(err) {
		return true
	}
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) || errors.Is(err, ErrTxRolledBack) ||
		errors.Is(err, driver.ErrBadConn) || errors.Is(err, sql.ErrConnDone) || errors.Is(err, syscall.ECONNRESET) ||
		errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.EPIPE) {
		return true
	}
	var rbErr *rollbackError
	if errors.As(err, &rbErr) || isNetworkFailure(err) {
		return true
	}
	var lcErr *lostConnError
	var mcErr *misconfiguredError
	if errors.As(err, &lcErr) || errors.Is(err, ErrCommitTimeout) || errors.As(err, &mcErr) || errors.Is(err, errKeyPurged) ||
		errors.Is(err, ErrNoTx) {
		return true
	}
	var panicked middleware.RecoveredPanicError
	if errors.As(err, &panicked) {
		// A panic with an error (sqlx's Must* methods panic with the
		// statement's) is what returning that error would be: a Must*
		// statement cut off by a shutdown poisoned its message.
		if v, ok := panicked.V.(error); ok && v != nil {
			return IsTransient(v)
		}
	}
	return anyInChain(err, func(e error) bool { _, transient, _ := classifyDriverError(e); return transient })
}

// isShutdown reports whether err says that the process is shutting down
// the inbox's database handle under it: pgxpool's closed pool (puddle's
// exported ErrClosedPool, which pgxpool.Pool.Acquire returns as it is), or
// a closed *sql.DB. database/sql reports the latter with an unexported
// sentinel ("sql: database is closed"); errDBClosed obtains that very value
// from a closed DB once, so that errors.Is matches it by identity, never by
// text. sql.ErrConnDone and a cancelled context are matched in IsTransient.
func isShutdown(err error) bool {
	return errors.Is(err, puddle.ErrClosedPool) || errors.Is(err, errDBClosed())
}

// errDBClosed is the error database/sql returns for any use of a closed
// *sql.DB, taken from a DB opened on a connector that never connects and
// closed at once.
var errDBClosed = sync.OnceValue(func() error {
	db := sql.OpenDB(noConnector{})
	db.Close()
	_, err := db.Conn(context.Background())
	if err == nil {
		return errors.New("inbox: unreachable") // never matched
	}
	return err
})

// noConnector is a driver.Connector that never connects.
type noConnector struct{}

func (noConnector) Connect(context.Context) (driver.Conn, error) { return nil, driver.ErrSkip }
func (noConnector) Driver() driver.Driver                        { return nil }

// isPgconnMisuse reports whether err (not its chain) is pgconn's lock
// error for a connection used while it was busy ("conn busy": a handler
// that left rows open and ran another statement, or returned with them
// open) or never connected ("conn uninitialized"): bugs of the code that
// holds the connection. pgconn reports both with the unexported
// *connLockError, whose SafeToRetry is true (nothing was sent), and exports
// no sentinel for them: only the lock error of a closed connection wraps
// one, pgconn.ErrConnClosed. So the error is recognised by its type, as
// classifyDriverError recognises the drivers the core does not import, and
// a lock error that wraps nothing is the busy or uninitialized one; a
// closed connection's stays transient (SafeToRetry).
func isPgconnMisuse(err error) bool {
	if isNilPointer(err) {
		return false
	}
	t := reflect.TypeOf(err)
	if t.Kind() != reflect.Pointer || t.Elem().PkgPath() != "github.com/jackc/pgx/v5/pgconn" || t.Elem().Name() != "connLockError" {
		return false
	}
	return errors.Unwrap(err) == nil
}

// isNetworkFailure reports whether err is a failure of the network: a
// timeout, a temporary DNS failure, or a failed dial, read or write
// (*net.OpError). The net package's errors about an address itself
// (*net.AddrError, *net.ParseError, a *url.Error from url.Parse, a name
// that does not resolve) also implement net.Error, but they are errors of
// whatever supplied the address, typically the message: not transient.
func isNetworkFailure(err error) bool {
	var netErr net.Error
	if errors.As(err, &netErr) && netErr.Timeout() {
		return true
	}
	var dnsErr *net.DNSError
	if errors.As(err, &dnsErr) && (dnsErr.IsTimeout || dnsErr.IsTemporary) {
		return true
	}
	var opErr *net.OpError
	var addrErr *net.AddrError
	var parseErr *net.ParseError
	return errors.As(err, &opErr) && !errors.As(err, &addrErr) && !errors.As(err, &parseErr)
}

// isConflict reports whether err says that a transaction, or its statement,
// lost a race with other transactions and was rolled back, so that running
// it again may simply succeed: a serialization failure, a deadlock, a lock
// wait timeout, or a busy SQLite database. It is the subset of IsTransient
// that Purge retries in place (a lost connection or an ended context is
// not retried there).
func isConflict(err error) bool {
	return anyInChain(err, func(e error) bool { conflict, _, _ := classifyDriverError(e); return conflict })
}

// Driver error codes, by what they mean; see IsTransient for the sources.
var (
	// conflictSQLStates: PostgreSQL rolled the statement or transaction back
	// because it lost a race (serialization_failure, deadlock_detected,
	// lock_not_available).
	conflictSQLStates = map[string]bool{"40001": true, "40P01": true, "55P03": true}
	// transientSQLStates: the rest of IsTransient's list (class 08 is
	// matched by its prefix).
	transientSQLStates = map[string]bool{
		"40003": true, "57014": true, "57P01": true, "57P02": true, "57P03": true, "53300": true, "25P03": true,
		// idle_session_timeout (PostgreSQL 14+) closed a pooled session
		// that sat idle; transaction_timeout (PostgreSQL 17+).
		"57P05": true, "25P04": true,
		// insufficient_resources, disk_full, io_error: the server's state,
		// not the message's (an outage drained topics). Not 53200
		// (out_of_memory), which is also what a transaction that takes more
		// locks than max_locks_per_transaction allows gets, every time
		// ("out of shared memory"), nor 53400 (configuration_limit_exceeded).
		"53000": true, "53100": true, "58030": true,
	}
	// conflictMySQLErrors: MySQL/MariaDB rolled the statement or
	// transaction back because it lost a race.
	conflictMySQLErrors = map[uint64]bool{
		1213: true, // ER_LOCK_DEADLOCK
		1205: true, // ER_LOCK_WAIT_TIMEOUT
		1020: true, // ER_CHECKREAD (MariaDB innodb_snapshot_isolation write conflict)
		3101: true, // ER_TRANSACTION_ROLLBACK_DURING_COMMIT (MySQL Group Replication conflict)
	}
	// transientMySQLErrors: the rest of IsTransient's list.
	transientMySQLErrors = map[uint64]bool{
		1040: true, // ER_CON_COUNT_ERROR
		1203: true, // ER_TOO_MANY_USER_CONNECTIONS (max_user_connections)
		1226: true, // ER_USER_LIMIT_REACHED (the user's MAX_USER_CONNECTIONS, MAX_QUERIES_PER_HOUR, …)
		1053: true, // ER_SERVER_SHUTDOWN
		1317: true, // ER_QUERY_INTERRUPTED (KILL QUERY)
		1927: true, // ER_CONNECTION_KILLED (MariaDB)
		1969: true, // ER_STATEMENT_TIMEOUT (MariaDB max_statement_time)
		3024: true, // ER_QUERY_TIMEOUT (MySQL max_execution_time)
		4031: true, // ER_CLIENT_INTERACTION_TIMEOUT (MySQL 8.0.24+ closed an idle connection)
		1021: true, // ER_DISK_FULL
		1041: true, // ER_OUT_OF_RESOURCES
		1114: true, // ER_RECORD_FILE_FULL (a table or its tablespace is full)
	}
)

// SQLite primary result codes (https://www.sqlite.org/rescode.html); the
// extended codes keep them in their low byte.
const (
	sqliteBusy     = 5
	sqliteLocked   = 6
	sqliteReadOnly = 8
	sqliteNoMem    = 7
	sqliteIOErr    = 10
	sqliteFull     = 13
	sqliteAuth     = 23
)

// hasDatabaseCode reports whether err (not its chain) carries a database
// error code (see classifyDriverError).
func hasDatabaseCode(err error) bool { _, _, coded := classifyDriverError(err); return coded }

// classifyDriverError classifies one error (not its chain) by the code its
// driver reports: conflict (a lost race, see isConflict) and transient (see
// IsTransient; every conflict is transient); coded reports whether the
// error carries a database error code at all (a SQLSTATE, a MySQL error
// number, a SQLite result code). Drivers whose packages the core does not
// import are recognised by their error type's package path and name.
func classifyDriverError(err error) (conflict, transient, coded bool) {
	// A typed nil pointer (var pe *pgconn.PgError; return pe) says nothing,
	// and its methods may dereference it.
	v := reflect.ValueOf(err)
	for v.Kind() == reflect.Pointer || v.Kind() == reflect.Interface {
		if v.IsNil() {
			return false, false, false
		}
		v = v.Elem()
	}
	if e, ok := err.(interface{ SQLState() string }); ok {
		state := e.SQLState()
		if conflictSQLStates[state] {
			return true, true, true
		}
		return false, transientSQLStates[state] || (len(state) == 5 && state[:2] == "08") || isStalePlan(v, state), true
	}
	if e, ok := err.(interface{ SafeToRetry() bool }); ok && e.SafeToRetry() {
		return false, true, false
	}
	if n, ok := mysqlErrorNumber(err); ok {
		if conflictMySQLErrors[n] {
			return true, true, true
		}
		return false, transientMySQLErrors[n], true
	}
	if code, ok := sqliteResultCode(err); ok {
		busy := code == sqliteBusy || code == sqliteLocked
		return busy, busy || code == sqliteFull || code == sqliteIOErr || code == sqliteNoMem, true
	}
	return false, false, false
}

// isStalePlan reports whether a PostgreSQL error (v, the struct err points
// to, with SQLSTATE state) is "cached plan must not change result type":
// 0A000 from the server's RevalidateCachedQuery, for a statement prepared
// before a schema change (ALTER TABLE … ADD COLUMN during a deploy) that
// now returns other columns. The driver drops the statement (pgx's cache
// does), so a redelivery succeeds; 0A000 alone is feature_not_supported,
// which it does not. Told by the error's Routine field (pgx's PgError,
// lib/pq's Error), never by its text.
func isStalePlan(v reflect.Value, state string) bool {
	if state != "0A000" || v.Kind() != reflect.Struct {
		return false
	}
	routine, ok := stringField(v, "Routine")
	return ok && routine == "RevalidateCachedQuery"
}

// driverStruct returns the struct that err (not its chain) points to, and
// false for a typed nil pointer or an error that is no struct.
func driverStruct(err error) (reflect.Value, bool) {
	v := reflect.ValueOf(err)
	for v.Kind() == reflect.Pointer || v.Kind() == reflect.Interface {
		if v.IsNil() {
			return v, false
		}
		v = v.Elem()
	}
	return v, v.Kind() == reflect.Struct
}

// mysqlErrorNumber returns the error number of err (not its chain) when it
// is a go-sql-driver/mysql MySQLError, recognised by its type's package
// path and name without importing the driver.
func mysqlErrorNumber(err error) (uint64, bool) {
	v, ok := driverStruct(err)
	if !ok || v.Type().PkgPath() != "github.com/go-sql-driver/mysql" || v.Type().Name() != "MySQLError" {
		return 0, false
	}
	return uintField(v, "Number")
}

// sqliteResultCode returns the primary result code (the extended code's
// low byte) of err (not its chain) when it is an error of modernc.org/sqlite
// or github.com/mattn/go-sqlite3.
func sqliteResultCode(err error) (int, bool) {
	v, ok := driverStruct(err)
	if !ok {
		return 0, false
	}
	switch t := v.Type(); {
	case t.PkgPath() == "modernc.org/sqlite" && t.Name() == "Error":
		if c, ok := err.(interface{ Code() int }); ok {
			return c.Code() & 0xff, true
		}
	case t.PkgPath() == "github.com/mattn/go-sqlite3" && t.Name() == "Error":
		if code, ok := intField(v, "Code"); ok {
			return int(code) & 0xff, true
		}
	}
	return 0, false
}

func uintField(v reflect.Value, name string) (uint64, bool) {
	f := v.FieldByName(name)
	switch f.Kind() {
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return f.Uint(), true
	}
	return 0, false
}

func intField(v reflect.Value, name string) (int64, bool) {
	f := v.FieldByName(name)
	switch f.Kind() {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return f.Int(), true
	}
	return 0, false
}

// anyInChain reports whether match holds for err or any error it wraps,
// following Unwrap() error and Unwrap() []error as errors.Is does.
func anyInChain(err error, match func(error) bool) bool {
	for err != nil {
		if match(err) {
			return true
		}
		switch u := err.(type) {
		case interface{ Unwrap() error }:
			err = u.Unwrap()
		case interface{ Unwrap() []error }:
			for _, e := range u.Unwrap() {
				if anyInChain(e, match) {
					return true
				}
			}
			return false
		default:
			return false
		}
	}
	return false
}

// rollbackError is the error of a failed ROLLBACK of a message's
// transaction. A database cannot refuse a rollback: the connection is lost,
// and the server rolls the transaction back when it notices. IsTransient
// reports true for it.
type rollbackError struct{ err error }

func (e *rollbackError) Error() string { return e.err.Error() }
func (e *rollbackError) Unwrap() error { return e.err }

// lostConnError is the error of a BEGIN or COMMIT of a message's
// transaction whose connection was lost after the statement was sent, on a
// dialect whose driver reports that without a database error code (MySQL):
// see Inbox.maybeLostConn and Inbox.retryBegin. IsTransient reports true.
type lostConnError struct{ err error }

func (e *lostConnError) Error() string { return e.err.Error() }
func (e *lostConnError) Unwrap() error { return e.err }

// hasSQLState reports whether an error in err's chain carries one of the
// SQLSTATEs states (PostgreSQL drivers' SQLState() method).
func hasSQLState(err error, states ...string) bool {
	return anyInChain(err, func(e error) bool {
		s, ok := e.(interface{ SQLState() string })
		return ok && !isNilPointer(e) && slices.Contains(states, s.SQLState())
	})
}

// isReadOnlyRefusal reports whether an error in err's chain is the
// database refusing a write because the transaction, the session or the
// server is read-only: PostgreSQL's 25006 (read_only_sql_transaction: a
// hot standby, default_transaction_read_only), MySQL/MariaDB's 1290
// (ER_OPTION_PREVENTS_STATEMENT: read_only, super_read_only), 1792
// (ER_CANT_EXECUTE_IN_READ_ONLY_TRANSACTION: tx_read_only) and 1836
// (ER_READ_ONLY_MODE: innodb_read_only), and SQLite's SQLITE_READONLY
// with its extended codes (a read-only file, query_only).
func isReadOnlyRefusal(err error) bool {
	return hasRefusalCode(err, "25006", sqliteReadOnly, 1290, 1792, 1836)
}

// isPrivilegeRefusal reports whether err's chain holds the database's
// refusal of a statement for a privilege the session's user or role lacks:
// PostgreSQL's insufficient_privilege (42501), MySQL/MariaDB's
// ER_DBACCESS_DENIED_ERROR (1044), ER_TABLEACCESS_DENIED_ERROR (1142) and
// ER_COLUMNACCESS_DENIED_ERROR (1143), SQLite's SQLITE_AUTH (23).
func isPrivilegeRefusal(err error) bool {
	return hasRefusalCode(err, "42501", sqliteAuth, 1044, 1142, 1143)
}

// isUndefinedTable reports whether err says a table the statement names
// does not exist: PostgreSQL's 42P01 (undefined_table), MySQL/MariaDB's
// ER_NO_SUCH_TABLE, or SQLite's "no such table", whose result code is the
// generic SQLITE_ERROR.
func isUndefinedTable(err error) bool {
	if hasRefusalCode(err, "42P01", -1, erNoSuchTable) {
		return true
	}
	return anyInChain(err, func(e error) bool {
		code, ok := sqliteResultCode(e)
		return ok && code == 1 && strings.Contains(e.Error(), "no such table")
	})
}

// hasRefusalCode reports whether err's chain holds a driver error with
// PostgreSQL's sqlState, SQLite's primary result code sqlite, or one of
// MySQL/MariaDB's numbers.
func hasRefusalCode(err error, sqlState string, sqlite int, mysql ...uint64) bool {
	return anyInChain(err, func(e error) bool {
		if n, ok := mysqlErrorNumber(e); ok {
			return slices.Contains(mysql, n)
		}
		if code, ok := sqliteResultCode(e); ok {
			return code == sqlite
		}
		s, ok := e.(interface{ SQLState() string })
		return ok && !isNilPointer(e) && s.SQLState() == sqlState
	})
}

// isMissingPartition reports whether err's chain holds PostgreSQL's refusal
// of a row that no partition of the partitioned table named table (its
// unqualified name) accepts: SQLSTATE 23514 without a constraint name, on
// that table. A CHECK constraint's violation, the same code, names its
// constraint, and one that a trigger raises names no table unless it says
// so. Read from pgx's *pgconn.PgError (ConstraintName, TableName) and
// lib/pq's *pq.Error (Constraint, Table).
func isMissingPartition(err error, table string) bool {
	return anyInChain(err, func(e error) bool {
		s, ok := e.(interface{ SQLState() string })
		if !ok || isNilPointer(e) || s.SQLState() != "23514" {
			return false
		}
		v, ok := driverStruct(e)
		if !ok {
			return false
		}
		constraint, ok := stringField(v, "ConstraintName", "Constraint")
		if !ok || constraint != "" {
			return false
		}
		onTable, ok := stringField(v, "TableName", "Table")
		return ok && onTable == table
	})
}

// isUniqueViolationOn reports whether err's chain holds PostgreSQL's
// unique_violation (23505) on the table named table (its unqualified name):
// on an outbox table, whose only key is its generated id, the identity
// hands out ids that rows still hold (restarted by hand: ALTER … RESTART,
// setval). Read from pgx's *pgconn.PgError (TableName) and lib/pq's
// *pq.Error (Table), whatever the key is called (a table made after
// another was renamed aside has <table>_pkey1). MySQL/MariaDB and SQLite
// cannot hand out an id below the table's largest (AUTO_INCREMENT,
// AUTOINCREMENT).
func isUniqueViolationOn(err error, table string) bool {
	return anyInChain(err, func(e error) bool {
		s, ok := e.(interface{ SQLState() string })
		if !ok || isNilPointer(e) || s.SQLState() != "23505" {
			return false
		}
		v, ok := driverStruct(e)
		if !ok {
			return false
		}
		onTable, ok := stringField(v, "TableName", "Table")
		return ok && onTable == table
	})
}

// stringField returns the first of the string fields names that v has.
func stringField(v reflect.Value, names ...string) (string, bool) {
	for _, name := range names {
		if f := v.FieldByName(name); f.Kind() == reflect.String {
			return f.String(), true
		}
	}
	return "", false
}

// hasMySQLNumber reports whether an error in err's chain is a
// go-sql-driver/mysql *MySQLError with error number n.
func hasMySQLNumber(err error, n uint64) bool {
	return anyInChain(err, func(e error) bool {
		got, ok := mysqlErrorNumber(e)
		return ok && got == n
	})
}

// isNilPointer reports whether err is a typed nil pointer.
func isNilPointer(err error) bool {
	v := reflect.ValueOf(err)
	return v.Kind() == reflect.Pointer && v.IsNil()
}

// poolerHint returns err with a pointer to the fix when it says that a
// prepared statement was missing on the server connection or already there
// (26000, 42P05): what pgx's default statement cache meets behind a
// transaction-mode connection pooler.
// An error that has the hint already is returned as it is.
func poolerHint(err error) error {
	var hinted poolerHinted
	if hasSQLState(err, "26000", "42P05") && !errors.As(err, &hinted) {
		return poolerHinted{fmt.Errorf("%w (a prepared statement missing or already there on the server connection: behind a "+
			"transaction-mode pooler such as PgBouncer use pgx with default_query_exec_mode=exec or simple_protocol, "+
			"and leave Config.PrepareStatements false; see docs/poolers.md. Otherwise a handler ran DEALLOCATE ALL or "+
			"DISCARD ALL on a transaction before, on this connection)", err)}
	}
	return err
}

// poolerHinted is an error with poolerHint's hint.
type poolerHinted struct{ error }

func (e poolerHinted) Unwrap() error { return e.error }
