package bench

import (
	"context"
	"fmt"
	"testing"

	"github.com/jmoiron/sqlx"
	_ "github.com/lib/pq" // registers "postgres"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// claimDrivers are the PostgreSQL drivers BenchmarkPreparedClaim compares.
// Names are single path elements ("lib-pq", not "lib/pq") so that -bench
// patterns line up across drivers.
var claimDrivers = []testdb.PgBouncerDriver{
	// pgx's database/sql adapter in its default mode caches a prepared
	// statement per connection by itself, prepared claim or not.
	{Name: "pgx", Driver: "pgx"},
	// What a PgBouncer user sets: an unnamed statement, one round trip.
	{Name: "pgx-exec", Driver: "pgx", Param: "default_query_exec_mode=exec"},
	// lib/pq sends an unprepared statement with arguments as parse and
	// describe, then bind and execute: two round trips.
	{Name: "lib-pq", Driver: "postgres"},
}

// claimMode is a value of Config.PrepareStatements.
type claimMode struct {
	name    string
	prepare bool
}

// claimModes are both, prepared first: an unprepared run reports its ratio
// to the prepared run just before it.
var claimModes = []claimMode{{"prepared", true}, {"unprepared", false}}

// BenchmarkPreparedClaim/<server>/<driver>/<mode>/conc=<n>: what not
// preparing the claim (Config.PrepareStatements false, the default on
// PostgreSQL) costs, per driver: the inbox variant of BenchmarkThroughput
// (one business insert per message, dup=0) with mode prepared or
// unprepared. server is postgres (direct) or pgbouncer (transaction pooling,
// INBOX_TEST_PGBOUNCER_DSN; skipped when unreachable), where only unprepared
// can work and pgx's default mode cannot.
//
// Unprepared runs report x-prepared, their msgs/s over the prepared run's
// just before them (same driver, same conc, same pass); pgbouncer runs
// report x-direct, their msgs/s over the direct unprepared run's of the
// same pass.
func BenchmarkPreparedClaim(b *testing.B) {
	// rates holds the msgs/s of the last run of each server/driver/mode/conc.
	rates := map[string]float64{}
	bench := func(b *testing.B, db *sqlx.DB, server, driver string, modes []claimMode) {
		warm(b, db)
		for _, conc := range []int{1, 8} {
			for _, m := range modes {
				b.Run(fmt.Sprintf("%s/conc=%d", m.name, conc), func(b *testing.B) {
					ib, _ := newInboxWith(b, inbox.Config{DB: db, Dialect: inbox.PostgreSQL, Consumer: "bench", PrepareStatements: m.prepare})
					h := inboxHandler(ib, insertSQL(db, businessTable(b, db)))
					key := func(server, mode string) string { return fmt.Sprintf("%s/%s/%s/%d", server, driver, mode, conc) }
					rate := run(b, h, messages(b.N, 0), conc)
					rates[key(server, m.name)] = rate
					if prepared, ok := rates[key(server, "prepared")]; ok && !m.prepare {
						b.ReportMetric(rate/prepared, "x-prepared")
					}
					if direct, ok := rates[key("postgres", m.name)]; ok && server != "postgres" {
						b.ReportMetric(rate/direct, "x-direct")
					}
				})
			}
		}
	}
	b.Run("postgres", func(b *testing.B) {
		for _, d := range claimDrivers {
			b.Run(d.Name, func(b *testing.B) {
				bench(b, testdb.OpenPostgresWith(b, d.Driver, d.Param), "postgres", d.Name, claimModes)
			})
		}
	})
	b.Run("pgbouncer", func(b *testing.B) {
		for _, d := range claimDrivers[1:] { // not pgx's default mode: its statement cache cannot work there
			b.Run(d.Name, func(b *testing.B) {
				bench(b, testdb.OpenPgBouncer(b, d), "pgbouncer", d.Name, claimModes[1:])
			})
		}
	})
}

// warm sizes db's pool to 16 connections, as BenchmarkThroughput's, and
// opens all of them up front, so that the first run measured does not pay
// for connections that the later ones reuse.
func warm(b *testing.B, db *sqlx.DB) {
	db.SetMaxOpenConns(16)
	db.SetMaxIdleConns(16)
	conns := make([]*sqlx.Conn, 0, 16)
	for range 16 {
		c, err := db.Connx(context.Background())
		if err != nil {
			b.Fatal(err)
		}
		conns = append(conns, c)
	}
	for _, c := range conns {
		c.Close()
	}
}
