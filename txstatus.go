package inbox

import (
	"database/sql/driver"
	"reflect"
	"sync"
)

// The pre-commit check asks the driver connection whether the server still
// has the message's transaction open, from what the server told it last:
// every protocol reports the transaction status with each response, so no
// round trip is needed. database/sql exposes no such status; the driver
// connection, reached through Conn.Raw, does:
//
//   - github.com/jackc/pgx/v5/stdlib: its Conn's exported
//     Conn().PgConn().TxStatus(), the status of PostgreSQL's last
//     ReadyForQuery ('I': no transaction). The core does not import pgx, so
//     these exported methods are called through reflect.
//   - github.com/lib/pq: the txnStatus field of its conn (the same
//     ReadyForQuery byte), read through reflect: lib/pq exports no accessor.
//     (lib/pq's own COMMIT refuses an ended transaction, but with an error
//     nothing can match.)
//   - github.com/go-sql-driver/mysql: the status field of its mysqlConn,
//     the server status flags of the last OK or EOF packet, whose
//     SERVER_STATUS_IN_TRANS bit (1) is clear once a COMMIT, a ROLLBACK or
//     a statement that commits implicitly (DDL such as CREATE TABLE) ended
//     the transaction. Read through reflect: the driver exports no accessor.
//   - github.com/mattn/go-sqlite3: its exported AutoCommit().
//   - modernc.org/sqlite exports no status (its conn keeps the handle
//     unexported). None is needed: SQLite refuses a COMMIT outside a
//     transaction with SQLITE_ERROR, which commitFoundNoTx recognises, so
//     the handler's COMMIT or ROLLBACK costs nothing to detect there either.
//
// A driver connection wrapped by an instrumentation package is read
// through the driver.Conn it wraps, when that is an exported field, its own
// or an exported embedded struct's: github.com/XSAM/otelsql (otConn embeds
// driver.Conn), DataDog's sqltrace and qustavo/sqlhooks keep it so.
// Unwrapped, a handler's ROLLBACK through otelsql over pgx went undetected:
// the inbox's COMMIT found no transaction, PostgreSQL only warned, and the
// message was acked with nothing written.
//
// A driver that gives no status (not listed, a wrapper that keeps its
// connection unexported, as ngrok/sqlmw and instrumentedsql do, or one
// whose internals changed) reports that it cannot tell: on PostgreSQL the
// inbox then reads its claim before each COMMIT (Dialect.statuslessCheck,
// one round trip more), as it does on MySQL/MariaDB for every driver.

// txProbe reads a driver connection's transaction status, as PostgreSQL's
// ReadyForQuery says it ('I': none open, 'T': open, 'E': open and failed,
// which COMMIT turns into ROLLBACK; MySQL/MariaDB and SQLite drivers tell
// 'I' or 'T'), and whether it could tell.
type txProbe func(dc reflect.Value) (status byte, known bool)

// txProbes caches, by driver connection type, its probe (nil: none).
var txProbes sync.Map // reflect.Type -> txProbe

// driverTxEnded reports whether the driver connection dc (from Conn.Raw)
// says that the server has no transaction open on it, and whether it can
// tell at all (known): a driver that cannot reports false, false.
func driverTxEnded(dc any) (ended, known bool) {
	status, known := driverTxStatus(dc)
	return known && status == 'I', known
}

// driverTxStatus returns the transaction status of the driver connection
// dc (from Conn.Raw), as txProbe tells it, and whether it can tell at all
// (known): a driver that cannot reports 0, false.
func driverTxStatus(dc any) (status byte, known bool) {
	if c, ok := dc.(interface{ AutoCommit() bool }); ok { // mattn/go-sqlite3
		return inTx(!c.AutoCommit()), true
	}
	t := reflect.TypeOf(dc)
	p, ok := txProbes.Load(t)
	if !ok {
		p, _ = txProbes.LoadOrStore(t, newTxProbe(t, 0))
	}
	probe := p.(txProbe)
	if probe == nil {
		return 0, false
	}
	return probe(reflect.ValueOf(dc))
}

// inTx is the status of a driver that tells only whether a transaction is
// open: 'T' or 'I'.
func inTx(open bool) byte {
	if open {
		return 'T'
	}
	return 'I'
}

// newTxProbe returns the probe for driver connection type t, or nil;
// depth counts the embedded structs it went through.
func newTxProbe(t reflect.Type, depth int) txProbe {
	if t == nil || t.Kind() != reflect.Pointer || t.Elem().Kind() != reflect.Struct {
		return nil
	}
	s := t.Elem()
	switch {
	case s.PkgPath() == "github.com/jackc/pgx/v5/stdlib" && s.Name() == "Conn":
		return pgxStdlibProbe(t)
	case s.PkgPath() == "github.com/lib/pq" && s.Name() == "conn":
		if f, ok := s.FieldByName("txnStatus"); ok && f.Type.Kind() == reflect.Uint8 {
			return func(v reflect.Value) (byte, bool) { return byte(v.Elem().FieldByIndex(f.Index).Uint()), true }
		}
	case s.PkgPath() == "github.com/go-sql-driver/mysql" && s.Name() == "mysqlConn":
		if f, ok := s.FieldByName("status"); ok && f.Type.Kind() == reflect.Uint16 {
			const serverStatusInTrans = 1
			return func(v reflect.Value) (byte, bool) {
				return inTx(v.Elem().FieldByIndex(f.Index).Uint()&serverStatusInTrans != 0), true
			}
		}
	default:
		return wrapperProbe(s, depth)
	}
	return nil
}

// wrapperProbe returns the probe of an instrumentation wrapper's struct
// type s: the answer of the driver.Conn it keeps in an exported field, its
// own or one of an exported embedded struct's (sqlhooks keeps it in an
// embedded *Conn), at most two structs down; nil when there is none.
func wrapperProbe(s reflect.Type, depth int) txProbe {
	for i := range s.NumField() {
		f := s.Field(i)
		if !f.IsExported() {
			continue
		}
		if f.Type == reflect.TypeFor[driver.Conn]() {
			return func(v reflect.Value) (byte, bool) {
				inner := v.Elem().Field(i)
				if inner.IsNil() {
					return 0, false
				}
				return driverTxStatus(inner.Interface())
			}
		}
		if f.Anonymous && depth < 2 && f.Type.Kind() == reflect.Pointer && f.Type.Elem().Kind() == reflect.Struct {
			if probe := newTxProbe(f.Type, depth+1); probe != nil {
				return func(v reflect.Value) (byte, bool) {
					embedded := v.Elem().Field(i)
					if embedded.IsNil() {
						return 0, false
					}
					return probe(embedded)
				}
			}
		}
	}
	return nil
}

// pgxStdlibProbe calls pgx's exported Conn().PgConn().TxStatus() on a
// *stdlib.Conn (type t): the first two through reflect (their results are
// pgx's types), TxStatus through an interface.
func pgxStdlibProbe(t reflect.Type) txProbe {
	conn, ok := t.MethodByName("Conn")
	if !ok || conn.Type.NumIn() != 1 || conn.Type.NumOut() != 1 || conn.Type.Out(0).Kind() != reflect.Pointer {
		return nil
	}
	pgConn, ok := conn.Type.Out(0).MethodByName("PgConn")
	if !ok || pgConn.Type.NumIn() != 1 || pgConn.Type.NumOut() != 1 || pgConn.Type.Out(0).Kind() != reflect.Pointer ||
		!pgConn.Type.Out(0).Implements(reflect.TypeFor[txStatuser]()) {
		return nil
	}
	return func(v reflect.Value) (byte, bool) {
		c := conn.Func.Call([]reflect.Value{v})[0]
		if c.IsNil() {
			return 0, false
		}
		pc := pgConn.Func.Call([]reflect.Value{c})[0]
		if pc.IsNil() {
			return 0, false
		}
		return pc.Interface().(txStatuser).TxStatus(), true
	}
}

// txStatuser is pgconn.PgConn's TxStatus: the transaction status of
// PostgreSQL's last ReadyForQuery ('I' idle, 'T' in a transaction, 'E' in
// a failed one).
type txStatuser interface{ TxStatus() byte }

// sqliteError is SQLite's primary result code SQLITE_ERROR: a COMMIT gets
// it only when no transaction is active ("cannot commit - no transaction
// is active"); a busy or locked database, a full disk or a deferred
// constraint have their own codes.
const sqliteError = 1

// commitFoundNoTx reports whether err, from COMMIT, says that no
// transaction was open: SQLite's SQLITE_ERROR (modernc.org/sqlite,
// mattn/go-sqlite3), the drivers that have no status to read before.
func commitFoundNoTx(err error) bool { return hasSQLiteError(err) }

// hasSQLiteError reports whether err's chain holds SQLite's primary result
// code SQLITE_ERROR (modernc.org/sqlite, mattn/go-sqlite3): a statement
// SQLite refused as such (a COMMIT outside a transaction, a table it does
// not have), not a busy or locked database, an I/O error, a closed
// connection or database/sql's sql.ErrTxDone.
func hasSQLiteError(err error) bool {
	return anyInChain(err, func(e error) bool {
		v := reflect.ValueOf(e)
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
		case t.PkgPath() == "modernc.org/sqlite" && t.Name() == "Error":
			c, ok := e.(interface{ Code() int })
			return ok && c.Code() == sqliteError
		case t.PkgPath() == "github.com/mattn/go-sqlite3" && t.Name() == "Error":
			code, ok := intField(v, "Code")
			return ok && code == sqliteError
		}
		return false
	})
}
