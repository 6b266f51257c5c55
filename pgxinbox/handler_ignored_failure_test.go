package pgxinbox_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// A handler that ignores a failed statement and returns nil has its
// transaction aborted by PostgreSQL: the COMMIT rolls it back, or the
// returned output's INSERT, sent with the COMMIT, fails with 25P02. The
// error that reaches the router names that cause and the fix (it said only
// "commit unexpectedly resulted in rollback", or blamed the outbox), still
// matches the driver's error, and nothing is written.
func TestHandlerThatIgnoresAFailedStatementIsToldWhy(t *testing.T) {
	pool := testdb.OpenPgxPool(t, "")
	for _, output := range []bool{false, true} {
		t.Run(map[bool]string{false: "no-output", true: "output"}[output], func(t *testing.T) {
			f := newReturnedFixture(t, pool, func(f *returnedFixture, msg *message.Message) ([]*message.Message, error) {
				tx, _ := pgxinbox.TxFromContext(msg.Context())
				// The mistake: the error of a failed statement ignored.
				_, _ = tx.Exec(msg.Context(), "INSERT INTO "+f.effect+" (message_id) VALUES (NULL)")
				if output {
					return outputs(msg, 1), nil
				}
				return nil, nil
			})
			if f.in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
				t.Fatal("acked a message whose transaction PostgreSQL aborted")
			}
			err := f.rec.last()
			if !strings.Contains(err.Error(), "a statement of the handler failed and the handler returned nil without its error") {
				t.Errorf("router got %q, want the hint that the handler ignored a failed statement", err)
			}
			if !output && !errors.Is(err, pgx.ErrTxCommitRollback) {
				t.Errorf("router got %v, want it to match pgx.ErrTxCommitRollback still", err)
			}
			if n := f.outboxRows(); n != 0 {
				t.Errorf("%d outputs written", n)
			}
			f.expectRows(0, 0)
		})
	}
}

// A handler that recovered from its failed statement (ROLLBACK TO
// SAVEPOINT), after an outbox publish while its transaction was failed,
// and whose COMMIT then fails on a deferred foreign key is not told that it
// ignored a failed statement: the hint went by the first failed status
// seen, not by the transaction's state at the COMMIT.
func TestHandlerThatRecoveredWithASavepointIsNotBlamedForTheCommitsFailure(t *testing.T) {
	pool := testdb.OpenPgxPool(t, "")
	var child string
	f := newReturnedFixture(t, pool, func(f *returnedFixture, msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		tx, _ := pgxinbox.TxFromContext(ctx)
		pub, _ := inbox.OutboxFromContext(ctx)
		if _, err := tx.Exec(ctx, "SAVEPOINT sp"); err != nil {
			return nil, err
		}
		_, _ = tx.Exec(ctx, "INSERT INTO "+f.effect+" (message_id) VALUES (NULL)")
		_ = pub.Publish("audit", message.NewMessage(watermill.NewUUID(), nil)) // refused: the transaction is failed
		if _, err := tx.Exec(ctx, "ROLLBACK TO SAVEPOINT sp"); err != nil {
			return nil, err
		}
		if err := pub.Publish("audit", message.NewMessage(watermill.NewUUID(), nil)); err != nil {
			return nil, err
		}
		_, err := tx.Exec(ctx, "INSERT INTO "+child+" (id, ref) VALUES (1, 999)") // fails at COMMIT
		return nil, err
	})
	parent := "pgx_parent_" + f.sfx
	child = "pgx_child_" + f.sfx
	f.exec("CREATE TABLE " + parent + " (id int PRIMARY KEY)")
	f.exec("CREATE TABLE " + child + " (id int PRIMARY KEY, ref int REFERENCES " + parent + "(id) DEFERRABLE INITIALLY DEFERRED)")
	f.dropLater(child, parent)
	if f.in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
		t.Fatal("acked a message whose COMMIT failed")
	}
	if err := f.rec.last(); strings.Contains(err.Error(), "a statement of the handler failed and the handler returned nil") {
		t.Errorf("COMMIT failed on a deferred foreign key after the handler recovered, and the error blames an ignored statement: %v", err)
	}
}
