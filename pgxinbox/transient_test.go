package pgxinbox_test

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// A connection killed mid-handler (pg_terminate_backend from another
// connection) is a nack with an error IsTransient accepts, whether the
// handler returns the error of its next statement or ignores it and lets
// COMMIT fail; the pool does not leak the dead connection, and the
// redelivery processes the message once.
func TestTransient_ConnectionKilledMidHandler(t *testing.T) {
	forEachDialect(t, func(t *testing.T, d inbox.Dialect) {
		for _, handler := range []string{"ReturnsTheError", "IgnoresTheError"} {
			t.Run(handler, func(t *testing.T) {
				t.Parallel()
				pool := testdb.OpenPgxPool(t, "")
				killer := testdb.OpenPgxPool(t, "")
				f := newFixture(t, pool)
				ib := f.newInbox(pgxinbox.Config{Dialect: d})
				rec := &recorder{}
				var c calls
				in := consume(t, ib, func(msg *message.Message) error {
					c.inc(msg)
					if err := f.writeEffect(msg); err != nil {
						return err
					}
					if c.get("") > 1 {
						return nil
					}
					tx, _ := pgxinbox.TxFromContext(msg.Context())
					var pid int
					if err := tx.QueryRow(msg.Context(), "SELECT pg_backend_pid()").Scan(&pid); err != nil {
						return err
					}
					var ok bool
					if err := killer.QueryRow(context.Background(), "SELECT pg_terminate_backend($1, 30000)", pid).Scan(&ok); err != nil || !ok {
						t.Errorf("pg_terminate_backend(%d): %v, %v", pid, ok, err)
					}
					err := f.writeEffect(msg)
					if handler == "ReturnsTheError" {
						return err
					}
					return nil
				}, rec.Middleware)
				msg := message.NewMessage(watermill.NewUUID(), nil)
				if in.deliver(t, msg) {
					t.Fatal("acked a message whose connection was killed")
				}
				if err := rec.last(); err == nil || !inbox.IsTransient(err) {
					t.Errorf("router got %v, want a transient error", err)
				}
				expectNoConnHeld(t, pool)
				f.expectRows(0, 0)
				if !in.deliver(t, msg) {
					t.Fatalf("redelivery nacked: %v", rec.last())
				}
				f.expectRows(1, 1)
				expectNoConnHeld(t, pool)
			})
		}
	})
}
