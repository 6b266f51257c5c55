package bench

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// BenchmarkClaimCost/<backend>/<variant>/<path> counts, rather than times,
// what one message costs: b.N messages, one at a time on a pool of one
// connection, through variant "baseline" (the handler's one insert in a
// bare transaction, BenchmarkThroughput's baseline) or "inbox" (the same
// handler behind the inbox middleware, called directly). path "processed"
// is b.N new messages; "duplicate" is the same b.N again, after they were
// processed (the baseline writes them again; the inbox skips them).
//
// Backends: postgres (database/sql over pgx's stdlib driver), postgres-
// partitioned (the same with inbox.PostgreSQLPartitioned), mysql (MariaDB),
// sqlite (modernc.org/sqlite) and postgres-pgx (package pgxinbox against a
// bare pgx transaction). Per message it reports:
//
//   - round-trips/msg (PostgreSQL, MariaDB): turns from writing to reading
//     on the connection (meter);
//   - statements/msg and prepares/msg: on PostgreSQL the server's
//     CommandComplete and ParseComplete messages, on MariaDB the client's
//     COM_QUERY + COM_STMT_EXECUTE and COM_STMT_PREPARE packets, on SQLite
//     what database/sql hands the driver (sqliteMeter);
//   - rows/msg: rows inserted, updated or deleted in the benchmark's tables
//     (each backend's source is in costCounter's implementations);
//   - index-entries/msg: computed, the rows each table received times the
//     B-tree indexes it has (a BRIN index takes no entry per row);
//   - PostgreSQL: wal-bytes/msg, wal-records/msg and index-wal-bytes/msg,
//     the WAL records of the benchmark's own transactions (pg_walinspect:
//     every record of a transaction that touched the benchmark's tables or
//     their indexes; a temporary replication slot keeps that WAL until it
//     is read), without full-page images, which fpi-bytes/msg counts
//     apart (they depend on when the last checkpoint was); wal-lsn-bytes/msg
//     is the advance of the WAL insert position, which includes whatever
//     other sessions wrote meanwhile;
//   - MariaDB: handler-writes/msg (Handler_write of the session: insert
//     attempts, a duplicate key included). Its redo log has no counter
//     per session or table (Innodb_lsn_current is server-wide, and other
//     sessions' writes swamped it here), so no bytes are reported;
//   - SQLite: wal-bytes/msg and wal-frames/msg, the growth of the WAL file
//     (automatic checkpoints off), a frame being one page written.
//
// Two more groups measure on PostgreSQL what the claim's writes would be
// with another purge index or key (postgres-options, see
// benchmarkClaimOptions) and what each index does to the purge's batch
// (purge-plan, see benchmarkPurgePlan). BENCHMARKS.md has the tables.
func BenchmarkClaimCost(b *testing.B) {
	for _, be := range costBackends {
		b.Run(be.name, func(b *testing.B) {
			c := be.open(b)
			for _, v := range []string{"baseline", "inbox"} {
				for _, path := range []string{"processed", "duplicate"} {
					b.Run(v+"/"+path, func(b *testing.B) {
						h, tables := c.handler(b, v)
						measureCost(b, c, h, tables, path)
					})
				}
			}
		})
	}
	b.Run("postgres-options", benchmarkClaimOptions)
	b.Run("purge-plan", benchmarkPurgePlan)
}

// costBackend opens one backend of BenchmarkClaimCost.
type costBackend struct {
	name string
	open func(b *testing.B) costCounter
}

// costCounter is one backend's pool of one connection with its meters.
type costCounter struct {
	// handler builds variant "baseline" or "inbox" on new tables and
	// returns it with the tables it writes.
	handler func(b *testing.B, variant string) (message.HandlerFunc, []string)
	// wire reads the pool's meter: round trips (-1: none, SQLite),
	// statements and prepares so far.
	wire func() (roundTrips, statements, prepares int64)
	// start reads the database's counters of tables; the function it
	// returns reads them again and returns the differences by metric name.
	start func(b *testing.B, tables []string) (stop func(b *testing.B) map[string]int64)
}

var costBackends = []costBackend{
	{"postgres", func(b *testing.B) costCounter {
		db, m := openMeteredPostgres(b, nil, 1)
		return sqlCostCounter(db, inbox.PostgreSQL, m.load, newPgCounts(b, db).start)
	}},
	{"postgres-partitioned", func(b *testing.B) costCounter {
		db, m := openMeteredPostgres(b, nil, 1)
		return sqlCostCounter(db, inbox.PostgreSQLPartitioned, m.load, newPgCounts(b, db).start)
	}},
	{"mysql", func(b *testing.B) costCounter {
		db, m := openMeteredMySQL(b)
		return sqlCostCounter(db, inbox.MySQL, m.load, mysqlCounts{db}.start)
	}},
	{"sqlite", func(b *testing.B) costCounter {
		path := filepath.Join(b.TempDir(), "cost.db")
		db, m := openMeteredSQLite(b, path)
		wire := func() (int64, int64, int64) { return -1, m.statements.Load(), m.prepares.Load() }
		return sqlCostCounter(db, inbox.SQLite, wire, sqliteCounts{db, m, path}.start)
	}},
	{"postgres-pgx", func(b *testing.B) costCounter {
		p, m := openMeteredPgxPool(b)
		return costCounter{
			handler: func(b *testing.B, variant string) (message.HandlerFunc, []string) {
				business := businessTable(b, p.db)
				query := insertSQL(p.db, business)
				if variant == "baseline" {
					return pgxBaselineOn(p, query), []string{business}
				}
				ib, table := newPgxInbox(b, p)
				return pgxInboxOn(ib, query), []string{business, table}
			},
			wire:  m.load,
			start: newPgCounts(b, p.db).start,
		}
	}},
}

// load returns what m counted so far.
func (m *meter) load() (roundTrips, statements, prepares int64) {
	return m.roundTrips.Load(), m.statements.Load(), m.prepares.Load()
}

// sqlCostCounter is a costCounter for a database/sql pool: baseline is
// BenchmarkThroughput's, inbox the same insert behind an inbox of dialect
// d (consumer "bench").
func sqlCostCounter(db *sqlx.DB, d inbox.Dialect, wire func() (int64, int64, int64),
	start func(b *testing.B, tables []string) func(b *testing.B) map[string]int64) costCounter {
	return costCounter{
		handler: func(b *testing.B, variant string) (message.HandlerFunc, []string) {
			business := businessTable(b, db)
			if variant == "baseline" {
				return baseline(b, db, d, business), []string{business}
			}
			ib, table := newInbox(b, db, d, "bench")
			if d == inbox.PostgreSQLPartitioned {
				// Dropping the table leaves its claim function.
				b.Cleanup(func() { db.Exec("DROP FUNCTION IF EXISTS " + table + "_claim(text, text, bigint)") })
			}
			return inboxHandler(ib, insertSQL(db, business)), []string{business, table}
		},
		wire:  wire,
		start: start,
	}
}

// measureCost runs b.N messages through h one at a time (two first, to
// prepare statements and check the inbox table) and reports the counters'
// differences per message.
func measureCost(b *testing.B, c costCounter, h message.HandlerFunc, tables []string, path string) {
	handle := func(msgs []*message.Message) {
		for _, msg := range msgs {
			if _, err := h(msg); err != nil {
				b.Fatal(err)
			}
		}
	}
	handle(messages(2, 0))
	msgs := messages(b.N, 0)
	if path == "duplicate" {
		handle(msgs)
	}
	stop := c.start(b, tables)
	rt0, st0, pr0 := c.wire()
	b.ResetTimer()
	handle(msgs)
	b.StopTimer()
	rt1, st1, pr1 := c.wire()
	got := stop(b)
	n := float64(b.N)
	if rt0 >= 0 {
		b.ReportMetric(float64(rt1-rt0)/n, "round-trips/msg")
	}
	b.ReportMetric(float64(st1-st0)/n, "statements/msg")
	b.ReportMetric(float64(pr1-pr0)/n, "prepares/msg")
	for name, v := range got {
		b.ReportMetric(float64(v)/n, name+"/msg")
	}
}

// pgCounts reads PostgreSQL's counters through db, the measured pool of
// one connection, so that it can flush that session's statistics first.
type pgCounts struct {
	db         *sqlx.DB
	walinspect bool // pg_walinspect is installed in the database
}

// newPgCounts installs pg_walinspect in the test database if it is
// available; without it the WAL is counted by its insert position only.
func newPgCounts(b *testing.B, db *sqlx.DB) pgCounts {
	db.Exec("CREATE EXTENSION IF NOT EXISTS pg_walinspect") //nolint:errcheck // a concurrent run may race us; checked below
	var ok bool
	if err := db.Get(&ok, "SELECT EXISTS (SELECT FROM pg_extension WHERE extname = 'pg_walinspect')"); err != nil {
		b.Fatal(err)
	}
	if !ok {
		b.Log("pg_walinspect is not available: WAL is counted by the insert position only (wal-lsn-bytes), other sessions included")
	}
	return pgCounts{db: db, walinspect: ok}
}

// pgTupleStatsSQL sums, over the relations $1 (comma-separated oids),
// the rows inserted, updated and deleted (pg_stat_user_tables) and the
// B-tree index entries the inserts made (each inserted row gets one entry
// in each B-tree index of its table; nothing here updates rows).
const pgTupleStatsSQL = `SELECT COALESCE(SUM(s.n_tup_ins + s.n_tup_upd + s.n_tup_del), 0)::bigint AS rows,
	COALESCE(SUM(s.n_tup_ins * (SELECT count(*) FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid
		JOIN pg_am am ON am.oid = ic.relam WHERE i.indrelid = s.relid AND am.amname = 'btree')), 0)::bigint AS entries
FROM pg_stat_user_tables s WHERE s.relid = ANY(string_to_array($1, ',')::oid[])`

// pgWALSQL sums the WAL records from $1 to $2 of the transactions that
// touched the relation files $3 (comma-separated filenodes), and the
// records without a transaction that touched them: how many, their bytes
// without full-page images, the full-page images' bytes, and the bytes of
// index records (B-tree and BRIN).
const pgWALSQL = `WITH r AS (
	SELECT xid::text::bigint AS x, resource_manager AS rm, record_length AS len, fpi_length AS fpi,
		EXISTS (SELECT FROM regexp_matches(COALESCE(block_ref, ''), 'rel \d+/\d+/(\d+)', 'g') m
			WHERE m[1] = ANY(string_to_array($3, ','))) AS mine
	FROM pg_get_wal_records_info($1::pg_lsn, $2::pg_lsn)),
ours AS (SELECT DISTINCT x FROM r WHERE mine AND x <> 0)
SELECT count(*) AS records, COALESCE(SUM(len - fpi), 0)::bigint AS bytes, COALESCE(SUM(fpi), 0)::bigint AS fpi,
	COALESCE(SUM(len - fpi) FILTER (WHERE rm IN ('Btree', 'BRIN')), 0)::bigint AS index_bytes
FROM r WHERE (x <> 0 AND x IN (SELECT x FROM ours)) OR (x = 0 AND mine)`

func (p pgCounts) start(b *testing.B, tables []string) func(b *testing.B) map[string]int64 {
	var rels, files string
	err := p.db.Get(&rels, `WITH t AS (SELECT to_regclass(n) AS oid FROM unnest(string_to_array($1, ',')) n),
		rel AS (SELECT oid FROM t UNION SELECT inhrelid FROM pg_inherits WHERE inhparent IN (SELECT oid FROM t))
		SELECT string_agg(oid::oid::text, ',') FROM rel`, strings.Join(tables, ","))
	if err == nil {
		err = p.db.Get(&files, `SELECT COALESCE(string_agg(pg_relation_filenode(c.oid)::text, ','), '') FROM pg_class c
			WHERE (c.oid = ANY(string_to_array($1, ',')::oid[])
				OR c.oid IN (SELECT indexrelid FROM pg_index WHERE indrelid = ANY(string_to_array($1, ',')::oid[])))
			AND pg_relation_filenode(c.oid) IS NOT NULL`, rels)
	}
	if err != nil {
		b.Fatal(err)
	}
	stats := func() (rows, entries int64) {
		// Statistics reach the shared counters when the session flushes
		// them, by default at most once a second: force it (PostgreSQL
		// 15+), on the one connection that did the work.
		if _, err := p.db.Exec("SELECT pg_stat_force_next_flush()"); err != nil {
			b.Fatal(err)
		}
		var s struct {
			Rows    int64 `db:"rows"`
			Entries int64 `db:"entries"`
		}
		if err := p.db.Get(&s, pgTupleStatsSQL, rels); err != nil {
			b.Fatal(err)
		}
		return s.Rows, s.Entries
	}
	rows0, entries0 := stats()
	// A checkpoint may remove WAL segments before pg_walinspect reads
	// them (other sessions share the server and write a lot): a temporary
	// replication slot keeps the WAL from here until it is dropped, or the
	// one connection that holds it closes.
	slot := ""
	if p.walinspect {
		slot = "bench_cost_" + testdb.RandomSuffix()
		if _, err := p.db.Exec("SELECT pg_create_physical_replication_slot($1, true, true)", slot); err != nil {
			b.Logf("no replication slot (%v): a checkpoint during the run may remove the WAL to read", err)
			slot = ""
		}
	}
	var lsn0 string
	if err := p.db.Get(&lsn0, "SELECT pg_current_wal_insert_lsn()::text"); err != nil {
		b.Fatal(err)
	}
	return func(b *testing.B) map[string]int64 {
		if slot != "" {
			defer func() {
				if _, err := p.db.Exec("SELECT pg_drop_replication_slot($1)", slot); err != nil {
					b.Error(err)
				}
			}()
		}
		var end struct {
			LSNBytes int64  `db:"lsn_bytes"`
			Flushed  int64  `db:"flushed"` // WAL flushed since lsn0
			Flush    string `db:"flush"`
		}
		err := p.db.Get(&end, `SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), $1::pg_lsn)::bigint AS lsn_bytes,
			pg_wal_lsn_diff(pg_current_wal_flush_lsn(), $1::pg_lsn)::bigint AS flushed,
			pg_current_wal_flush_lsn()::text AS flush`, lsn0)
		if err != nil {
			b.Fatal(err)
		}
		rows1, entries1 := stats()
		got := map[string]int64{"rows": rows1 - rows0, "index-entries": entries1 - entries0, "wal-lsn-bytes": end.LSNBytes}
		if !p.walinspect {
			return got
		}
		var w struct {
			Records    int64 `db:"records"`
			Bytes      int64 `db:"bytes"`
			FPI        int64 `db:"fpi"`
			IndexBytes int64 `db:"index_bytes"`
		}
		// Every commit that wrote waited for its WAL to be flushed, so
		// the flushed WAL holds all of the benchmark's records.
		if end.Flushed > 0 {
			if err := p.db.Get(&w, pgWALSQL, lsn0, end.Flush, files); err != nil {
				b.Fatal(err)
			}
		}
		got["wal-bytes"], got["wal-records"], got["fpi-bytes"], got["index-wal-bytes"] = w.Bytes, w.Records, w.FPI, w.IndexBytes
		return got
	}
}

// mysqlCounts reads MariaDB's counters through db, the measured pool of
// one connection, whose session counters (SHOW SESSION STATUS) are then
// the benchmark's alone.
//
// Counted: the rows each table holds (COUNT(*): every insert here
// commits), the session's Handler_update (rows updated: the claim's ON
// DUPLICATE KEY UPDATE on a duplicate, rolled back) and Handler_write
// (insert attempts, the duplicate's failed one included). Computed: index
// entries, a table's new rows times its indexes (InnoDB's clustered
// primary key included) plus, per row updated, the clustered record and
// the processed_at index's new entry (the inbox table's update changes
// processed_at).
type mysqlCounts struct{ db *sqlx.DB }

func (m mysqlCounts) start(b *testing.B, tables []string) func(b *testing.B) map[string]int64 {
	indexes := make([]int64, len(tables))
	for i, t := range tables {
		if err := m.db.Get(&indexes[i], `SELECT COUNT(DISTINCT INDEX_NAME) FROM information_schema.STATISTICS
			WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?`, t); err != nil {
			b.Fatal(err)
		}
	}
	counts := func() []int64 {
		out := make([]int64, len(tables))
		for i, t := range tables {
			if err := m.db.Get(&out[i], "SELECT COUNT(*) FROM "+t); err != nil {
				b.Fatal(err)
			}
		}
		return out
	}
	status := func() map[string]int64 {
		rows, err := m.db.Query("SHOW SESSION STATUS WHERE Variable_name IN ('Handler_write', 'Handler_update', 'Handler_delete')")
		if err != nil {
			b.Fatal(err)
		}
		defer rows.Close()
		out := map[string]int64{}
		for rows.Next() {
			var name string
			var v int64
			if err := rows.Scan(&name, &v); err != nil {
				b.Fatal(err)
			}
			out[name] = v
		}
		if err := rows.Err(); err != nil {
			b.Fatal(err)
		}
		return out
	}
	counts0 := counts()
	session0 := status() // last: the queries above are not the benchmark's
	return func(b *testing.B) map[string]int64 {
		session1 := status() // first, as above
		counts1 := counts()
		updated := session1["Handler_update"] - session0["Handler_update"]
		got := map[string]int64{
			"rows":           updated + session1["Handler_delete"] - session0["Handler_delete"],
			"index-entries":  2 * updated,
			"handler-writes": session1["Handler_write"] - session0["Handler_write"],
		}
		for i := range tables {
			got["rows"] += counts1[i] - counts0[i]
			got["index-entries"] += (counts1[i] - counts0[i]) * indexes[i]
		}
		return got
	}
}

// sqliteCounts reads SQLite's counters: the rows written per table (the
// pre-update hook, sqliteMeter) and the WAL file's size. Computed: index
// entries, a table's rows written times its B-trees (a rowid table's own
// B-tree and each index; a WITHOUT ROWID table is its primary key's
// B-tree).
type sqliteCounts struct {
	db   *sqlx.DB
	m    *sqliteMeter
	path string
}

func (s sqliteCounts) start(b *testing.B, tables []string) func(b *testing.B) map[string]int64 {
	btrees := make([]int64, len(tables))
	for i, t := range tables {
		err := s.db.Get(&btrees[i], `SELECT (SELECT count(*) FROM pragma_index_list(?1))
			+ (SELECT NOT wr FROM pragma_table_list WHERE schema = 'main' AND name = ?1)`, t)
		if err != nil {
			b.Fatal(err)
		}
	}
	var pageSize int64
	if err := s.db.Get(&pageSize, "PRAGMA page_size"); err != nil {
		b.Fatal(err)
	}
	walSize := func() int64 {
		fi, err := os.Stat(s.path + "-wal")
		if err != nil {
			b.Fatal(err)
		}
		return fi.Size()
	}
	rows0, wal0 := s.m.rowsOf(tables), walSize()
	return func(b *testing.B) map[string]int64 {
		rows1, wal1 := s.m.rowsOf(tables), walSize()
		got := map[string]int64{"wal-bytes": wal1 - wal0, "wal-frames": (wal1 - wal0) / (pageSize + 24)}
		for i, t := range tables {
			got["rows"] += rows1[t] - rows0[t]
			got["index-entries"] += (rows1[t] - rows0[t]) * btrees[i]
		}
		return got
	}
}
