package inbox

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"io"
	"net"
	"reflect"
	"syscall"
)

// IsTransient reports whether err is a failure that says nothing about the
// message itself, so that a redelivery of the same message can succeed: a
// serialization failure or deadlock that made the database roll the
// transaction back, a lock or statement timeout, a lost or refused
// connection, a server shutting down, a busy SQLite database, or a message
// context that ended (deadline or cancellation, as when a router stops).
//
// The inbox has rolled back whatever it returns, so a transient error is
// always safe to nack: the redelivery either processes the message or, if a
// concurrent delivery committed it meanwhile, skips it as a duplicate. Use
// it to keep such errors away from a poison queue, which is meant for
// messages that can never succeed:
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
//     connect now), 53300 (too_many_connections) and 25P03
//     (idle_in_transaction_session_timeout). PostgreSQL documents 40001 and
//     40P01 as the errors an application should retry.
//   - MySQL and MariaDB through github.com/go-sql-driver/mysql
//     (*mysql.MySQLError, matched by type without importing the driver):
//     1213 (ER_LOCK_DEADLOCK), 1205 (ER_LOCK_WAIT_TIMEOUT), 1020
//     (ER_CHECKREAD: MariaDB's snapshot isolation, innodb_snapshot_isolation,
//     ON by default since 11.6, rolled back a REPEATABLE READ transaction
//     that wrote a row changed since its snapshot), 3101 (MySQL Group
//     Replication rolled back a transaction that failed certification),
//     1040 (too many connections), 1053 (server shutdown), 1927 (MariaDB
//     connection killed), 1969 (MariaDB max_statement_time exceeded) and
//     3024 (MySQL max_execution_time exceeded). The driver's
//     mysql.ErrInvalidConn is a plain error value that cannot be told apart
//     without importing the driver; database/sql turns most lost
//     connections into driver.ErrBadConn, which is recognised.
//   - SQLite: SQLITE_BUSY and SQLITE_LOCKED, with their extended codes,
//     from modernc.org/sqlite (*sqlite.Error) and github.com/mattn/go-sqlite3
//     (sqlite3.Error).
//   - database/sql and the network: driver.ErrBadConn, sql.ErrConnDone,
//     io.ErrUnexpectedEOF, ECONNRESET, ECONNREFUSED, EPIPE and any net.Error.
//   - Any error with a SafeToRetry() bool method that reports true: pgx's
//     errors that happened before anything was sent to the server, such as
//     "conn closed" when a transaction's connection was lost earlier (a
//     COMMIT after a statement whose connection error the handler ignored).
//     Outside a transaction pgx's database/sql adapter turns the same errors
//     into driver.ErrBadConn, so that database/sql retries them.
//   - context.DeadlineExceeded and context.Canceled.
//   - The inbox's ErrTxRolledBack: MySQL/MariaDB rolled the transaction back
//     on a deadlock or conflict whose error the handler ignored.
//
// Everything else is not transient, including the inbox's own
// ErrInvalidMessageID and ErrInvalidConsumer (the message can never be
// claimed) and constraint violations. IsTransient(nil) is false. It is safe
// for concurrent use.
func IsTransient(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) || errors.Is(err, ErrTxRolledBack) ||
		errors.Is(err, driver.ErrBadConn) || errors.Is(err, sql.ErrConnDone) ||
		errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET) ||
		errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.EPIPE) {
		return true
	}
	var netErr net.Error
	if errors.As(err, &netErr) {
		return true
	}
	var retry interface{ SafeToRetry() bool }
	if errors.As(err, &retry) && retry.SafeToRetry() {
		return true
	}
	var stateErr interface{ SQLState() string }
	if errors.As(err, &stateErr) && transientSQLState(stateErr.SQLState()) {
		return true
	}
	return anyInChain(err, transientDriverError)
}

// transientSQLState reports whether a PostgreSQL SQLSTATE is transient; see
// IsTransient for the list and
// https://www.postgresql.org/docs/current/errcodes-appendix.html.
func transientSQLState(state string) bool {
	if len(state) == 5 && state[:2] == "08" {
		return true
	}
	switch state {
	case "40001", "40P01", "40003", "55P03", "57014", "57P01", "57P02", "57P03", "53300", "25P03":
		return true
	}
	return false
}

// transientMySQLErrors are the go-sql-driver/mysql error numbers IsTransient
// accepts (MySQL and MariaDB server error reference).
var transientMySQLErrors = map[uint64]bool{
	1213: true, // ER_LOCK_DEADLOCK
	1205: true, // ER_LOCK_WAIT_TIMEOUT
	1020: true, // ER_CHECKREAD (MariaDB innodb_snapshot_isolation write conflict)
	3101: true, // ER_TRANSACTION_ROLLBACK_DURING_COMMIT (MySQL Group Replication conflict)
	1040: true, // ER_CON_COUNT_ERROR
	1053: true, // ER_SERVER_SHUTDOWN
	1927: true, // ER_CONNECTION_KILLED (MariaDB)
	1969: true, // ER_STATEMENT_TIMEOUT (MariaDB max_statement_time)
	3024: true, // ER_QUERY_TIMEOUT (MySQL max_execution_time)
}

// SQLite primary result codes (https://www.sqlite.org/rescode.html); the
// extended codes keep them in their low byte.
const (
	sqliteBusy   = 5
	sqliteLocked = 6
)

// transientDriverError recognises one error of a driver whose package the
// core does not import, by its type's package path and name.
func transientDriverError(err error) bool {
	v := reflect.ValueOf(err)
	for v.Kind() == reflect.Pointer || v.Kind() == reflect.Interface {
		if v.IsNil() {
			return false
		}
		v = v.Elem()
	}
	if v.Kind() != reflect.Struct {
		return false
	}
	t := v.Type()
	switch {
	case t.PkgPath() == "github.com/go-sql-driver/mysql" && t.Name() == "MySQLError":
		n, ok := uintField(v, "Number")
		return ok && transientMySQLErrors[n]
	case t.PkgPath() == "modernc.org/sqlite" && t.Name() == "Error":
		if c, ok := err.(interface{ Code() int }); ok {
			code := c.Code() & 0xff
			return code == sqliteBusy || code == sqliteLocked
		}
	case t.PkgPath() == "github.com/mattn/go-sqlite3" && t.Name() == "Error":
		if code, ok := intField(v, "Code"); ok {
			return code == sqliteBusy || code == sqliteLocked
		}
	}
	return false
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
