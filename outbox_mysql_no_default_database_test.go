package inbox_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// OutboxConfig.Table "may be schema-qualified". On a MySQL/MariaDB DSN
// that selects no default database (".../" : a service that names every
// table with its schema, as the Inbox allows), InitializeSchema creates or
// finds "test.<table>" and returns nil, the handlers' outputs are written,
// and every relay round publishes its batch and then fails its DELETE
// (a join on JSON_TABLE, which MariaDB refuses without a default database:
// 1046 "No database selected"), so the next round publishes the same
// messages again: each message reaches the broker once per round, for
// ever, and the outbox never empties. (The Inbox, its purge and Stats work
// on the same DSN.)
//
// Either the relay works there (each message sent once, the table
// emptied), or it is refused before it sends anything.
func TestOutboxWithAQualifiedTableOnAMySQLDSNWithoutADatabaseSendsEachMessageOnce(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	testdb.OpenMySQL(t, "") // skips without a server
	dsn := testdb.MySQLDSN()
	base, rest, _ := strings.Cut(dsn, ")/")
	_, params, _ := strings.Cut(rest, "?")
	noDB := base + ")/"
	if params != "" {
		noDB += "?" + params
	}
	db, err := sqlx.Open("mysql", noDB)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	var schema string
	if err := testdb.OpenMySQL(t, "").Get(&schema, "SELECT DATABASE()"); err != nil {
		t.Fatal(err)
	}
	table := schema + ".sess_outbox_" + randomSuffix()
	dropLater(t, db, table)
	dropLater(t, db, table+"_dead")
	broker := newBrokerStub()
	ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Table: table, Publisher: broker})
	if err != nil {
		t.Fatal(err)
	}
	initErr := ob.InitializeSchema(ctx)
	if initErr != nil {
		return // refused at startup: fine
	}
	sent := writeOutbox(t, db, ob, "invoices", 2)
	var last error
	for range 3 {
		last = ob.RelayOnce(ctx).Err
	}
	times := map[string]int{}
	for _, id := range broker.uuids("invoices") {
		times[id]++
	}
	for _, id := range sent {
		if times[id] > 1 {
			t.Errorf("message %s reached the broker %d times in 3 relay rounds (last round: %v); want once", id, times[id], last)
		}
	}
	if st, err := ob.Stats(ctx); (err != nil || st.Pending != 0) && len(times) != 0 {
		t.Errorf("outbox after 3 rounds that sent %d messages: %+v, %v; want empty, or nothing sent (last round: %v)",
			len(times), st, err, last)
	}
}
