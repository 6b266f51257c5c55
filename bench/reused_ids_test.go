package bench

import (
	"context"
	"fmt"
	"math"
	"runtime/pprof"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// reusedIDRounds is how many turns each side of BenchmarkReusedIDCheck
// takes at least: the sides alternate, so that a slower moment of the
// machine falls on both. Above reusedIDRounds*reusedIDRoundSize messages
// (-benchtime) each round holds reusedIDRoundSize and the rounds are more,
// which narrows the confidence interval of the paired ratios.
const (
	reusedIDRounds    = 20
	reusedIDRoundSize = 2000
)

// reusedIDRoundCount is the number of rounds of BenchmarkReusedIDCheck for
// b.N messages: reusedIDRounds, or more rounds of reusedIDRoundSize
// messages, a multiple of len(balancedOrders) so that each order runs as
// often as the others.
func reusedIDRoundCount(n int) int {
	rounds := max(reusedIDRounds, n/reusedIDRoundSize)
	return (rounds + len(balancedOrders) - 1) / len(balancedOrders) * len(balancedOrders)
}

// medianInterval95 returns the median of xs and a distribution-free 95 %
// confidence interval for it: the order statistics k and n-k+1 (1-based)
// with k = ⌊(n − 1.96·√n)/2⌋, the normal approximation of the binomial
// sign test (for n ≥ 6; below that, the smallest and largest of xs).
func medianInterval95(xs []float64) (median, lo, hi float64) {
	s := slices.Clone(xs)
	slices.Sort(s)
	n := len(s)
	k := int(math.Floor((float64(n) - 1.96*math.Sqrt(float64(n))) / 2))
	k = max(k, 1)
	return s[n/2], s[k-1], s[n-k]
}

// BenchmarkReusedIDCheck/<db>/dup=<pct>: what detecting reused message ids
// (Config.ReusedIDs) costs. Four handlers that insert one business row
// take turns, reusedIDRounds rounds of b.N/reusedIDRounds messages each, 8
// in flight, dup percent of them redeliveries: the bare transaction
// (baseline), the inbox with the check (checked: the default,
// ReusedIDsRefuse, which stores a fingerprint with each claim and reads it
// back on each duplicate) and the inbox without it (unchecked:
// ReusedIDsOff, the inbox as it was before the check), and checked-cold,
// whose duplicates reach an inbox that did not commit them (coldDuplicates;
// checked's are redeliveries to the inbox that committed them, which it
// remembers). Reports each side's
// msgs/s (median of its rounds) and the ratios checked/baseline,
// unchecked/baseline and checked/unchecked; and each side's CPU time per
// message, this process's and the database server's together over all its
// rounds (cpuClock), with the cost ratios checked/unchecked-cpu and
// checked-cold/unchecked-cpu (1.03: a check that costs 3 % more). The
// paired-* ratios are checked over unchecked round by round, their median
// (the sides take their turns in balancedOrders). Each side's turns carry
// the pprof label side=<name>.
func BenchmarkReusedIDCheck(b *testing.B) {
	for _, dup := range []int{0, 50} {
		b.Run(fmt.Sprintf("postgres-pgx/dup=%d", dup), func(b *testing.B) {
			p := openPgxPool(b, 16, nil)
			sides := map[string]message.HandlerFunc{"baseline": pgxBaseline(b, p)}
			newInbox := func(table string, check inbox.ReusedIDCheck) *pgxinbox.Inbox {
				ib, err := pgxinbox.New(pgxinbox.Config{Pool: p.pool, Table: table, Consumer: "bench", ReusedIDs: check})
				if err != nil {
					b.Fatal(err)
				}
				b.Cleanup(func() { ib.Close() })
				if err := ib.InitializeSchema(b.Context()); err != nil {
					b.Fatal(err)
				}
				return ib
			}
			for name, check := range map[string]inbox.ReusedIDCheck{"checked": inbox.ReusedIDsRefuse, "unchecked": inbox.ReusedIDsOff} {
				table := "bench_inbox_" + testdb.RandomSuffix()
				testdb.DropLater(b, p.db, table)
				sides[name] = pgxInboxOn(newInbox(table, check), insertSQL(p.db, businessTable(b, p.db)))
			}
			table := "bench_inbox_" + testdb.RandomSuffix()
			testdb.DropLater(b, p.db, table)
			query := insertSQL(p.db, businessTable(b, p.db))
			sides["checked-cold"] = coldDuplicates(pgxInboxOn(newInbox(table, inbox.ReusedIDsRefuse), query),
				pgxInboxOn(newInbox(table, inbox.ReusedIDsRefuse), query))
			runReusedIDSides(b, sides, dup, serverFor("postgres"))
		})
	}
	for _, d := range databases() {
		for _, dup := range []int{0, 50} {
			b.Run(fmt.Sprintf("%s/dup=%d", d.Name, dup), func(b *testing.B) {
				db := d.Open(b)
				db.SetMaxOpenConns(16)
				db.SetMaxIdleConns(16)
				sides := map[string]message.HandlerFunc{"baseline": baseline(b, db, d.Dialect, businessTable(b, db))}
				for name, check := range map[string]inbox.ReusedIDCheck{"checked": inbox.ReusedIDsRefuse, "unchecked": inbox.ReusedIDsOff} {
					ib, _ := newInboxWith(b, inbox.Config{DB: db, Dialect: d.Dialect, Consumer: "bench", ReusedIDs: check})
					if check == inbox.ReusedIDsRefuse && !ib.ReusedIDsDetected() {
						b.Fatal("the checked side does not detect reused ids")
					}
					sides[name] = inboxHandler(ib, insertSQL(db, businessTable(b, db)))
				}
				first, table := newInboxWith(b, inbox.Config{DB: db, Dialect: d.Dialect, Consumer: "bench"})
				again, err := inbox.New(inbox.Config{DB: db, Dialect: d.Dialect, Consumer: "bench", Table: table})
				if err != nil {
					b.Fatal(err)
				}
				query := insertSQL(db, businessTable(b, db))
				sides["checked-cold"] = coldDuplicates(inboxHandler(first, query), inboxHandler(again, query))
				runReusedIDSides(b, sides, dup, serverFor(d.Name))
			})
		}
	}
}

// balancedOrders are the orders in which runReusedIDSides's four sides take
// their turns, one per round in a cycle: each side goes first once and
// follows each other side once (a Williams design), so that what a side
// leaves behind (a WAL to checkpoint, a cold cache, garbage to collect)
// falls on every other side alike.
var balancedOrders = [][]int{{0, 1, 3, 2}, {1, 2, 0, 3}, {2, 3, 1, 0}, {3, 0, 2, 1}}

// runReusedIDSides runs the sides of BenchmarkReusedIDCheck in turns and
// reports them, with the CPU time each side's messages cost this process
// and the database server (clock).
func runReusedIDSides(b *testing.B, sides map[string]message.HandlerFunc, dup int, clock cpuClock) {
	order := []string{"baseline", "checked", "checked-cold", "unchecked"}
	rounds := reusedIDRoundCount(b.N)
	per := max(b.N/rounds, 1)
	rates := map[string][]float64{}
	cpu := map[string]time.Duration{}
	roundCPU := map[string][]time.Duration{}
	b.ResetTimer()
	for round := range rounds {
		for _, side := range balancedOrders[round%len(balancedOrders)] {
			name := order[side]
			msgs := messages(per, dup)
			process, server := clock.now()
			var elapsed time.Duration
			var err error
			// Labelled by side, so that a CPU profile of the run tells the
			// sides apart (go tool pprof -tagfocus side=checked).
			pprof.Do(b.Context(), pprof.Labels("side", name), func(context.Context) {
				elapsed, err = feed(sides[name], msgs, 8, make([]time.Duration, len(msgs)))
			})
			if err != nil {
				b.Fatalf("%s: %v", name, err)
			}
			process2, server2 := clock.now()
			cpu[name] += process2 - process + server2 - server
			roundCPU[name] = append(roundCPU[name], process2-process+server2-server)
			rates[name] = append(rates[name], float64(per)/elapsed.Seconds())
		}
	}
	b.StopTimer()
	median := func(xs []float64) float64 {
		s := slices.Clone(xs)
		slices.Sort(s)
		return s[len(s)/2]
	}
	base, checked, unchecked := median(rates["baseline"]), median(rates["checked"]), median(rates["unchecked"])
	cold := median(rates["checked-cold"])
	b.ReportMetric(base, "baseline-msgs/s")
	b.ReportMetric(checked, "checked-msgs/s")
	b.ReportMetric(cold, "checked-cold-msgs/s")
	b.ReportMetric(unchecked, "unchecked-msgs/s")
	b.ReportMetric(checked/base, "checked/baseline")
	b.ReportMetric(unchecked/base, "unchecked/baseline")
	b.ReportMetric(checked/unchecked, "checked/unchecked")
	// The same ratios round by round, the two sides' turns of one round
	// being minutes apart at most: their median leaves out the rounds a
	// busy moment of the machine fell on one side only.
	paired := func(a, b []float64) (median, lo, hi float64) {
		ratios := make([]float64, len(a))
		for i := range a {
			ratios[i] = a[i] / b[i]
		}
		return medianInterval95(ratios)
	}
	seconds := func(ds []time.Duration) []float64 {
		xs := make([]float64, len(ds))
		for i, d := range ds {
			xs[i] = d.Seconds()
		}
		return xs
	}
	ratio, lo, hi := paired(rates["checked"], rates["unchecked"])
	b.ReportMetric(ratio, "paired-checked/unchecked")
	b.ReportMetric(lo, "paired-checked/unchecked-lo95")
	b.ReportMetric(hi, "paired-checked/unchecked-hi95")
	ratio, lo, hi = paired(seconds(roundCPU["checked"]), seconds(roundCPU["unchecked"]))
	b.ReportMetric(ratio, "paired-checked/unchecked-cpu")
	b.ReportMetric(lo, "paired-checked/unchecked-cpu-lo95")
	b.ReportMetric(hi, "paired-checked/unchecked-cpu-hi95")
	b.ReportMetric(cold/unchecked, "checked-cold/unchecked")
	// CPU per message, this process's and the server's, over every round.
	perMsg := func(side string) float64 {
		return float64(cpu[side].Microseconds()) / float64(per*rounds)
	}
	b.ReportMetric(perMsg("baseline"), "baseline-cpu-µs/msg")
	b.ReportMetric(perMsg("checked"), "checked-cpu-µs/msg")
	b.ReportMetric(perMsg("unchecked"), "unchecked-cpu-µs/msg")
	b.ReportMetric(perMsg("checked")/perMsg("unchecked"), "checked/unchecked-cpu")
	b.ReportMetric(perMsg("checked-cold")/perMsg("unchecked"), "checked-cold/unchecked-cpu")
}

// coldDuplicates is the checked-cold side of BenchmarkReusedIDCheck: two
// checked inboxes on one table, as two processes of one service. first
// processes the first delivery of each message; again gets every
// redelivery, of keys it never committed, so that each duplicate reads its
// stored fingerprint (a redelivery after a rebalance or a restart).
func coldDuplicates(first, again message.HandlerFunc) message.HandlerFunc {
	var seen sync.Map
	return func(msg *message.Message) ([]*message.Message, error) {
		if _, dup := seen.LoadOrStore(msg.UUID, true); dup {
			return again(msg)
		}
		return first(msg)
	}
}
