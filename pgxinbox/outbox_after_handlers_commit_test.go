package pgxinbox_test

import (
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// A handler that commits the transaction itself (a COMMIT statement, or
// tx.Commit) and then publishes an output through pgxinbox.OutboxPublisher
// gets ErrTransactionEnded, not transient, and so does the router when the
// handler returns it: it got ErrTxRolledBack, transient, the redelivery was
// skipped as a duplicate and the output lost with nothing to tell.
func TestOutboxPublishAfterTheHandlersCommitIsRefusedAsTheHandlersEnd(t *testing.T) {
	for _, how := range []string{"statement", "tx.Commit"} {
		t.Run(how, func(t *testing.T) {
			pool := openPool(t, "", "pgx_publish_after_commit", nil)
			var published error
			f := newOutboxTxFixture(t, pool, func(f *outboxTxFixture, msg *message.Message) error {
				if err := f.writeEffect(msg); err != nil {
					return err
				}
				tx, _ := pgxinbox.TxFromContext(msg.Context())
				if how == "statement" {
					if _, err := tx.Exec(msg.Context(), "COMMIT"); err != nil {
						return err
					}
				} else if err := tx.Commit(msg.Context()); err != nil {
					return err
				}
				published = publish(msg, "-out")
				return published
			})
			if f.in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
				t.Fatal("acked; want nacked: the handler ended the transaction")
			}
			if !errors.Is(published, inbox.ErrTransactionEnded) || inbox.IsTransient(published) {
				t.Errorf("Publish after the handler's commit = %v, want ErrTransactionEnded, not transient", published)
			}
			if err := f.rec.last(); !errors.Is(err, inbox.ErrTransactionEnded) || inbox.IsTransient(err) {
				t.Errorf("router got %v, want ErrTransactionEnded, not transient", err)
			}
		})
	}
}
