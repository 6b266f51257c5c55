package bench

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
	_ "github.com/lib/pq" // registers "postgres"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// claimDrivers are the PostgreSQL drivers BenchmarkPreparedClaim compares.
// Names are single path elements ("lib-pq", not "lib/pq") so that -bench
// patterns line up across drivers.
var claimDrivers = []testdb.PgBouncerDriver{
	// pgx's database/sql adapter in its default mode prepares and caches
	// every statement per connection by itself, prepared claim or not.
	{Name: "pgx", Driver: "pgx"},
	// What a PgBouncer user sets: an unnamed statement, one round trip.
	{Name: "pgx-exec", Driver: "pgx", Param: "default_query_exec_mode=exec"},
	// lib/pq sends an unprepared statement with arguments as parse and
	// describe, then bind and execute: two round trips.
	{Name: "lib-pq", Driver: "postgres"},
}

// BenchmarkPreparedClaim measures what not preparing the claim
// (Config.PrepareStatements false, the default on PostgreSQL) costs, with
// the inbox variant of BenchmarkThroughput (one business insert per
// message, dup=0) and b.N messages per side:
//
//   - postgres/<driver>/conc=<n>: prepared against unprepared, straight to
//     PostgreSQL; reports prepared-msgs/s, unprepared-msgs/s and x-prepared
//     (unprepared over prepared).
//   - pgbouncer/<driver>/conc=<n>: unprepared through PgBouncer in
//     transaction pooling mode (INBOX_TEST_PGBOUNCER_DSN; skipped when
//     unreachable) against unprepared straight to PostgreSQL; reports
//     direct-msgs/s, pgbouncer-msgs/s and x-direct. Only the drivers and
//     the mode that work behind such a pooler run there.
//
// The two sides of a comparison take turns, a twentieth of the messages at
// a time, and x-prepared and x-direct are the median over those rounds of
// the one's rate over the other's, so that a load that comes and goes on
// the machine (other processes share its two cores) weighs on both sides
// alike. ns/op and allocs/op count one message of each side.
func BenchmarkPreparedClaim(b *testing.B) {
	b.Run("postgres", func(b *testing.B) {
		for _, d := range claimDrivers {
			b.Run(d.Name, func(b *testing.B) {
				db := testdb.OpenPostgresWith(b, d.Driver, d.Param)
				warm(b, db)
				for _, conc := range []int{1, 8} {
					b.Run(fmt.Sprintf("conc=%d", conc), func(b *testing.B) {
						x := compare(b, conc, claimSide(b, "prepared", db, true), claimSide(b, "unprepared", db, false))
						b.ReportMetric(x[1], "x-prepared")
					})
				}
			})
		}
	})
	b.Run("pgbouncer", func(b *testing.B) {
		for _, d := range claimDrivers[1:] { // not pgx's default mode: its statement cache cannot work there
			b.Run(d.Name, func(b *testing.B) {
				pooled := testdb.OpenPgBouncer(b, d)
				direct := testdb.OpenPostgresWith(b, d.Driver, d.Param)
				warm(b, pooled)
				warm(b, direct)
				for _, conc := range []int{1, 8} {
					b.Run(fmt.Sprintf("conc=%d", conc), func(b *testing.B) {
						x := compare(b, conc, claimSide(b, "direct", direct, false), claimSide(b, "pgbouncer", pooled, false))
						b.ReportMetric(x[1], "x-direct")
					})
				}
			})
		}
	})
}

// side is one configuration a comparison runs: its handler, and the
// prefix of its metrics.
type side struct {
	name string
	h    message.HandlerFunc
}

// claimSide is the inbox variant on db, with its own inbox and business
// tables, preparing the claim or not.
func claimSide(b *testing.B, name string, db *sqlx.DB, prepare bool) side {
	ib, _ := newInboxWith(b, inbox.Config{DB: db, Dialect: inbox.PostgreSQL, Consumer: "bench", PrepareStatements: prepare})
	return side{name, inboxHandler(ib, insertSQL(db, businessTable(b, db)))}
}

// compareRounds is how many turns each side of a comparison takes.
const compareRounds = 20

// compare feeds b.N new messages to each side from conc goroutines, the
// sides taking turns (in alternating order) for compareRounds rounds, and
// reports each side's msgs/s and p50 latency in microseconds over all its
// messages, as <name>-msgs/s and <name>-p50-us. It returns, for each side,
// the median over the rounds of its msgs/s in a round over the first
// side's in the same round: a load on the machine that comes and goes
// skews a few rounds, not the median.
func compare(b *testing.B, conc int, sides ...side) []float64 {
	msgs := make([][]*message.Message, len(sides))
	latencies := make([][]time.Duration, len(sides))
	elapsed := make([]time.Duration, len(sides))
	ratios := make([][]float64, len(sides))
	for i := range sides {
		msgs[i] = messages(b.N, 0)
		latencies[i] = make([]time.Duration, b.N)
	}
	chunk := (b.N + compareRounds - 1) / compareRounds
	took := make([]time.Duration, len(sides))
	b.ReportAllocs()
	b.ResetTimer()
	for round, lo := 0, 0; lo < b.N; round, lo = round+1, lo+chunk {
		hi := min(lo+chunk, b.N)
		for k := range sides {
			i := k
			if round%2 == 1 {
				i = len(sides) - 1 - k
			}
			var err error
			took[i], err = feed(sides[i].h, msgs[i][lo:hi], conc, latencies[i][lo:hi])
			if err != nil {
				b.Fatalf("%s: %v", sides[i].name, err)
			}
			elapsed[i] += took[i]
		}
		for i := range sides {
			ratios[i] = append(ratios[i], took[0].Seconds()/took[i].Seconds())
		}
	}
	b.StopTimer()
	median := make([]float64, len(sides))
	for i, s := range sides {
		slices.Sort(latencies[i])
		b.ReportMetric(float64(b.N)/elapsed[i].Seconds(), s.name+"-msgs/s")
		b.ReportMetric(float64(latencies[i][b.N/2].Microseconds()), s.name+"-p50-us")
		slices.Sort(ratios[i])
		median[i] = ratios[i][len(ratios[i])/2]
	}
	return median
}

// warm sizes db's pool to 16 connections, as BenchmarkThroughput's, and
// opens all of them up front, so that neither side of a comparison pays
// for connections that the other then reuses.
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
