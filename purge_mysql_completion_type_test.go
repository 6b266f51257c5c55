package inbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// Purge on MySQL/MariaDB sessions whose completion_type is not NO_CHAIN
// (the DSN's completion_type=1): a batch's COMMIT opens the session's next
// transaction, and the next batch's BEGIN fails with 1568 ("Transaction
// characteristics can't be changed while a transaction is in progress"),
// which names nothing the operator can change. The purge stops with an
// error wrapping ErrInvalidConfig that names completion_type and the fix
// (every row it deleted before was expired).
func TestPurgeOnMySQLSessionsWithCompletionTypeChainIsRefusedNamingIt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	plain := testdb.OpenMySQL(t, "")
	table := "purge_chain_" + randomSuffix()
	dropLater(t, plain, table)
	ib, err := inbox.New(inbox.Config{DB: plain, Table: table, Consumer: "billing"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ib.Close() })
	if err := ib.InitializeSchema(ctx); err != nil {
		t.Fatal(err)
	}
	const rows = 7
	for i := range rows {
		exec(t, plain, "INSERT INTO "+table+" (consumer, message_id, processed_at) VALUES ('billing', ?, UTC_TIMESTAMP(6) - INTERVAL 2 HOUR)",
			string(rune('a'+i)))
	}
	db := testdb.OpenMySQL(t, "completion_type=1")
	db.SetMaxOpenConns(1)
	deleted, err := inbox.Purge(ctx, inbox.PurgeConfig{DB: db, Table: table, OlderThan: time.Hour, BatchSize: 2})
	switch {
	case errors.Is(err, inbox.ErrInvalidConfig) && strings.Contains(err.Error(), "completion_type"):
		// refused, and says why
	case err != nil:
		t.Errorf("Purge on sessions with completion_type=1: deleted %d of %d, then %v; want every expired row deleted,"+
			" or ErrInvalidConfig naming completion_type", deleted, rows, err)
	case deleted != rows:
		t.Errorf("Purge on sessions with completion_type=1 deleted %d of %d expired rows", deleted, rows)
	}
}
