package inbox_test

// The error codes in an error chain, for assertions and failure messages.

import (
	"database/sql/driver"
	"errors"
	"fmt"
	"net"
	"strings"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgconn"
)

// describeErr names the codes in an error chain, for failure messages and logs.
func describeErr(err error) string {
	if err == nil {
		return "<nil>"
	}
	var codes []string
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		codes = append(codes, "SQLSTATE "+pgErr.Code)
	}
	var myErr *mysql.MySQLError
	if errors.As(err, &myErr) {
		codes = append(codes, fmt.Sprintf("MySQL %d", myErr.Number))
	}
	var netErr net.Error
	if errors.As(err, &netErr) {
		codes = append(codes, "net.Error")
	}
	var retry interface{ SafeToRetry() bool }
	if errors.As(err, &retry) && retry.SafeToRetry() {
		codes = append(codes, "SafeToRetry")
	}
	if errors.Is(err, driver.ErrBadConn) {
		codes = append(codes, "driver.ErrBadConn")
	}
	return fmt.Sprintf("[%s] %v", strings.Join(codes, ", "), err)
}

// errText returns err's text, or "" for nil.
func errText(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// pgCode returns the SQLSTATE in err's chain, or "".
func pgCode(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// mysqlNumber returns the MySQL error number in err's chain, or 0.
func mysqlNumber(err error) uint16 {
	var myErr *mysql.MySQLError
	if errors.As(err, &myErr) {
		return myErr.Number
	}
	return 0
}

// sqlState returns the PostgreSQL SQLSTATE in err's chain, or "".
func sqlState(err error) string {
	var s interface{ SQLState() string }
	if errors.As(err, &s) {
		return s.SQLState()
	}
	return ""
}
