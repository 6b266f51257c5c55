package inbox_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/stdlib"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A Purge of a partitioned table walks it partition by partition, each in
// its primary key's order, carrying the last key it chose into the next
// statement as constants: every expired row is deleted and every young one
// kept, whatever bytes the
// keys hold (quotes, backslashes, multi-byte characters, ids that differ in
// case only, the longest id), at every batch size around the counts, with
// a consumer filter and without, for a '-infinity' processed_at (a
// hand-written backfill, in a partition from MINVALUE), and for a young row
// of the same consumer and id as an expired one in another partition.
func TestPartitionedPurgeDeletesEveryExpiredRowWhateverItsKey(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	ctx := context.Background()
	ids := []string{`o'brien`, `o'brien\`, `\'; DELETE FROM x; --`, `Ünïcödé-✓`, `CASE`, `case`, `a b`, ``, strings.Repeat("z", 255)}
	ids[7] = "\u00a0" // not empty: a no-break space
	consumers := []string{`it's`, `back\slash`}
	for _, bs := range []int{1, 2, 5, 9, 10, 1000} {
		for _, only := range []string{"", consumers[0]} {
			t.Run(fmt.Sprintf("batch %d consumer %q", bs, only), func(t *testing.T) {
				table := dailyPartitionedTable(t, db)
				if err := inbox.CreatePartitions(ctx, db, table, dbNow(t, db).AddDate(0, 0, -5), 6); err != nil {
					t.Fatal(err)
				}
				var oldest string
				if err := db.Get(&oldest, "SELECT min(pg_get_expr(c.relpartbound, c.oid)) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = $1::regclass", table); err != nil {
					t.Fatal(err)
				}
				from := strings.TrimSuffix(strings.TrimPrefix(oldest, "FOR VALUES FROM ("), ")")
				from = from[:strings.Index(from, ")")]
				exec(t, db, "CREATE TABLE "+table+"_before PARTITION OF "+table+" FOR VALUES FROM (MINVALUE) TO ("+from+")")
				for _, c := range consumers {
					for i, id := range ids {
						// Expired, three days ago; the first id also young
						// (now) in today's partition, the same key but for
						// processed_at.
						exec(t, db, "INSERT INTO "+table+" (consumer, message_id, processed_at) VALUES ($1, $2, now() - interval '3 days' + $3 * interval '1 second')", c, id, i)
					}
					exec(t, db, "INSERT INTO "+table+" (consumer, message_id, processed_at) VALUES ($1, $2, now())", c, ids[0])
					exec(t, db, "INSERT INTO "+table+" (consumer, message_id, processed_at) VALUES ($1, 'backfilled', '-infinity')", c)
				}
				n, err := inbox.Purge(ctx, inbox.PurgeConfig{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table, OlderThan: 24 * time.Hour, BatchSize: bs, Consumer: only, DutyCycle: 1})
				expired := len(consumers) * (len(ids) + 1)
				if only != "" {
					expired = len(ids) + 1
				}
				if err != nil || n != int64(expired) {
					t.Fatalf("purge: deleted %d, err %v; want %d, nil", n, err, expired)
				}
				if left := count(t, db, table, "processed_at < now() - interval '1 day'"+map[bool]string{true: "", false: " AND consumer = '" + strings.ReplaceAll(only, "'", "''") + "'"}[only == ""]); left != 0 {
					t.Errorf("%d expired rows left, want none", left)
				}
				young := count(t, db, table, "processed_at > now() - interval '1 hour' AND message_id = $1", ids[0])
				if young != len(consumers) {
					t.Errorf("%d young rows of the first id left, want %d", young, len(consumers))
				}
				if only != "" {
					if other := count(t, db, table, "consumer = $1", consumers[1]); other != len(ids)+2 {
						t.Errorf("the other consumer has %d rows left, want all %d", other, len(ids)+2)
					}
				}
			})
		}
	}
}

// Expired rows written while a partitioned table's purge runs, at keys it
// has passed (a backfill, a transaction that stayed open past the window),
// are deleted by that purge: once its walk of the partitions ends, it
// looks for expired rows left behind it and walks again.
func TestPartitionedPurgeDeletesRowsWrittenBehindItsKey(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	ctx := context.Background()
	table := dailyPartitionedTable(t, db)
	if err := inbox.CreatePartitions(ctx, db, table, dbNow(t, db).AddDate(0, 0, -5), 6); err != nil {
		t.Fatal(err)
	}
	insertRows(t, db, inbox.PostgreSQLPartitioned, table, "billing", "m", 3000, 2*24*time.Hour)
	batches := 0
	cfg := inbox.WithPurgeBatchHooks(inbox.PurgeConfig{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table, OlderThan: 24 * time.Hour, BatchSize: 1000, DutyCycle: 1}, func() {
		if batches++; batches == 3 {
			// "a-…" sorts before every "m-…" the purge has walked.
			insertRows(t, db, inbox.PostgreSQLPartitioned, table, "billing", "a", 10, 3*24*time.Hour)
		}
	}, nil)
	deleted, err := inbox.Purge(ctx, cfg)
	if err != nil || deleted != 3010 {
		t.Errorf("deleted %d (%v), want 3010: the 3000 rows and the 10 written behind the key", deleted, err)
	}
	if left := count(t, db, table, ""); left != 0 {
		t.Errorf("%d rows left (%d of them written behind the key), want none", left, count(t, db, table, "message_id LIKE 'a-%'"))
	}
}

// Expired rows in a DEFAULT partition (written while no range partition
// covered their time) are deleted too, and nothing else: the DEFAULT
// partition's rows sit at the same ctids as the range partitions' young
// rows, and the batch that deletes them by ctid must not take those.
func TestPartitionedPurgeDeletesExpiredRowsOfTheDefaultPartition(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	ctx := context.Background()
	table := dailyPartitionedTable(t, db)
	exec(t, db, "CREATE TABLE "+table+"_default PARTITION OF "+table+" DEFAULT")
	var young int
	if err := db.Get(&young, "SELECT count(*) FROM "+table); err != nil || young != 0 {
		t.Fatal(young, err)
	}
	insertRows(t, db, inbox.PostgreSQLPartitioned, table, "billing", "old", 30, 10*24*time.Hour) // before every range partition
	insertRows(t, db, inbox.PostgreSQLPartitioned, table, "billing", "young", 30, 0)
	insertRows(t, db, inbox.PostgreSQLPartitioned, table, "billing", "future", 5, -400*24*time.Hour) // after every range partition
	if n := count(t, db, table+"_default", ""); n != 35 {
		t.Fatalf("%d rows in the DEFAULT partition, want the 30 old and 5 future ones", n)
	}
	for _, bs := range []int{1, 7, 1000} {
		n, err := inbox.Purge(ctx, inbox.PurgeConfig{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table, OlderThan: 24 * time.Hour, BatchSize: bs, DutyCycle: 1})
		if want := map[int]int64{1: 30}[bs]; err != nil || n != want {
			t.Fatalf("batch %d: deleted %d, err %v; want %d, nil", bs, n, err, want)
		}
		if got := count(t, db, table, "message_id LIKE 'old-%'"); got != 0 {
			t.Errorf("batch %d: %d old rows left", bs, got)
		}
		if got := count(t, db, table, "message_id NOT LIKE 'old-%'"); got != 35 {
			t.Errorf("batch %d: %d young and future rows left, want 35", bs, got)
		}
	}
}

// Message ids and a consumer with quotes are written into the purge's
// statements as constants that a session with backslash_quote = off (a
// hardening setting, per server, database or role) accepts: quotes
// doubled, not escaped with a backslash (22P06 "unsafe use of \' in a
// string literal" stopped every purge at the same row).
func TestPartitionedPurgeUnderBackslashQuoteOff(t *testing.T) {
	plain := testdb.OpenPostgres(t, "")
	ctx := context.Background()
	table := dailyPartitionedTable(t, plain)
	if err := inbox.CreatePartitions(ctx, plain, table, dbNow(t, plain).AddDate(0, 0, -5), 6); err != nil {
		t.Fatal(err)
	}
	exec(t, plain, "INSERT INTO "+table+" (consumer, message_id, processed_at) SELECT 'o''brien', 'o''brien-' || i, now() - interval '2 days' FROM generate_series(1, 20) i")
	db := testdb.OpenPostgres(t, "options=-c%20backslash_quote%3Doff")
	n, err := inbox.Purge(ctx, inbox.PurgeConfig{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table, OlderThan: 24 * time.Hour, BatchSize: 5, DutyCycle: 1, Consumer: "o'brien"})
	if err != nil || n != 20 {
		t.Errorf("deleted %d, err %v; want 20, nil", n, err)
	}
}

// A partition that is itself partitioned (by consumer, its leaves at the
// same ctids), as a range partition or as the DEFAULT one: a batch deletes
// the rows it chose, by leaf and ctid, never more than BatchSize (matched
// by ctid alone, the rows at the same ctids of the other leaf went too).
func TestPartitionedPurgeOfSubPartitionedPartitionsKeepsTheBatchSize(t *testing.T) {
	for _, kind := range []string{"range", "default"} {
		t.Run(kind, func(t *testing.T) {
			db := testdb.OpenPostgres(t, "")
			table := dailyPartitionedTable(t, db)
			now := dbNow(t, db).UTC()
			day := time.Date(now.Year(), now.Month(), now.Day(), 0, 0, 0, 0, time.UTC).AddDate(0, 0, -10)
			sub := table + "_sub"
			bound := fmt.Sprintf("FOR VALUES FROM ('%s') TO ('%s')", day.Format(time.RFC3339), day.AddDate(0, 0, 1).Format(time.RFC3339))
			if kind == "default" {
				bound = "DEFAULT"
			}
			exec(t, db, "CREATE TABLE "+sub+" PARTITION OF "+table+" "+bound+" PARTITION BY LIST (consumer)")
			exec(t, db, "CREATE TABLE "+sub+"_a PARTITION OF "+sub+" FOR VALUES IN ('a')")
			exec(t, db, "CREATE TABLE "+sub+"_b PARTITION OF "+sub+" FOR VALUES IN ('b')")
			for _, c := range []string{"a", "b"} {
				exec(t, db, "INSERT INTO "+table+" (consumer, message_id, processed_at) SELECT $1, 'm-' || lpad(i::text, 4, '0'), $2::timestamptz + i * interval '1 second' FROM generate_series(1, 20) i", c, day)
			}
			prev, most := count(t, db, table, ""), 0
			cfg := inbox.WithPurgeBatchHooks(inbox.PurgeConfig{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table, OlderThan: 24 * time.Hour, BatchSize: 10, DutyCycle: 1}, func() {
				n := count(t, db, table, "")
				most, prev = max(most, prev-n), n
			}, nil)
			n, err := inbox.Purge(context.Background(), cfg)
			most = max(most, prev-count(t, db, table, ""))
			if err != nil || n != 40 || most > 10 {
				t.Errorf("deleted %d (%v), at most %d in a batch; want 40, at most 10 a batch", n, err, most)
			}
		})
	}
}

// The look for expired rows left at the end of a partitioned table's walk
// fails with a conflict the purge retries (lock_not_available under the
// session's lock_timeout, while another instance's DDL holds the table):
// the retry looks again and the purge ends (it indexed past its last slice
// and panicked, which ends a Purger's process).
func TestPartitionedPurgeRetriesItsLookForRowsLeft(t *testing.T) {
	admin := testdb.OpenPostgres(t, "")
	table := dailyPartitionedTable(t, admin)
	if err := inbox.CreatePartitions(context.Background(), admin, table, dbNow(t, admin).AddDate(0, 0, -5), 6); err != nil {
		t.Fatal(err)
	}
	insertRows(t, admin, inbox.PostgreSQLPartitioned, table, "billing", "m", 30, 2*24*time.Hour)
	var locked atomic.Bool
	before := func(q string) {
		if !strings.HasPrefix(q, "SELECT count(*) FROM (SELECT FROM") || !locked.CompareAndSwap(false, true) {
			return
		}
		tx, err := admin.Begin()
		if err != nil {
			panic(err)
		}
		if _, err := tx.Exec("LOCK TABLE " + table + " IN ACCESS EXCLUSIVE MODE"); err != nil {
			panic(err)
		}
		time.AfterFunc(500*time.Millisecond, func() { tx.Rollback() }) //nolint:errcheck // releases the lock
	}
	dsn := testdb.WithParam(testdb.PostgresDSN(), "options=-c%20lock_timeout%3D100")
	db := sqlx.NewDb(sql.OpenDB(beforeStatementConnector{drv: stdlib.GetDefaultDriver(), dsn: dsn, before: before}), "pgx")
	t.Cleanup(func() { db.Close() })
	var n int64
	var err error
	func() {
		defer func() {
			if r := recover(); r != nil {
				t.Fatalf("Purge panicked: %v", r)
			}
		}()
		n, err = inbox.Purge(context.Background(), inbox.PurgeConfig{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table, OlderThan: 24 * time.Hour, BatchSize: 1000, DutyCycle: 1})
	}()
	if !locked.Load() || err != nil || n != 30 {
		t.Errorf("deleted %d, err %v (table locked: %v); want 30, nil: the look retried", n, err, locked.Load())
	}
}

// beforeStatementConnector opens connections that call before with each
// statement's text before they send it.
type beforeStatementConnector struct {
	drv    driver.Driver
	dsn    string
	before func(q string)
}

func (c beforeStatementConnector) Connect(context.Context) (driver.Conn, error) {
	conn, err := c.drv.Open(c.dsn)
	if err != nil {
		return nil, err
	}
	return beforeStatementConn{conn, c.before}, nil
}

func (c beforeStatementConnector) Driver() driver.Driver { return c.drv }

type beforeStatementConn struct {
	driver.Conn
	before func(q string)
}

func (c beforeStatementConn) QueryContext(ctx context.Context, q string, args []driver.NamedValue) (driver.Rows, error) {
	c.before(q)
	return c.Conn.(driver.QueryerContext).QueryContext(ctx, q, args)
}

func (c beforeStatementConn) ExecContext(ctx context.Context, q string, args []driver.NamedValue) (driver.Result, error) {
	c.before(q)
	return c.Conn.(driver.ExecerContext).ExecContext(ctx, q, args)
}

func (c beforeStatementConn) BeginTx(ctx context.Context, o driver.TxOptions) (driver.Tx, error) {
	return c.Conn.(driver.ConnBeginTx).BeginTx(ctx, o)
}

func (c beforeStatementConn) ResetSession(ctx context.Context) error {
	if r, ok := c.Conn.(driver.SessionResetter); ok {
		return r.ResetSession(ctx)
	}
	return nil
}

// Expired rows that the purge's DELETE does not remove (a BEFORE DELETE
// trigger that keeps them: a legal hold) do not keep a partitioned table's
// purge walking for ever: a walk that deleted nothing ends it, with the
// rows it could delete gone. The same for a Purger round limited to a
// consumer whose partition holds another consumer's rows (it never ended,
// and the Purger ran no round after it).
func TestPartitionedPurgeEndsBesideRowsItsDeleteKeeps(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	ctx := context.Background()
	table := dailyPartitionedTable(t, db)
	if err := inbox.CreatePartitions(ctx, db, table, dbNow(t, db).AddDate(0, 0, -5), 6); err != nil {
		t.Fatal(err)
	}
	hold := table + "_hold"
	exec(t, db, "CREATE FUNCTION "+hold+"() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN IF OLD.message_id LIKE 'held%' THEN RETURN NULL; END IF; RETURN OLD; END$$")
	t.Cleanup(func() { db.Exec("DROP FUNCTION IF EXISTS " + hold + "() CASCADE") })
	exec(t, db, "CREATE TRIGGER "+hold+" BEFORE DELETE ON "+table+" FOR EACH ROW EXECUTE FUNCTION "+hold+"()")
	insertRows(t, db, inbox.PostgreSQLPartitioned, table, "billing", "held", 3, 2*24*time.Hour)
	insertRows(t, db, inbox.PostgreSQLPartitioned, table, "billing", "m", 50, 2*24*time.Hour)
	limited, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	n, err := inbox.Purge(limited, inbox.PurgeConfig{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table, OlderThan: 24 * time.Hour, BatchSize: 10, DutyCycle: 1})
	if err != nil || n != 50 {
		t.Errorf("purge beside held rows: deleted %d, err %v; want 50, nil (it ended)", n, err)
	}
	insertRows(t, db, inbox.PostgreSQLPartitioned, table, "billing", "r", 5, 2*24*time.Hour)
	insertRows(t, db, inbox.PostgreSQLPartitioned, table, "audit", "r", 5, 2*24*time.Hour)
	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table, OlderThan: 24 * time.Hour, BatchSize: 10, DutyCycle: 1, Consumer: "billing"}})
	if err != nil {
		t.Fatal(err)
	}
	if r := p.RunOnce(limited); r.Err != nil || r.Deleted != 5 {
		t.Errorf("Purger round beside held rows: %+v; want 5 deleted, no error (it ended)", r)
	}
	if held := count(t, db, table, "message_id LIKE 'held%'"); held != 3 {
		t.Errorf("%d held rows left, want 3", held)
	}
}

// A session with standard_conforming_strings = off (a role's or a
// database's, in a legacy application) reads the partitions' bounds as any
// other: the catalog read's pattern had backslashes in a plain '...'
// constant, matched nothing, and every partition read as "not a range" (a
// Purger round and CreatePartitions refused the table, a Purge walked it as
// one piece).
func TestPartitionsReadUnderStandardConformingStringsOff(t *testing.T) {
	plain := testdb.OpenPostgres(t, "")
	ctx := context.Background()
	table := dailyPartitionedTable(t, plain)
	if err := inbox.CreatePartitions(ctx, plain, table, dbNow(t, plain).AddDate(0, 0, -5), 6); err != nil {
		t.Fatal(err)
	}
	insertRows(t, plain, inbox.PostgreSQLPartitioned, table, "billing", "m", 30, 2*24*time.Hour)
	db := testdb.OpenPostgres(t, "options=-c%20standard_conforming_strings%3Doff")
	if err := inbox.CreatePartitions(ctx, db, table, dbNow(t, plain), 3); err != nil {
		t.Errorf("CreatePartitions: %v", err)
	}
	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table, OlderThan: 24 * time.Hour, DutyCycle: 1}})
	if err != nil {
		t.Fatal(err)
	}
	if r := p.RunOnce(ctx); r.Err != nil || r.Deleted != 30 {
		t.Errorf("Purger round: %+v; want the 30 expired rows' partition dropped", r)
	}
}

// A partition that holds the only expired rows changes while the walk
// runs, after the walk read the catalog: dropped and made again (a new
// table, its oid another), or detached and attached again (the same table,
// which the walk found detached). The walk deletes nothing, the look at its
// end finds the rows, and since the catalog has changed the purge walks
// again and deletes them (it ended, leaving them on a quiet table).
func TestPartitionedPurgeWalksAgainAPartitionThatChangedWhileItRan(t *testing.T) {
	for _, change := range []string{"made again", "detached and attached again"} {
		t.Run(change, func(t *testing.T) {
			admin := testdb.OpenPostgres(t, "")
			ctx := context.Background()
			table := dailyPartitionedTable(t, admin)
			if err := inbox.CreatePartitions(ctx, admin, table, dbNow(t, admin).AddDate(0, 0, -5), 6); err != nil {
				t.Fatal(err)
			}
			var part, bound string
			if err := admin.QueryRow(`SELECT c.oid::regclass::text, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
				WHERE i.inhparent = $1::regclass ORDER BY 2 LIMIT 1 OFFSET 2`, table).Scan(&part, &bound); err != nil {
				t.Fatal(err)
			}
			exec(t, admin, "INSERT INTO "+table+" (consumer, message_id, processed_at) SELECT 'billing', 'm' || g, "+
				"(regexp_match($1, 'FROM \\(''([^'']*)''\\)'))[1]::timestamptz + interval '1 hour' FROM generate_series(1, 30) g", bound)
			var first, last sync.Once
			before := func(q string) {
				switch {
				case strings.Contains(q, "WITH chosen AS MATERIALIZED") && change == "made again":
					first.Do(func() {
						exec(t, admin, "CREATE TABLE "+part+"_new (LIKE "+table+" INCLUDING ALL)")
						exec(t, admin, "INSERT INTO "+part+"_new SELECT * FROM "+part)
						exec(t, admin, "DROP TABLE "+part)
						exec(t, admin, "ALTER TABLE "+part+"_new RENAME TO "+part)
						exec(t, admin, "ALTER TABLE "+table+" ATTACH PARTITION "+part+" "+bound)
					})
				case strings.Contains(q, "WITH chosen AS MATERIALIZED"):
					first.Do(func() { exec(t, admin, "ALTER TABLE "+table+" DETACH PARTITION "+part) })
				case strings.HasPrefix(q, "SELECT count(*) FROM (SELECT FROM") && change != "made again":
					last.Do(func() { exec(t, admin, "ALTER TABLE "+table+" ATTACH PARTITION "+part+" "+bound) })
				}
			}
			db := sqlx.NewDb(sql.OpenDB(beforeStatementConnector{drv: stdlib.GetDefaultDriver(), dsn: testdb.PostgresDSN(), before: before}), "pgx")
			t.Cleanup(func() { db.Close() })
			n, err := inbox.Purge(ctx, inbox.PurgeConfig{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table, OlderThan: 24 * time.Hour, BatchSize: 1000, DutyCycle: 1})
			if left := count(t, admin, table, "processed_at < now() - interval '1 day'"); err != nil || n != 30 || left != 0 {
				t.Errorf("purge: deleted %d, err %v, %d expired rows left; want 30, nil, none", n, err, left)
			}
		})
	}
}

// The partitions with nothing expired that a walk passes (a long window's
// daily partitions, kept for another consumer) are not paced as batches:
// a purge of 40 partitions holding one expired row pauses at most once
// (it paused after each, 4.8 s for 365 partitions at the default
// DutyCycle).
func TestPartitionedPurgeDoesNotPauseAfterEmptyPartitions(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	ctx := context.Background()
	table := dailyPartitionedTable(t, db)
	if err := inbox.CreatePartitions(ctx, db, table, dbNow(t, db).AddDate(0, 0, -40), 41); err != nil {
		t.Fatal(err)
	}
	insertRows(t, db, inbox.PostgreSQLPartitioned, table, "billing", "m", 1, 20*24*time.Hour)
	pauses := 0
	cfg := inbox.WithPurgeBatchHooks(inbox.PurgeConfig{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table, OlderThan: 24 * time.Hour, DutyCycle: 0.1},
		nil, func(_, pause time.Duration) {
			if pause > 0 {
				pauses++
			}
		})
	if n, err := inbox.Purge(ctx, cfg); err != nil || n != 1 || pauses > 1 {
		t.Errorf("deleted %d (%v) with %d pauses; want 1, at most 1 pause", n, err, pauses)
	}
}
