package inbox_test

import (
	"context"
	"database/sql/driver"
	"path/filepath"
	"testing"

	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// BenchmarkDriverTxEnded measures what the pre-commit check's status read
// costs per message on each database/sql driver (Conn.Raw and the driver's
// probe, in an open transaction: "ended" must stay 0).
func BenchmarkDriverTxEnded(b *testing.B) {
	for _, d := range []struct {
		name string
		open func(testing.TB) *sqlx.DB
	}{
		{"pgx-stdlib", func(tb testing.TB) *sqlx.DB { return testdb.OpenPostgres(tb, "") }},
		{"lib-pq", func(tb testing.TB) *sqlx.DB { return testdb.OpenPostgresWith(tb, "postgres", "") }},
		{"mysql", func(tb testing.TB) *sqlx.DB { return testdb.OpenMySQL(tb, "") }},
		{"modernc-sqlite", func(tb testing.TB) *sqlx.DB {
			return testdb.OpenSQLite(tb, filepath.Join(tb.TempDir(), "x.db"))
		}},
	} {
		b.Run(d.name, func(b *testing.B) {
			db := d.open(b)
			ctx := context.Background()
			conn, err := db.Connx(ctx)
			if err != nil {
				b.Fatal(err)
			}
			defer conn.Close()
			tx, err := conn.BeginTxx(ctx, nil)
			if err != nil {
				b.Fatal(err)
			}
			defer tx.Rollback()
			ended := 0
			probe := func(dc any) error {
				if inbox.DriverTxEnded(dc) {
					ended++
				}
				return nil
			}
			b.ReportAllocs()
			for b.Loop() {
				if err := conn.Raw(probe); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(ended), "ended")
		})
	}
}

// HooksConn and sqlhooksWrapper have the shape of qustavo/sqlhooks'
// connections: the driver connection in an exported field of an embedded
// struct.
type HooksConn struct{ Conn driver.Conn }

type sqlhooksWrapper struct{ *HooksConn }

// sqlmwConn has the shape of ngrok/sqlmw's: the driver connection
// unexported.
type sqlmwConn struct{ parent driver.Conn }

// The transaction status is read through a wrapper that keeps the driver
// connection in an exported field, its own or an embedded struct's, and a
// wrapper that hides it reports that it cannot tell (the inbox then reads
// its claim before COMMIT).
func TestDriverTxStatusThroughWrappers(t *testing.T) {
	t.Parallel()
	db := testdb.OpenPostgres(t, "")
	ctx := context.Background()
	conn, err := db.Connx(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	check := func(inTx bool) {
		t.Helper()
		if err := conn.Raw(func(dc any) error {
			for _, c := range []struct {
				name      string
				dc        any
				wantKnown bool
			}{
				{"pgx", dc, true},
				{"sqlhooks shape", &sqlhooksWrapper{&HooksConn{Conn: dc.(driver.Conn)}}, true},
				{"sqlhooks shape, nil inside", &sqlhooksWrapper{}, false},
				{"sqlmw shape", &sqlmwConn{parent: dc.(driver.Conn)}, false},
			} {
				ended, known := inbox.DriverTxStatus(c.dc)
				if known != c.wantKnown || (known && ended == inTx) {
					t.Errorf("%s, in a transaction %t: ended %t, known %t; want known %t", c.name, inTx, ended, known, c.wantKnown)
				}
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	check(false)
	tx, err := conn.BeginTxx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	check(true)
}
