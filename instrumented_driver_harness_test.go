package inbox_test

import (
	"sync"
	"testing"

	"github.com/XSAM/otelsql"
)

// otelsqlDrivers registers, once, pgx's and go-sql-driver/mysql's drivers
// wrapped by XSAM/otelsql, the instrumentation services add to trace their
// SQL, and returns their names.
var otelsqlDrivers = sync.OnceValues(func() ([2]string, error) {
	var names [2]string
	for i, name := range []string{"pgx", "mysql"} {
		wrapped, err := otelsql.Register(name)
		if err != nil {
			return names, err
		}
		names[i] = wrapped
	}
	return names, nil
})

// otelsqlPgx returns the name of pgx's driver wrapped by otelsql.
func otelsqlPgx(tb testing.TB) string { return otelsqlDriver(tb, 0) }

// otelsqlMySQL returns the name of go-sql-driver/mysql's driver wrapped by
// otelsql.
func otelsqlMySQL(tb testing.TB) string { return otelsqlDriver(tb, 1) }

func otelsqlDriver(tb testing.TB, i int) string {
	tb.Helper()
	names, err := otelsqlDrivers()
	if err != nil {
		tb.Fatal(err)
	}
	return names[i]
}
