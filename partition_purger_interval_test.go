package inbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// On a PostgreSQLPartitioned table a long-running process gets its coming
// partitions only from its Purger's rounds (docs/purge.md): a round makes
// them to last until after the round after the next, however far apart the
// Purger's rounds are (Interval), not only DefaultPartitionsAhead (7) days:
// a Purger that ran every 10 days left days with no partition before its
// next round, and every claim on them failed until it came.
func TestPartitionedPurgerRoundMakesPartitionsThatLastUntilItsNextRound(t *testing.T) {
	t.Parallel()
	db := testdb.OpenPostgres(t, "")
	ctx := context.Background()
	table := "partahead_" + randomSuffix()
	t.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + table + " CASCADE") })
	if err := inbox.InitializePartitions(ctx, db, table, inbox.PartitionDay); err != nil {
		t.Fatal(err)
	}
	const interval = 10 * 24 * time.Hour
	p, err := inbox.NewPurger(inbox.PurgerConfig{
		Purge:    inbox.PurgeConfig{DB: db, Table: table, OlderThan: 30 * 24 * time.Hour},
		Interval: interval,
	})
	if errors.Is(err, inbox.ErrInvalidConfig) {
		return // refused: fine
	} else if err != nil {
		t.Fatal(err)
	}
	if r := p.RunOnce(ctx); r.Err != nil {
		t.Fatal(r.Err)
	}
	// The next round starts Interval after this one: every day until then
	// needs a partition.
	if gaps := uncovered(t, db, table, 0, int(interval/(24*time.Hour))); len(gaps) > 0 {
		t.Errorf("after a round of a Purger whose next round is %v away, days without a partition before it: %v"+
			" (every claim on them fails until that round)", interval, gaps)
	}
}
