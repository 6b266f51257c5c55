package inbox_test

import (
	"context"
	"database/sql"
	"strings"
	"testing"
	"time"

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
	table := dailyPartitionedTable(t, db)
	if err := inbox.CreatePartitions(ctx, db, table, dbNow(t, db).AddDate(0, 0, -6), 6); err != nil {
		t.Fatal(err)
	}
	exec(t, db, "INSERT INTO "+table+" (consumer, message_id, processed_at) VALUES ('billing', 'old', now() - interval '5 days')")
	left, err := testdb.OpenPostgres(t, "").BeginTxx(ctx, &sql.TxOptions{Isolation: sql.LevelRepeatableRead})
	if err != nil {
		t.Fatal(err)
	}
	defer left.Rollback()
	if _, err := left.Exec("SELECT count(*) FROM " + table); err != nil {
		t.Fatal(err)
	}
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
	round = purger.RunOnce(ctx)
	if round.Err != nil || len(round.DroppedPartitions) == 0 || count(t, db, table, "message_id = 'old'") != 0 {
		t.Errorf("round once the transaction ended: dropped %v, %v; want the old partition dropped with its row", round.DroppedPartitions, round.Err)
	}
}
