package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// claimOption is one way the PostgreSQL inbox table could be built, for
// what its claim writes and what its purge reads. alter turns the
// library's table (InitializeSchema's, its purge index named index) into
// the option's; nil keeps it.
type claimOption struct {
	name  string
	alter func(table, index string) []string
	// lockedClaim: claim as the partitioned dialect does, through a
	// function (created by alter) that takes the key's advisory lock and
	// inserts WHERE NOT EXISTS, instead of INSERT ... ON CONFLICT.
	lockedClaim bool
}

var claimOptions = []claimOption{
	// The library's table: primary key (consumer, message_id) and a B-tree
	// on processed_at.
	{name: "btree"},
	// The same B-tree packed full: its rightmost leaf, where every claim
	// lands, splits at 100 % instead of 90 %.
	{name: "btree-fillfactor-100", alter: func(table, index string) []string {
		return []string{"DROP INDEX " + index, "CREATE INDEX " + index + " ON " + table + " (processed_at) WITH (fillfactor = 100)"}
	}},
	// A BRIN index on processed_at (one summary per 128 heap pages) as it
	// is once the table runs: the range that inserts fill is not
	// summarised yet (VACUUM summarises only complete ranges), and an
	// insert into an unsummarised range writes nothing to the index. CREATE
	// INDEX summarises the first range even on an empty table, so it is
	// desummarised here.
	{name: "brin", alter: func(table, index string) []string {
		return []string{"DROP INDEX " + index, "CREATE INDEX " + index + " ON " + table + " USING brin (processed_at)",
			"SELECT brin_desummarize_range('" + index + "', 0)"}
	}},
	// The same BRIN index while the range being filled is summarised (as
	// CREATE INDEX leaves it, or brin_summarize_range): every claim's
	// processed_at is the newest, so each insert widens the summary.
	{name: "brin-summarized", alter: func(table, index string) []string {
		return []string{"DROP INDEX " + index, "CREATE INDEX " + index + " ON " + table + " USING brin (processed_at)"}
	}},
	// No purge index at all, for reference: what the index costs.
	{name: "no-purge-index", alter: func(_, index string) []string { return []string{"DROP INDEX " + index} }},
	// The claim without ON CONFLICT: its speculative insertion writes a
	// HEAP_CONFIRM record after the row. The partitioned dialect's claim
	// function (the key's advisory lock, then INSERT ... WHERE NOT EXISTS,
	// one round trip), created on the library's plain table.
	{name: "locked-not-exists", lockedClaim: true, alter: func(table, _ string) []string {
		return []string{"CREATE FUNCTION " + table + "_claim(text, text, bigint) RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$" +
			"BEGIN PERFORM pg_advisory_xact_lock($3); INSERT INTO " + table + " (consumer, message_id, processed_at)" +
			" SELECT $1, $2, now() WHERE NOT EXISTS (SELECT 1 FROM " + table + " WHERE consumer = $1 AND message_id = $2);" +
			" RETURN FOUND; END$$"}
	}},
	// A narrower key: message_id as uuid (16 bytes) instead of text (37
	// for a UUID), which only ids that are UUIDs could use.
	{name: "uuid-key", alter: func(table, _ string) []string {
		return []string{"ALTER TABLE " + table + " ALTER COLUMN message_id TYPE uuid USING message_id::uuid"}
	}},
}

// benchmarkClaimOptions is BenchmarkClaimCost/postgres-options/<option>/<path>:
// BenchmarkClaimCost's postgres counters for the inbox's statements
// written out by hand (claimByHand: BEGIN, the claim, the handler's
// insert, COMMIT; ROLLBACK for a duplicate), on the library's table
// altered as each claimOption says. Some options are tables the inbox
// refuses (Inbox.Verify), hence the hand-written claim; its "btree" row
// counts the same as BenchmarkClaimCost/postgres/inbox. With -short only
// "processed" runs.
func benchmarkClaimOptions(b *testing.B) {
	db, m := openMeteredPostgres(b, nil, 1)
	counts := newPgCounts(b, db)
	c := costCounter{wire: m.load, start: counts.start}
	paths := []string{"processed", "duplicate"}
	if testing.Short() {
		paths = paths[:1] // a duplicate writes nothing with any option
	}
	for _, o := range claimOptions {
		for _, path := range paths {
			b.Run(o.name+"/"+path, func(b *testing.B) {
				_, table := newInbox(b, db, inbox.PostgreSQL, "bench")
				if o.alter != nil {
					for _, s := range o.alter(table, table+"_processed_at_idx") {
						if _, err := db.Exec(s); err != nil {
							b.Fatal(err)
						}
					}
				}
				business := businessTable(b, db)
				if o.lockedClaim {
					b.Cleanup(func() { db.Exec("DROP FUNCTION IF EXISTS " + table + "_claim(text, text, bigint)") })
				}
				measureCost(b, c, claimByHand(db, table, business, o.lockedClaim), []string{business, table}, path)
			})
		}
	}
}

// claimByHand is what the inbox middleware sends on PostgreSQL (consumer
// "bench"), with the handler's insert into business, and no middleware.
// locked: the claim calls table's claim function (claimOption.lockedClaim)
// with the key's lock hash, as the partitioned dialect's claim does.
func claimByHand(db *sqlx.DB, table, business string, locked bool) message.HandlerFunc {
	claim := "INSERT INTO " + table + " (consumer, message_id, processed_at) VALUES ($1, $2, now())" +
		" ON CONFLICT (consumer, message_id) DO NOTHING"
	args := func(id string) []any { return []any{"bench", id} }
	if locked {
		claim = "SELECT FROM " + table + "_claim($1, $2, $3) AS claimed WHERE claimed"
		args = func(id string) []any {
			h := fnv.New64a()
			h.Write([]byte("bench\x00" + id))
			return []any{"bench", id, int64(h.Sum64())}
		}
	}
	query := insertSQL(db, business)
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		tx, err := db.BeginTxx(ctx, nil)
		if err != nil {
			return nil, err
		}
		defer tx.Rollback() //nolint:errcheck // after Commit, ErrTxDone
		res, err := tx.ExecContext(ctx, claim, args(msg.UUID)...)
		if err != nil {
			return nil, err
		}
		if n, err := res.RowsAffected(); err != nil || n == 0 {
			return nil, errors.Join(err, tx.Rollback())
		}
		if _, err := tx.ExecContext(ctx, query, msg.UUID, 100); err != nil {
			return nil, err
		}
		return nil, tx.Commit()
	}
}

// purgeIndexes are the purge indexes benchmarkPurgePlan compares (names
// of claimOptions).
var purgeIndexes = []string{"btree", "brin", "no-purge-index"}

// purgePlanRows is how many rows benchmarkPurgePlan's tables hold (-short:
// a tenth), spread evenly over the Kafka-default window (fillWindow).
const purgePlanRows = 200_000

// purgeExpired are the shares of a purge-plan table's rows (percent) that
// are expired when the batch runs: 1, a purge that runs regularly; 50, the
// first purge after a long pause.
var purgeExpired = []int{1, 50}

// purgePlans caches benchmarkPurgePlan's results by index, then by share
// expired: the benchmark function runs more than once (b.N 1, then the
// requested count), and a plan does not depend on b.N.
var purgePlans sync.Map // string -> map[int]map[string]float64

// benchmarkPurgePlan is BenchmarkClaimCost/purge-plan/<index>/expired=<pct>:
// the purge's first batch statement on a table of purgePlanRows rows spread
// over the Kafka-default window, pct percent of them expired, with the
// purge index as in claimOptions. The statement is the library's own:
// inbox.Purge runs it (BatchSize 1000, OlderThan leaving pct percent of the
// window expired) on the table while it is still empty, and a tracer keeps
// its text. The table is then filled and vacuumed (which summarises a BRIN
// index's complete ranges, as autovacuum does on a running table), and the
// statement runs once under EXPLAIN (ANALYZE, BUFFERS) in a transaction
// that is rolled back. It reports uses-index (1 when the batch reads an
// index), rows-read (rows the scans of the table returned, filtered out or
// rechecked away), scan-buffers (shared blocks hit or read to choose the
// batch's rows), buffers (the same for the whole batch, its deletes and
// their index maintenance included), batch-ms (the execution time: timed,
// not counted), deleted (the batch's rows), expired (rows older than the
// cutoff) and index-kB (the purge index's size), and logs the plan.
func benchmarkPurgePlan(b *testing.B) {
	for _, name := range purgeIndexes {
		for _, pct := range purgeExpired {
			b.Run(fmt.Sprintf("%s/expired=%d", name, pct), func(b *testing.B) {
				got, ok := purgePlans.Load(name)
				if !ok {
					got = purgePlan(b, name)
					purgePlans.Store(name, got)
				}
				for unit, v := range got.(map[int]map[string]float64)[pct] {
					b.ReportMetric(v, unit)
				}
			})
		}
	}
}

// statementLog keeps the text of every statement its connections run.
type statementLog struct {
	mu  sync.Mutex
	sql []string
}

func (l *statementLog) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	l.mu.Lock()
	l.sql = append(l.sql, d.SQL)
	l.mu.Unlock()
	return ctx
}

func (l *statementLog) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// reset forgets the statements kept so far.
func (l *statementLog) reset() {
	l.mu.Lock()
	l.sql = nil
	l.mu.Unlock()
}

// find returns the first statement that contains s, or "".
func (l *statementLog) find(s string) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, q := range l.sql {
		if strings.Contains(q, s) {
			return q
		}
	}
	return ""
}

// planNode is the part of EXPLAIN's JSON node that purgePlan reads.
type planNode struct {
	NodeType       string     `json:"Node Type"`
	Relation       string     `json:"Relation Name"`
	Index          string     `json:"Index Name"`
	ActualRows     float64    `json:"Actual Rows"`
	Loops          float64    `json:"Actual Loops"`
	RemovedFilter  float64    `json:"Rows Removed by Filter"`
	RemovedRecheck float64    `json:"Rows Removed by Index Recheck"`
	SharedHit      float64    `json:"Shared Hit Blocks"`
	SharedRead     float64    `json:"Shared Read Blocks"`
	Plans          []planNode `json:"Plans"`
}

// purgePlan measures one purge index for benchmarkPurgePlan, for each
// share in purgeExpired.
func purgePlan(b *testing.B, name string) map[int]map[string]float64 {
	ctx := context.Background()
	log := &statementLog{}
	db, _ := openMeteredPostgres(b, log, 4) // the purge's lock holds a connection of its own
	table := "bench_inbox_" + testdb.RandomSuffix()
	b.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + table) })
	ib, err := inbox.New(inbox.Config{DB: db, Dialect: inbox.PostgreSQL, Table: table, Consumer: "bench"})
	if err != nil {
		b.Fatal(err)
	}
	if err := ib.InitializeSchema(ctx); err != nil {
		b.Fatal(err)
	}
	index := table + "_processed_at_idx"
	for _, o := range claimOptions {
		if o.name == name && o.alter != nil {
			for _, s := range o.alter(table, index) {
				if _, err := db.Exec(s); err != nil {
					b.Fatal(err)
				}
			}
		}
	}
	olderThan := func(pct int) time.Duration { return kafkaWindow / 100 * time.Duration(100-pct) }
	stmts := map[int]string{}
	for _, pct := range purgeExpired {
		log.reset()
		if _, err := inbox.Purge(ctx, inbox.PurgeConfig{DB: db, Dialect: inbox.PostgreSQL, Table: table,
			OlderThan: olderThan(pct), BatchSize: 1000}); err != nil {
			b.Fatal(err)
		}
		if stmts[pct] = log.find("WITH batch AS"); stmts[pct] == "" {
			b.Fatal("the purge ran no batch statement")
		}
	}
	rows := purgePlanRows
	if testing.Short() {
		rows /= 10
	}
	fillWindow(b, db, table, rows)
	if _, err := db.Exec("VACUUM ANALYZE " + table); err != nil {
		b.Fatal(err)
	}
	var indexSize int64
	if err := db.Get(&indexSize, "SELECT COALESCE(pg_relation_size(to_regclass($1)), 0)", index); err != nil {
		b.Fatal(err)
	}
	// explain runs stmt under EXPLAIN (options) and returns the plan and
	// the rows it deleted, then rolls the delete back.
	explain := func(stmt, options string) (string, float64) {
		tx, err := db.Beginx()
		if err != nil {
			b.Fatal(err)
		}
		defer tx.Rollback() //nolint:errcheck // the batch's delete must not stay
		var lines []string
		if err := tx.Select(&lines, "EXPLAIN ("+options+") "+stmt); err != nil {
			b.Fatal(err)
		}
		var left float64
		if err := tx.Get(&left, "SELECT count(*) FROM "+table); err != nil {
			b.Fatal(err)
		}
		return strings.Join(lines, "\n"), float64(rows) - left
	}
	all := map[int]map[string]float64{}
	for _, pct := range purgeExpired {
		got := map[string]float64{"uses-index": 0, "index-kB": float64(indexSize) / 1024}
		all[pct] = got
		var expired int64
		if err := db.Get(&expired, "SELECT count(*) FROM "+table+" WHERE processed_at < now() - $1 * interval '1 microsecond'",
			olderThan(pct).Microseconds()); err != nil {
			b.Fatal(err)
		}
		got["expired"] = float64(expired)
		plan, _ := explain(stmts[pct], "ANALYZE, BUFFERS, COSTS OFF, TIMING OFF")
		b.Logf("purge batch with %s on %d rows, %d expired:\n%s\n%s", name, rows, expired, stmts[pct], plan)
		js, deleted := explain(stmts[pct], "ANALYZE, BUFFERS, FORMAT JSON")
		got["deleted"] = deleted
		var out []struct {
			Plan          planNode `json:"Plan"`
			ExecutionTime float64  `json:"Execution Time"`
		}
		if err := json.Unmarshal([]byte(js), &out); err != nil || len(out) != 1 {
			b.Fatalf("EXPLAIN's JSON: %v\n%s", err, js)
		}
		got["batch-ms"] = out[0].ExecutionTime
		var walk func(n planNode)
		walk = func(n planNode) {
			if n.Index != "" {
				got["uses-index"] = 1
			}
			switch n.NodeType {
			case "Seq Scan", "Index Scan", "Index Only Scan", "Bitmap Heap Scan":
				if n.Relation == table {
					got["rows-read"] += n.ActualRows*n.Loops + n.RemovedFilter + n.RemovedRecheck
				}
			}
			got["buffers"] = max(got["buffers"], n.SharedHit+n.SharedRead)
			if n.NodeType == "Limit" {
				got["scan-buffers"] = n.SharedHit + n.SharedRead
			}
			for _, c := range n.Plans {
				walk(c)
			}
		}
		walk(out[0].Plan)
	}
	return all
}
