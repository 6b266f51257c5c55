package pgxinbox_test

import (
	"context"
	"strings"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// infoLines is a logger that keeps its Info lines.
type infoLines struct {
	watermill.NopLogger
	mu    sync.Mutex
	lines []string
}

func (l *infoLines) Info(msg string, _ watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, msg)
}

func (l *infoLines) With(watermill.LogFields) watermill.LoggerAdapter { return l }

// pgxinbox sends the key lock and the claim in one batch with BEGIN and
// calls no claim function, so its Verify on a partitioned table without
// one does not say that each claim takes a round trip more (an inbox.Inbox
// on database/sql, which calls it, does).
func TestVerifyOfAPartitionedTableWithoutItsClaimFunctionSaysNothingOfIt(t *testing.T) {
	pool := openPool(t, "", "pgx-claim-function", nil)
	f := newFixture(t, pool)
	f.newInbox(pgxinbox.Config{Dialect: inbox.PostgreSQLPartitioned}) // creates the table and its functions
	if _, err := pool.Exec(context.Background(), `DROP FUNCTION "`+f.table+`_claim"(text, text, bigint, bytea)`); err != nil {
		t.Fatal(err)
	}
	logs := &infoLines{}
	ib, err := pgxinbox.New(pgxinbox.Config{Pool: pool, Table: f.table, Dialect: inbox.PostgreSQLPartitioned, Logger: logs})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ib.Close() })
	if err := ib.Verify(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, line := range logs.lines {
		if strings.Contains(line, "claim function") {
			t.Errorf("pgxinbox, which calls no claim function, logged: %q", line)
		}
	}
}
