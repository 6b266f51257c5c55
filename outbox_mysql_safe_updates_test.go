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

// MySQL/MariaDB sessions with sql_safe_updates on (the DSN's
// sql_safe_updates=1, the mysql client's --safe-updates, a server's
// init_connect) refuse an UPDATE or DELETE whose WHERE uses no key column
// (1175). The relay's DELETE of the rows it sent is such a statement (a
// join on JSON_TABLE, no WHERE): InitializeSchema accepts the sessions, and
// every relay round publishes its batch to the broker, fails its DELETE
// and rolls back, so the next round publishes the same messages again:
// each message reaches the broker once per round, for ever, and the outbox
// never empties.
//
// Either the relay works on such sessions (each message sent once, the
// table emptied), or it refuses them before it sends anything, with an
// ErrInvalidConfig that names sql_safe_updates, as it refuses
// completion_type and autocommit.
func TestOutboxOnMySQLSessionsWithSafeUpdatesSendsEachMessageOnce(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	plain := testdb.OpenMySQL(t, "")
	table := "sess_outbox_" + randomSuffix()
	dropLater(t, plain, table)
	dropLater(t, plain, table+"_dead")
	made, err := inbox.NewOutbox(inbox.OutboxConfig{DB: plain, Table: table, Publisher: newBrokerStub()})
	if err != nil {
		t.Fatal(err)
	}
	if err := made.InitializeSchema(ctx); err != nil {
		t.Fatal(err)
	}
	sent := writeOutbox(t, plain, made, "invoices", 2)

	db := testdb.OpenMySQL(t, "sql_safe_updates=1")
	broker := newBrokerStub()
	ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Table: table, Publisher: broker})
	if err != nil {
		t.Fatal(err)
	}
	initErr := ob.InitializeSchema(ctx)
	var last error
	for range 3 {
		last = ob.RelayOnce(ctx).Err
	}
	got := broker.uuids("invoices")
	times := map[string]int{}
	for _, id := range got {
		times[id]++
	}
	for _, id := range sent {
		if times[id] > 1 {
			t.Errorf("message %s reached the broker %d times in 3 relay rounds on sessions with sql_safe_updates=1"+
				" (InitializeSchema: %v; last round: %v); want once, or refused before sending", id, times[id], initErr, last)
		}
	}
	st, err := ob.Stats(ctx)
	if err == nil && st.Pending == 0 {
		return // the relay works on such sessions
	}
	if !errors.Is(last, inbox.ErrInvalidConfig) || !strings.Contains(last.Error(), "sql_safe_updates") {
		t.Errorf("rows left pending (stats %+v, %v) and the round failed with %v; want ErrInvalidConfig naming sql_safe_updates",
			st, err, last)
	}
	if len(got) != 0 && !errors.Is(initErr, inbox.ErrInvalidConfig) {
		t.Errorf("the relay sent %d messages on sessions it cannot delete them on; want none", len(got))
	}
}
