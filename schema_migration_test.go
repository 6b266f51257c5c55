package inbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// TestSchemaMigrationDuringTrafficIsNotPoisoned: a deploy adds a column to a
// business table while the service runs (online, as docs/reused-ids.md's
// ALTER for the inbox table itself). pgx's statement cache (the default
// behind database/sql) then fails the handler's cached `SELECT *` once per
// pooled connection: SQLSTATE 0A000 "cached plan must not change result
// type". pgx drops the statement, and the redelivery succeeds: nothing about
// the message is wrong, but IsTransient says false, so !IsTransient poisons it.
func TestSchemaMigrationDuringTrafficIsNotPoisoned(t *testing.T) {
	d := openFaultDB(t, "postgres", "")
	d.pool.SetMaxOpenConns(1)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var e *faultEnv
	e = newFaultEnv(t, d, inbox.Config{}, func(msg *message.Message, tx *sqlx.Tx, attempt int) error {
		if err := e.ledgerRow(msg, tx, attempt, false); err != nil {
			return err
		}
		rows, err := tx.QueryContext(msg.Context(), "SELECT * FROM "+e.ledger+" WHERE message_id = $1", msg.UUID)
		if err != nil {
			return fmt.Errorf("read back: %w", err)
		}
		defer rows.Close()
		for rows.Next() {
		}
		return rows.Err()
	})
	msgs := newMessages(2)
	if err := e.deliverUntilAcked(ctx, msgs[0], 1); err != nil {
		t.Fatal(err)
	}
	exec(t, d.ctl, "ALTER TABLE "+e.ledger+" ADD COLUMN note text") // the deploy's migration
	if err := e.deliverUntilAcked(ctx, msgs[1], 1); err != nil {
		t.Fatal(err)
	}
	for _, n := range e.nacks() {
		t.Logf("nack of %s attempt %d: %s (IsTransient=%v)", n.id, n.attempt, describeErr(n.err), inbox.IsTransient(n.err))
		if !inbox.IsTransient(n.err) {
			t.Errorf("nacked with a non-transient error (poisoned by !IsTransient), although its redelivery succeeds: %s", describeErr(n.err))
		}
	}
	e.checkExactlyOnce(ids(msgs))
}
