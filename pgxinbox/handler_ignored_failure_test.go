package pgxinbox_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

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
