package inbox_test

import (
	"context"
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
