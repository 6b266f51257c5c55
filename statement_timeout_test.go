package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// TestStatementTimeout_IsATransientNack makes one handler statement of a few
// messages exceed a statement timeout on their first attempt: PostgreSQL with
// SET LOCAL statement_timeout (SQLSTATE 57014, query_canceled), MariaDB with
// SET STATEMENT max_statement_time (error 1969). Each is a nack; the
// redelivery processes the message once.
func TestStatementTimeout_IsATransientNack(t *testing.T) {
	t.Parallel()
	for _, kind := range []string{"postgres", "postgres-partitioned", "mysql", "mysql-clientFoundRows", "sqlite"} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			if kind == "sqlite" {
				t.Skip("SQLite has no statement timeout (only busy_timeout, which the lock tests cover)")
			}
			d := openFaultDB(t, kind, "")
			ctx, cancel := context.WithTimeout(context.Background(), faultTimeout)
			defer cancel()
			msgs := newMessages(60)
			victims := map[string]bool{msgs[5].UUID: true, msgs[25].UUID: true, msgs[45].UUID: true}
			var e *faultEnv
			e = newFaultEnv(t, d, inbox.Config{}, func(msg *message.Message, tx *sqlx.Tx, attempt int) error {
				if err := e.ledgerRow(msg, tx, attempt, false); err != nil {
					return err
				}
				if attempt != 1 || !victims[msg.UUID] {
					return nil
				}
				// A statement that cannot finish within the timeout: it
				// sleeps 30 s, the timeout is 100 ms.
				var err error
				if d.postgres() {
					if _, err = tx.ExecContext(msg.Context(), "SET LOCAL statement_timeout = '100ms'"); err != nil {
						return err
					}
					_, err = tx.ExecContext(msg.Context(), "SELECT pg_sleep(30)")
				} else {
					_, err = tx.ExecContext(msg.Context(), "SET STATEMENT max_statement_time = 0.1 FOR SELECT SLEEP(30)")
				}
				if err == nil {
					return errors.New("the slow statement finished despite the timeout")
				}
				return fmt.Errorf("slow statement: %w", err)
			})
			e.stream(ctx, msgs, 4)
			for _, msg := range msgs {
				if !victims[msg.UUID] {
					continue
				}
				err := e.wantFaultNacked(msg, 1, "statement timeout")
				if d.postgres() && pgCode(err) != "57014" || !d.postgres() && mysqlNumber(err) != 1969 {
					t.Errorf("statement timeout: got %s, want SQLSTATE 57014 / MySQL 1969", describeErr(err))
				}
			}
			if n := len(e.nacks()); n != len(victims) {
				t.Errorf("%d nacks, want %d", n, len(victims))
			}
			e.checkExactlyOnce(ids(msgs))
		})
	}
}
