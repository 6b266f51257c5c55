package pgxinbox_test

import (
	"context"
	"slices"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// The server ends the connection (pg_terminate_backend) after the handler
// ran and before the returned messages' INSERT and COMMIT go: the message is
// nacked with a transient error, nothing stays, no connection is held, and
// the redelivery writes the outputs once.
func TestOutbox_ReturnedMessagesOfATerminatedBackendAreNotWritten(t *testing.T) {
	for _, mode := range allModes {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			pool := openPool(t, "", "pgx_outbox_terminated_"+testdb.RandomSuffix(), func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = mode })
			f := newReturnedFixtureWith(t, pool, pgxinbox.Config{}, func(f *returnedFixture, msg *message.Message) ([]*message.Message, error) {
				if err := f.writeEffect(msg); err != nil {
					return nil, err
				}
				if msg.Metadata.Get("delivery") == "first" {
					tx, _ := pgxinbox.TxFromContext(msg.Context())
					var pid int
					if err := tx.QueryRow(msg.Context(), "SELECT pg_backend_pid()").Scan(&pid); err != nil {
						return nil, err
					}
					if _, err := f.pool.Exec(context.Background(), "SELECT pg_terminate_backend($1, 5000)", pid); err != nil {
						return nil, err
					}
				}
				return outputs(msg, 2), nil
			})
			msg := message.NewMessage(watermill.NewUUID(), nil)
			if f.in.deliver(t, labelled(msg, "first")) {
				t.Fatal("acked a message whose connection was terminated before its COMMIT")
			}
			if err := f.rec.lastOf("first"); !inbox.IsTransient(err) {
				t.Errorf("router got %v, want a transient error", err)
			}
			f.expectRows(0, 0)
			expectNoConnHeld(t, pool)
			if !f.in.deliver(t, labelled(msg, "redelivery")) {
				t.Fatalf("redelivery nacked: %v", f.rec.lastOf("redelivery"))
			}
			f.expectRows(1, 1)
			if got := f.relayed(t); !slices.Equal(got, []string{msg.UUID + "-invoice-a", msg.UUID + "-invoice-b"}) {
				t.Errorf("relayed %v", got)
			}
			expectNoConnHeld(t, pool)
		})
	}
}
