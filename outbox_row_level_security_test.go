package inbox_test

import (
	"context"
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// The inbox table is refused when row-level security applies to the
// service's role (a policy hid processed rows); the outbox table was not
// checked: a SELECT policy that hides the service's own rows from it let
// Outbox.Verify pass, the handler's INSERT committed, and the relay, under
// the same role, never saw the row: the message was never sent, and
// Outbox.Stats reported nothing pending. Verify refuses the table, as for
// the inbox.
func TestOutboxVerifyRefusesRowLevelSecurityThatHidesRowsFromTheRelay(t *testing.T) {
	ctx := context.Background()
	owner := testdb.OpenPostgres(t, "")
	broker := newBrokerStub()
	table := "rls_outbox_rls_" + randomSuffix()
	made, err := inbox.NewOutbox(inbox.OutboxConfig{DB: owner, Dialect: inbox.PostgreSQL, Table: table, Publisher: broker})
	if err != nil {
		t.Fatal(err)
	}
	if err := made.InitializeSchema(ctx); err != nil {
		t.Fatal(err)
	}
	role := "rls_obrls_" + randomSuffix()
	exec(t, owner, "CREATE ROLE "+role+" NOLOGIN")
	t.Cleanup(func() {
		_, _ = owner.Exec("DROP TABLE IF EXISTS " + table)
		_, _ = owner.Exec("DROP TABLE IF EXISTS " + made.DeadLetterTable())
		_, _ = owner.Exec("DROP OWNED BY " + role)
		_, _ = owner.Exec("DROP ROLE " + role)
	})
	exec(t, owner, "GRANT SELECT, INSERT, UPDATE, DELETE ON "+table+", "+made.DeadLetterTable()+" TO "+role)
	exec(t, owner, "GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO "+role)
	exec(t, owner, "ALTER TABLE "+table+" ENABLE ROW LEVEL SECURITY")
	// As the inbox's own test: a SELECT policy keyed on the role, that
	// hides the rows this service writes.
	exec(t, owner, "CREATE POLICY own_topics ON "+table+" FOR SELECT USING (topic = current_user)")
	exec(t, owner, "CREATE POLICY may_insert ON "+table+" FOR INSERT WITH CHECK (true)")
	exec(t, owner, "CREATE POLICY may_delete ON "+table+" FOR DELETE USING (true)")

	db := testdb.OpenPostgres(t, "role="+role)
	ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Dialect: inbox.PostgreSQL, Table: table, Publisher: broker})
	if err != nil {
		t.Fatal(err)
	}
	verifyErr := ob.Verify(ctx)
	if errors.Is(verifyErr, inbox.ErrIncompatibleTable) {
		return // refused at startup, with the fix: nothing lost
	}
	tx, err := db.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	pub, err := ob.Publisher(tx)
	if err != nil {
		t.Fatal(err)
	}
	msg := message.NewMessage("rls-rls-"+randomSuffix(), []byte("invoice"))
	if err := pub.Publish("invoices", msg); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		ob.RelayOnce(ctx)
	}
	st, _ := ob.Stats(ctx)
	var rows int
	_ = owner.Get(&rows, "SELECT count(*) FROM "+table)
	if got := broker.uuids("invoices"); len(got) != 1 {
		t.Errorf("Outbox.Verify as the service's role: %v; the committed message was relayed %d times after 3 rounds"+
			" (%d rows still in the outbox, Stats.Pending %d); want Verify to refuse the table or the message sent",
			verifyErr, len(got), rows, st.Pending)
	}
}
