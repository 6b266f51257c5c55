package inbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

func TestEstimateRows(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		f := newFixture(t, db)
		f.newInbox(inbox.Config{})
		insertRows(t, db, tdb.Dialect, f.inbox, "billing", "m", 2000, time.Minute)
		analyze := map[inbox.Dialect]string{
			inbox.PostgreSQL: "ANALYZE " + f.inbox, inbox.PostgreSQLPartitioned: "ANALYZE " + f.inbox,
			inbox.MySQL: "ANALYZE TABLE " + f.inbox,
		}
		if q, ok := analyze[tdb.Dialect]; ok {
			exec(t, db, q)
		}
		n, err := inbox.EstimateRows(context.Background(), db, tdb.Dialect, f.inbox)
		if err != nil {
			t.Fatal(err)
		}
		if n < 1000 || n > 3000 {
			t.Errorf("estimate = %d, want about 2000", n)
		}
		if _, err := inbox.EstimateRows(context.Background(), db, tdb.Dialect, "no_such_"+randomSuffix()); err == nil {
			t.Error("missing table: want an error")
		}
	})
}

func TestStatsAndCountExpired(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		f := newFixture(t, db)
		f.newInbox(inbox.Config{})
		insertRows(t, db, tdb.Dialect, f.inbox, "billing", "old", 30, 3*time.Hour)
		insertRows(t, db, tdb.Dialect, f.inbox, "shipping", "new", 20, time.Minute)
		ctx := context.Background()
		st, err := inbox.Stats(ctx, db, tdb.Dialect, f.inbox)
		if err != nil {
			t.Fatal(err)
		}
		if st.Rows != 50 || st.Consumers["billing"] != 30 || st.Consumers["shipping"] != 20 {
			t.Errorf("stats = %+v, want 30 billing + 20 shipping", st)
		}
		if age := time.Since(st.Oldest); age < 179*time.Minute || age > 181*time.Minute {
			t.Errorf("oldest = %v (%v ago), want about 3h ago", st.Oldest, age)
		}
		if age := time.Since(st.Newest); age < 0 || age > 2*time.Minute {
			t.Errorf("newest = %v (%v ago), want about 1m ago", st.Newest, age)
		}
		if st.SizeBytes <= 0 {
			t.Errorf("size = %d, want > 0", st.SizeBytes)
		}
		// The ages by the database clock, which processed_at and the
		// purge's cutoff go by (inbox stats' headroom).
		if skew := time.Since(st.ReadAt); skew < -time.Minute || skew > time.Minute {
			t.Errorf("read at %v by the database clock, %v from this host's: want about now", st.ReadAt, skew)
		}
		if age := st.ReadAt.Sub(st.Oldest); age < 179*time.Minute || age > 181*time.Minute {
			t.Errorf("oldest %v ago by the database clock, want about 3h", age)
		}
		cfg := inbox.PurgeConfig{DB: db, Dialect: tdb.Dialect, Table: f.inbox, OlderThan: time.Hour}
		if n, err := inbox.CountExpired(ctx, cfg); err != nil || n != 30 {
			t.Errorf("CountExpired = %d, %v; want 30", n, err)
		}
		cfg.Consumer = "shipping"
		if n, err := inbox.CountExpired(ctx, cfg); err != nil || n != 0 {
			t.Errorf("CountExpired(shipping) = %d, %v; want 0", n, err)
		}
		if f.inboxRows() != 50 {
			t.Error("a dry run deleted rows")
		}
	})
}

// The dialect inferred from the driver is PostgreSQL whatever the table, as
// in metrics.WatchTable(db, nil, table) and `inbox stats` without -dialect.
// On a partitioned table the estimate and the size sum its partitions:
// they read the parent's pg_class row, which autovacuum never analyzes and
// which holds no storage, so they said 0 for good.
func TestEstimateRowsAndSizeOfAPartitionedTableUnderTheDriversDialect(t *testing.T) {
	ctx := context.Background()
	db := testdb.OpenPostgres(t, "")
	f := newFixture(t, db)
	f.newInbox(inbox.Config{Dialect: inbox.PostgreSQLPartitioned})
	insertRows(t, db, inbox.PostgreSQLPartitioned, f.inbox, "billing", "m", 2000, time.Minute)
	var partitions []string
	if err := db.Select(&partitions, "SELECT inhrelid::regclass::text FROM pg_inherits WHERE inhparent = $1::regclass", f.inbox); err != nil {
		t.Fatal(err)
	}
	for _, p := range partitions { // what autovacuum analyzes: the partitions, never their parent
		exec(t, db, "ANALYZE "+p)
	}
	n, err := inbox.EstimateRows(ctx, db, nil, f.inbox)
	if err != nil || n < 1000 || n > 3000 {
		t.Errorf("estimate: %d (%v), want about 2000", n, err)
	}
	inferred, err := inbox.Stats(ctx, db, nil, f.inbox)
	if err != nil {
		t.Fatal(err)
	}
	partitioned, err := inbox.Stats(ctx, db, inbox.PostgreSQLPartitioned, f.inbox)
	if err != nil {
		t.Fatal(err)
	}
	if inferred.SizeBytes <= 0 || inferred.SizeBytes != partitioned.SizeBytes {
		t.Errorf("size under the driver's dialect: %d bytes, want the partitions' %d", inferred.SizeBytes, partitioned.SizeBytes)
	}
	if _, err := inbox.EstimateRows(ctx, db, nil, "no_such_"+randomSuffix()); err == nil {
		t.Error("missing table: want an error")
	}
}

// A partition tree of two levels, in a schema and under names that need
// quoting, is estimated and sized in full under both PostgreSQL dialects,
// from its root or from a sub-partitioned partition: the partitioned
// dialect read one level of pg_inherits, and said 0 rows and 0 bytes.
func TestEstimateRowsAndSizeOfATwoLevelPartitionTree(t *testing.T) {
	ctx := context.Background()
	db := testdb.OpenPostgres(t, "")
	s := "Inbox_" + randomSuffix()
	exec(t, db, `CREATE SCHEMA "`+s+`"`)
	t.Cleanup(func() { _, _ = db.Exec(`DROP SCHEMA "` + s + `" CASCADE`) })
	exec(t, db, `CREATE TABLE "`+s+`"."Inbox" (consumer text NOT NULL, message_id text NOT NULL, processed_at timestamptz NOT NULL DEFAULT now(),
		PRIMARY KEY (consumer, message_id, processed_at)) PARTITION BY RANGE (processed_at)`)
	exec(t, db, `CREATE TABLE "`+s+`".y2026 PARTITION OF "`+s+`"."Inbox" FOR VALUES FROM ('2026-01-01') TO ('2027-01-01') PARTITION BY RANGE (processed_at)`)
	exec(t, db, `CREATE TABLE "`+s+`".h1 PARTITION OF "`+s+`".y2026 FOR VALUES FROM ('2026-01-01') TO ('2026-07-01')`)
	exec(t, db, `CREATE TABLE "`+s+`".h2 PARTITION OF "`+s+`".y2026 FOR VALUES FROM ('2026-07-01') TO ('2027-01-01')`)
	exec(t, db, `INSERT INTO "`+s+`"."Inbox" SELECT 'billing', 'm' || g, timestamptz '2026-03-01' + g * interval '1 minute' FROM generate_series(1, 3000) g`)
	exec(t, db, `INSERT INTO "`+s+`"."Inbox" SELECT 'billing', 'n' || g, timestamptz '2026-08-01' + g * interval '1 minute' FROM generate_series(1, 1000) g`)
	exec(t, db, `ANALYZE "`+s+`".h1`)
	exec(t, db, `ANALYZE "`+s+`".h2`)
	for _, d := range []inbox.Dialect{nil, inbox.PostgreSQLPartitioned} {
		for table, want := range map[string]int64{s + ".Inbox": 4000, s + ".y2026": 4000, s + ".h2": 1000} {
			if n, err := inbox.EstimateRows(ctx, db, d, table); err != nil || n != want {
				t.Errorf("dialect %v, %s: estimate %d (%v), want %d", d, table, n, err, want)
			}
			if st, err := inbox.Stats(ctx, db, d, table); err != nil || st.SizeBytes <= 0 {
				t.Errorf("dialect %v, %s: size %d (%v), want its partitions'", d, table, st.SizeBytes, err)
			}
		}
	}
}

// Before a table's first ANALYZE (autovacuum off, or not run yet), also
// after a VACUUM of the empty table, the estimate counts the live rows the
// statistics system keeps, on a plain and on a partitioned table: it said 0
// however many rows there were, which a dashboard cannot tell from an
// empty table.
func TestEstimateRowsBeforeTheFirstAnalyze(t *testing.T) {
	for _, d := range []inbox.Dialect{inbox.PostgreSQL, inbox.PostgreSQLPartitioned} {
		t.Run(d.String(), func(t *testing.T) {
			db := testdb.OpenPostgres(t, "")
			f := newFixture(t, db)
			f.newInbox(inbox.Config{Dialect: d})
			if d == inbox.PostgreSQL { // a partitioned table has no storage parameters: its partitions do
				exec(t, db, "ALTER TABLE "+f.inbox+" SET (autovacuum_enabled = false)")
			}
			var partitions []string
			if err := db.Select(&partitions, "SELECT inhrelid::regclass::text FROM pg_inherits WHERE inhparent = $1::regclass", f.inbox); err != nil {
				t.Fatal(err)
			}
			for _, p := range partitions {
				exec(t, db, "ALTER TABLE "+p+" SET (autovacuum_enabled = false)")
			}
			for _, p := range append(partitions, f.inbox) {
				exec(t, db, "VACUUM "+p) // empty: reltuples 0, which the estimate read as none
			}
			insertRows(t, db, d, f.inbox, "billing", "m", 1500, time.Minute)
			// The statistics reach shared memory within a second of the
			// commit (PostgreSQL 15's pgstat flush).
			deadline := time.Now().Add(10 * time.Second)
			for {
				n, err := inbox.EstimateRows(context.Background(), db, nil, f.inbox)
				if err == nil && n == 1500 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("estimate before the first ANALYZE: %d (%v), want the 1500 live rows", n, err)
				}
				time.Sleep(100 * time.Millisecond)
			}
		})
	}
}

// On SQLite the inbox table's size is its own pages and its indexes', not
// the whole database file's: a business table beside it, many times larger,
// does not count.
func TestStatsSizeOnSQLiteIsTheTablesOwn(t *testing.T) {
	db := sqliteDB(t)
	f := newFixture(t, db)
	f.newInbox(inbox.Config{})
	insertRows(t, db, inbox.SQLite, f.inbox, "billing", "m", 200, time.Minute)
	exec(t, db, "CREATE TABLE invoices (id INTEGER PRIMARY KEY, body BLOB)")
	exec(t, db, "WITH RECURSIVE g(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM g WHERE i < 2000) INSERT INTO invoices (body) SELECT randomblob(2000) FROM g")
	st, err := inbox.Stats(context.Background(), db, inbox.SQLite, f.inbox)
	if err != nil {
		t.Fatal(err)
	}
	// 200 rows in two B-trees (the key's, processed_at's): a few pages;
	// the invoices take about 4 MB.
	if st.SizeBytes <= 0 || st.SizeBytes > 256<<10 {
		t.Errorf("size %d bytes, want the inbox table's own few pages (the file holds 4 MB of invoices)", st.SizeBytes)
	}
}
