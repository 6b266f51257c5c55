package inbox_test

import (
	"context"
	"database/sql"
	"strings"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A transaction left open that read the inbox table (idle in transaction,
// a stuck report) holds DETACH PARTITION ... CONCURRENTLY back for as long
// as it stays open. The round stops waiting after a bound and fails, saying
// why, instead of holding the purge lock, so no round of any instance ran
// and none created the coming partitions; the DETACH it cancelled half way
// is finished, and the partition dropped, by a round once that transaction
// ended. Not parallel: it lowers the bound for the package.
func TestPurgeRoundStopsWaitingForATransactionLeftOpen(t *testing.T) {
	defer inbox.SetDetachWait(inbox.SetDetachWait(time.Second))
	ctx := context.Background()
	db := testdb.OpenPostgres(t, "")
	table := lastSixDaysPartitionedTable(t, db)
	exec(t, db, "INSERT INTO "+table+" (consumer, message_id, processed_at) VALUES ('billing', 'old', now() - interval '5 days')")
	left := transactionLeftOpen(t, table)
	purger, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Table: table, OlderThan: 48 * time.Hour}})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	round := purger.RunOnce(rctx)
	if rctx.Err() != nil || round.Err == nil || !strings.Contains(round.Err.Error(), "next round finishes it") {
		t.Fatalf("round while a transaction is left open: %v (context: %v); want it to stop waiting and say why", round.Err, rctx.Err())
	}
	if err := left.Rollback(); err != nil {
		t.Fatal(err)
	}
	// The default bound again: the FINALIZE waits for every older
	// transaction of the database, and other tests' run meanwhile.
	inbox.SetDetachWait(time.Minute)
	round = purger.RunOnce(ctx)
	if round.Err != nil || len(round.DroppedPartitions) == 0 || count(t, db, table, "message_id = 'old'") != 0 {
		t.Errorf("round once the transaction ended: dropped %v, %v; want the old partition dropped with its row", round.DroppedPartitions, round.Err)
	}
}

// A DETACH left half way (pending) by a round that stopped waiting, then a
// longer window (an operator raised the topic's retention): the next round
// attaches the partition back instead of leaving it pending, so its rows,
// inside the window again, are seen by the claims (a pending partition's
// rows are not, and their duplicates were processed again). Not parallel:
// it lowers the bound for the package.
func TestPurgeRoundAttachesBackAPartitionLeftHalfDetachedWhenTheWindowGrew(t *testing.T) {
	defer inbox.SetDetachWait(inbox.SetDetachWait(time.Second))
	ctx := context.Background()
	db := testdb.OpenPostgres(t, "")
	table := lastSixDaysPartitionedTable(t, db)
	exec(t, db, "INSERT INTO "+table+" (consumer, message_id, processed_at) VALUES"+
		" ('billing', 'old', date_trunc('day', now() AT TIME ZONE 'UTC' - interval '6 days') AT TIME ZONE 'UTC' + interval '1 hour')")
	left := transactionLeftOpen(t, table)
	purge := func(window time.Duration) inbox.PurgeRound {
		p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Table: table, OlderThan: window}})
		if err != nil {
			t.Fatal(err)
		}
		return p.RunOnce(ctx)
	}
	if round := purge(48 * time.Hour); round.Err == nil {
		t.Fatalf("round while a transaction is left open: dropped %v, want it to stop waiting", round.DroppedPartitions)
	}
	var pending int
	if err := db.Get(&pending, "SELECT count(*) FROM pg_inherits WHERE inhparent = $1::regclass AND inhdetachpending", table); err != nil || pending != 1 {
		t.Fatalf("%d partitions left pending (%v), want 1", pending, err)
	}
	if err := left.Rollback(); err != nil {
		t.Fatal(err)
	}
	// The default bound again: the FINALIZE waits for every older
	// transaction of the database, and other tests' run meanwhile.
	inbox.SetDetachWait(time.Minute)
	// The server may go on with the DETACH once the transaction ended (the
	// round stopped waiting, but the cancel did not reach the statement in
	// time): the partition is then detached whole, its range gone from the
	// catalog. Either way it is attached back.
	if err := db.Get(&pending, "SELECT count(*) FROM pg_inherits WHERE inhparent = $1::regclass AND inhdetachpending", table); err == nil {
		t.Logf("partitions pending before the round with the longer window: %d", pending)
	}
	if round := purge(10 * 24 * time.Hour); round.Err != nil || len(round.DroppedPartitions) != 0 {
		t.Fatalf("round with the longer window: dropped %v, %v; want nothing dropped", round.DroppedPartitions, round.Err)
	}
	if err := db.Get(&pending, "SELECT count(*) FROM pg_inherits WHERE inhparent = $1::regclass AND inhdetachpending", table); err != nil || pending != 0 {
		t.Errorf("%d partitions still pending (%v), want none", pending, err)
	}
	if n := count(t, db, table, "message_id = 'old'"); n != 1 {
		t.Errorf("the row inside the longer window is seen %d times through %s, want once", n, table)
	}
}

// A DETACH an operator began and left pending (its own statement_timeout
// cancelled it) is the operator's: the purge neither finishes it nor
// attaches the partition back, even once the window covers its rows.
func TestPurgeRoundLeavesADetachItDidNotBeginAlone(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.OpenPostgres(t, "")
	table := lastSixDaysPartitionedTable(t, db)
	var partition string
	if err := db.Get(&partition, "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"+
		" WHERE i.inhparent = $1::regclass ORDER BY c.relname LIMIT 1", table); err != nil {
		t.Fatal(err)
	}
	left := transactionLeftOpen(t, table)
	operator, err := db.Connx(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := operator.ExecContext(ctx, "SET statement_timeout = '500ms'"); err != nil {
		t.Fatal(err)
	}
	if _, err := operator.ExecContext(ctx, "ALTER TABLE "+table+" DETACH PARTITION "+partition+" CONCURRENTLY"); err == nil {
		t.Fatal("the operator's DETACH finished; want it cancelled half way")
	}
	operator.Close() // out of the pool: db.Close discards it
	if err := left.Rollback(); err != nil {
		t.Fatal(err)
	}
	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Table: table, OlderThan: 10 * 24 * time.Hour}})
	if err != nil {
		t.Fatal(err)
	}
	if round := p.RunOnce(ctx); round.Err != nil {
		t.Errorf("round: %v", round.Err)
	}
	var pending bool
	if err := db.Get(&pending, "SELECT inhdetachpending FROM pg_inherits WHERE inhrelid = $1::regclass", partition); err != nil || !pending {
		t.Errorf("the operator's partition is pending %v (%v), want it left as the operator left it", pending, err)
	}
}

// lastSixDaysPartitionedTable creates a daily partitioned inbox table with
// the partitions of the last six days, dropped when the test ends.
func lastSixDaysPartitionedTable(t *testing.T, db *sqlx.DB) string {
	t.Helper()
	table := dailyPartitionedTable(t, db)
	if err := inbox.CreatePartitions(context.Background(), db, table, dbNow(t, db).AddDate(0, 0, -6), 6); err != nil {
		t.Fatal(err)
	}
	return table
}

// transactionLeftOpen begins, on a pool of its own, a transaction that read
// table and stays open (a report, a session idle in transaction) until the
// test rolls it back or ends.
func transactionLeftOpen(t *testing.T, table string) *sqlx.Tx {
	t.Helper()
	tx, err := testdb.OpenPostgres(t, "").BeginTxx(context.Background(), &sql.TxOptions{Isolation: sql.LevelRepeatableRead})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback() })
	if _, err := tx.Exec("SELECT count(*) FROM " + table); err != nil {
		t.Fatal(err)
	}
	return tx
}
