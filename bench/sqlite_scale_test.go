package bench

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

var sqliteScaleRows = flag.String("sqlite-scale-rows", "10000,5000000",
	"BenchmarkSQLiteScale: comma-separated inbox sizes, the first one the base the others are compared with; "+
		"-short uses 10000,50000")

// sqliteVariant is one SQLite configuration BenchmarkSQLiteScale measures:
// a table shape and the connection settings an application can choose.
type sqliteVariant struct {
	name string
	// shape is the table: "" the inbox's own (WITHOUT ROWID, purge index),
	// "rowid" a rowid table whose primary key is a separate unique index,
	// "no-purge-index" the inbox's own without the processed_at index (a
	// measurement only: the purge needs the index).
	shape string
	// pageSize is the file's page size in bytes, 0 for SQLite's default (4096).
	pageSize int
	// params are DSN parameters added to testdb.SQLiteParams.
	params string
	// conns is the pool's MaxOpenConns, 0 for BenchmarkScale's 16.
	conns int
}

var sqliteVariants = []sqliteVariant{
	{name: "default"},
	{name: "cache-256MB", params: "_pragma=cache_size(-262144)"},
	{name: "mmap-1GB", params: "_pragma=mmap_size(1073741824)"},
	{name: "cache-256MB-mmap-1GB", params: "_pragma=cache_size(-262144)&_pragma=mmap_size(1073741824)"},
	{name: "conns-1", conns: 1},
	{name: "conns-1-cache-256MB", conns: 1, params: "_pragma=cache_size(-262144)"},
	{name: "autocheckpoint-10000", params: "_pragma=wal_autocheckpoint(10000)"},
	{name: "synchronous-off", params: "_sync=OFF"}, // _sync, the alias, wins over SQLiteParams' _synchronous
	{name: "rowid", shape: "rowid"},
	{name: "no-purge-index", shape: "no-purge-index"},
	{name: "page-8192", pageSize: 8192},
	{name: "page-1024", pageSize: 1024},
}

// BenchmarkSQLiteScale/<variant>/rows=<n>: what each SQLite setting does to
// the claim as the table grows. Each variant (sqliteVariants) is the inbox
// variant of BenchmarkScale (dup=0, 8 in flight, one business insert per
// message) on its own file with rows of other messages already in its
// table. rows=<base> (the first size) runs the variant and the default at
// the base size; every larger rows=<n> runs four sides: default and variant,
// each at the base size and at n rows. The sides take turns, a fortieth of
// the messages at a time (as BenchmarkPreparedClaim), and each ratio is the
// median over the rounds of one side's rate over another's in the same
// round, so that the shared machine's load weighs on all of them:
//
//   - x-base: the variant at n rows over the variant at the base size (the
//     target is >= 0.9 at 5M rows over 10k);
//   - x-default: the variant at n rows over the default at n rows;
//   - x-default-base: the variant at n rows over the default at the base size.
//
// Per side it reports msgs/s and, per message, the process's CPU time and
// read/write system calls (see sqliteRounds): a page that SQLite's cache
// does not hold is a read, a WAL frame two writes, so they show where a
// larger table costs more without depending on the machine's load. It
// also reports the depth of the primary key's B-tree (pk-depth), and the
// file's size in MB, of the variant's file at n rows. The default sizes
// (-sqlite-scale-rows) take a few minutes to fill; -short uses 10000,50000.
func BenchmarkSQLiteScale(b *testing.B) {
	sizes := *sqliteScaleRows
	if testing.Short() {
		sizes = "10000,50000"
	}
	var rows []int
	for _, s := range strings.Split(sizes, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < 0 {
			b.Fatalf("-sqlite-scale-rows: %q is not a row count", s)
		}
		rows = append(rows, n)
	}
	base := rows[0]
	f := &sqliteFiles{top: b, dir: b.TempDir(), filled: map[string]string{}, sides: map[string]*sqliteSide{}}
	for _, v := range sqliteVariants {
		b.Run(v.name, func(b *testing.B) {
			for _, n := range rows {
				// Fill and open every side once per size, not once per b.N probe.
				// The default at the base size is the variant's own (every run
				// adds b.N rows to it); the default at a larger size is shared
				// (b.N rows are little beside millions).
				def, own := sqliteVariants[0], v.name
				sides := []*sqliteSide{f.side(b, def, base, own)}
				if v.name != def.name {
					sides = append(sides, f.side(b, v, base, own))
				}
				if n != base {
					sides = append(sides, f.side(b, def, n, ""))
					if v.name != def.name {
						sides = append(sides, f.side(b, v, n, own))
					}
				}
				vBase, vN, dN := sides[len(sides)-1], sides[len(sides)-1], sides[0]
				if n != base {
					vBase, dN = sides[(len(sides)-1)/2], sides[len(sides)/2]
				}
				b.Run(fmt.Sprintf("rows=%d", n), func(b *testing.B) {
					r := sqliteRounds(b, 8, sides)
					b.ReportMetric(r.median(vN, dN), "x-default")
					if n != base {
						b.ReportMetric(r.median(vN, vBase), "x-base")
						b.ReportMetric(r.median(vN, sides[0]), "x-default-base")
					}
					b.ReportMetric(float64(vN.depth), "pk-depth")
					b.ReportMetric(vN.sizeMB, "file-MB")
				})
			}
		})
	}
}

// sqliteFiles holds the filled database files and the open sides of one
// BenchmarkSQLiteScale run, so that each is made once.
type sqliteFiles struct {
	top    *testing.B // closes the sides' pools when the whole run ends
	dir    string
	filled map[string]string      // shape/page size/rows: a closed, filled file to copy
	sides  map[string]*sqliteSide // variant/rows
}

// sqliteSide is one variant at one size: its handler on its own file.
type sqliteSide struct {
	name   string // <variant>-<rows>, the prefix of its metrics
	h      message.HandlerFunc
	depth  int     // levels of the primary key's B-tree, the leaves included
	sizeMB float64 // the file's size when filled
}

// side returns variant v at n rows for the variant named owner (empty:
// shared by all): a copy of the filled file of v's shape and page size,
// opened with v's settings, with an inbox on its table.
func (f *sqliteFiles) side(b *testing.B, v sqliteVariant, n int, owner string) *sqliteSide {
	key := fmt.Sprintf("%s/%d/%s", v.name, n, owner)
	if s, ok := f.sides[key]; ok {
		return s
	}
	const table = "bench_inbox"
	master := f.fill(b, v, n, table)
	path := filepath.Join(f.dir, fmt.Sprintf("%s-%d-%s.db", v.name, n, owner))
	copyFile(b, master, path)
	db, err := sqlx.Open("sqlite", "file:"+path+"?"+testdb.SQLiteParams+"&"+v.params)
	if err != nil {
		b.Fatal(err)
	}
	f.top.Cleanup(func() { db.Close() })
	if v.conns > 0 {
		db.SetMaxOpenConns(v.conns)
		db.SetMaxIdleConns(v.conns)
	} else {
		warm(b, db)
	}
	ib, err := inbox.New(inbox.Config{DB: db, Dialect: inbox.SQLite, Table: table, Consumer: "bench"})
	if err != nil {
		b.Fatal(err)
	}
	// Verifies the table (and marks it verified for the middleware).
	if err := ib.InitializeSchema(context.Background()); err != nil {
		b.Fatal(err)
	}
	if v.shape == "no-purge-index" {
		// After InitializeSchema, which would create it, and Verify, which
		// refuses a table without it.
		if _, err := db.Exec(`DROP INDEX "` + table + `_processed_at_idx"`); err != nil {
			b.Fatal(err)
		}
	}
	// businessTable's table, left in the file (which goes when the run ends).
	const business = "bench_business"
	if _, err := db.Exec("CREATE TABLE " + business + " (id INTEGER PRIMARY KEY, message_id VARCHAR(255) NOT NULL, amount INTEGER NOT NULL)"); err != nil {
		b.Fatal(err)
	}
	s := &sqliteSide{name: fmt.Sprintf("%s-%d", v.name, n), h: inboxHandler(ib, insertSQL(db, business))}
	s.depth, s.sizeMB = sqliteShape(b, db, table, v.shape)
	f.sides[key] = s
	return s
}

// fill returns a closed file whose table (named table, of v's shape and page
// size) holds n rows, made once per shape, page size and size: random ids
// inserted in no key order, as real ones arrive, so that the primary key's
// leaves are as full as a grown inbox's are.
func (f *sqliteFiles) fill(b *testing.B, v sqliteVariant, n int, table string) string {
	shape := v.shape
	if shape == "no-purge-index" {
		shape = "" // the index is dropped from the copy
	}
	key := fmt.Sprintf("%s/%d/%d", shape, v.pageSize, n)
	if path, ok := f.filled[key]; ok {
		return path
	}
	path := filepath.Join(f.dir, fmt.Sprintf("fill-%s-%d-%d.db", shape, v.pageSize, n))
	params := testdb.SQLiteParams + "&_pragma=cache_size(-1048576)" // 1 GB for the fill only
	if v.pageSize > 0 {
		params += fmt.Sprintf("&_pragma=page_size(%d)", v.pageSize) // before WAL makes the file
	}
	db, err := sqlx.Open("sqlite", "file:"+path+"?"+params)
	if err != nil {
		b.Fatal(err)
	}
	defer db.Close()
	db.SetMaxOpenConns(1)
	ddl, err := inbox.SchemaSQL(inbox.SQLite, table)
	if err != nil {
		b.Fatal(err)
	}
	if shape == "rowid" {
		ddl = `CREATE TABLE "` + table + `" (
    consumer     TEXT    NOT NULL,
    message_id   TEXT    NOT NULL,
    processed_at INTEGER NOT NULL,
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX "` + table + `_processed_at_idx" ON "` + table + `" (processed_at);`
	}
	if _, err := db.Exec(ddl); err != nil {
		b.Fatal(err)
	}
	start := time.Now()
	prefill(b, db, inbox.SQLite, table, n)
	if _, err := db.Exec("PRAGMA wal_checkpoint(TRUNCATE)"); err != nil {
		b.Fatal(err)
	}
	if n >= 1_000_000 {
		b.Logf("filled %s with %d rows in %v", path, n, time.Since(start).Round(time.Second))
	}
	f.filled[key] = path
	return path
}

// sqliteShape returns the depth of table's primary key B-tree (its leaves
// included) and the file's size in MB, both from db's catalog.
func sqliteShape(b *testing.B, db *sqlx.DB, table, shape string) (int, float64) {
	pk := table // a WITHOUT ROWID table is its primary key's B-tree
	if shape == "rowid" {
		pk = "sqlite_autoindex_" + table + "_1"
	}
	var depth int
	// Each level adds a 4-character step to dbstat's path ("/", "/000/", ...).
	if err := db.Get(&depth, "SELECT MAX(length(path)) / 4 + 1 FROM dbstat WHERE name = ?", pk); err != nil {
		b.Logf("pk-depth: %v", err) // dbstat is a compile-time option
	}
	var size int64
	if err := db.Get(&size, "SELECT page_count * page_size FROM pragma_page_count(), pragma_page_size()"); err != nil {
		b.Fatal(err)
	}
	return depth, float64(size) / (1 << 20)
}

// copyFile copies the SQLite file at from (closed, checkpointed: no WAL) to to.
func copyFile(b *testing.B, from, to string) {
	src, err := os.Open(from)
	if err != nil {
		b.Fatal(err)
	}
	defer src.Close()
	dst, err := os.Create(to)
	if err != nil {
		b.Fatal(err)
	}
	if _, err := io.Copy(dst, src); err != nil {
		dst.Close()
		b.Fatal(err)
	}
	if err := dst.Close(); err != nil {
		b.Fatal(err)
	}
}

// rounds is the time each side of sqliteRounds took in each round.
type rounds map[*sqliteSide][]time.Duration

// procCounters are this process's totals that show where a message's time
// goes: CPU time (all threads, user and system), read and write system
// calls (a page SQLite does not hold in its cache is a pread of the file or
// the WAL), and minor page faults (a page read through mmap). They come
// from /proc/self/stat and /proc/self/io; ok is false where those do not
// exist (not Linux), and the metrics are left out.
type procCounters struct {
	cpu           time.Duration
	reads, writes int64
	minorFaults   int64
	ok            bool
}

// clockTick is the unit of /proc/self/stat's CPU times (USER_HZ, 100 on
// Linux).
const clockTick = 10 * time.Millisecond

func readProc() procCounters {
	stat, err := os.ReadFile("/proc/self/stat")
	if err != nil {
		return procCounters{}
	}
	io, err := os.ReadFile("/proc/self/io")
	if err != nil {
		return procCounters{}
	}
	// The fields after the command name, which is in parentheses and may
	// hold spaces: state is field 3, minflt 10, utime 14, stime 15.
	f := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+1:]))
	num := func(i int) int64 { n, _ := strconv.ParseInt(f[i-3], 10, 64); return n }
	c := procCounters{cpu: time.Duration(num(14)+num(15)) * clockTick, minorFaults: num(10), ok: true}
	for _, line := range strings.Split(string(io), "\n") {
		k, v, _ := strings.Cut(line, ": ")
		n, _ := strconv.ParseInt(v, 10, 64)
		switch k {
		case "syscr":
			c.reads = n
		case "syscw":
			c.writes = n
		}
	}
	return c
}

func (c procCounters) sub(d procCounters) procCounters {
	return procCounters{cpu: c.cpu - d.cpu, reads: c.reads - d.reads, writes: c.writes - d.writes,
		minorFaults: c.minorFaults - d.minorFaults, ok: c.ok && d.ok}
}

// median returns the median over the rounds of a's rate over b's.
func (r rounds) median(a, b *sqliteSide) float64 {
	x := make([]float64, len(r[a]))
	for i := range x {
		x[i] = r[b][i].Seconds() / r[a][i].Seconds()
	}
	slices.Sort(x)
	return x[len(x)/2]
}

// sqliteRoundCount is how many turns each side of sqliteRounds takes.
const sqliteRoundCount = 40

// sqliteRounds feeds b.N new messages to each side from conc goroutines, the
// sides taking turns (in alternating order) for compareRounds rounds, and
// reports for each side over all its messages: msgs/s, and per message the
// CPU time in µs, read and write system calls and minor page faults of the
// whole process (see procCounters), as <name>-msgs/s, <name>-cpu-us/msg,
// <name>-reads/msg, <name>-writes/msg and <name>-faults/msg. It returns what
// each round took each side.
func sqliteRounds(b *testing.B, conc int, sides []*sqliteSide) rounds {
	msgs := make([][]*message.Message, len(sides))
	latencies := make([]time.Duration, b.N)
	for i := range sides {
		msgs[i] = messages(b.N, 0)
	}
	chunk := (b.N + sqliteRoundCount - 1) / sqliteRoundCount
	r := rounds{}
	used := make([]procCounters, len(sides))
	b.ReportAllocs()
	b.ResetTimer()
	for round, lo := 0, 0; lo < b.N; round, lo = round+1, lo+chunk {
		hi := min(lo+chunk, b.N)
		for k := range sides {
			i := k
			if round%2 == 1 {
				i = len(sides) - 1 - k
			}
			before := readProc()
			took, err := feed(sides[i].h, msgs[i][lo:hi], conc, latencies[lo:hi])
			if err != nil {
				b.Fatalf("%s: %v", sides[i].name, err)
			}
			d := readProc().sub(before)
			used[i] = procCounters{cpu: used[i].cpu + d.cpu, reads: used[i].reads + d.reads, writes: used[i].writes + d.writes,
				minorFaults: used[i].minorFaults + d.minorFaults, ok: d.ok && (round == 0 || used[i].ok)}
			r[sides[i]] = append(r[sides[i]], took)
		}
	}
	b.StopTimer()
	for i, s := range sides {
		var total time.Duration
		for _, d := range r[s] {
			total += d
		}
		b.ReportMetric(float64(b.N)/total.Seconds(), s.name+"-msgs/s")
		if u := used[i]; u.ok {
			n := float64(b.N)
			b.ReportMetric(float64(u.cpu.Microseconds())/n, s.name+"-cpu-us/msg")
			b.ReportMetric(float64(u.reads)/n, s.name+"-reads/msg")
			b.ReportMetric(float64(u.writes)/n, s.name+"-writes/msg")
			b.ReportMetric(float64(u.minorFaults)/n, s.name+"-faults/msg")
		}
	}
	return r
}
