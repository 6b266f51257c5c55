package pgxinbox_test

import (
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// A COMMIT sent with the returned messages' INSERT that outlives
// CommitTimeout is in doubt: a transient ErrCommitTimeout, no connection
// kept, and the redelivery leaves the outputs exactly once.
func TestOutbox_ReturnedMessagesWithASlowCommitAreInDoubtInEveryMode(t *testing.T) {
	for _, mode := range allModes {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			pool := openPool(t, "postgres", "pgxinbox_slow_"+testdb.RandomSuffix(), func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = mode })
			f := newReturnedFixtureWith(t, pool, pgxinbox.Config{CommitTimeout: 300 * time.Millisecond}, func(f *returnedFixture, msg *message.Message) ([]*message.Message, error) {
				if err := f.writeEffect(msg); err != nil {
					return nil, err
				}
				pub, _ := inbox.OutboxFromContext(msg.Context())
				if err := pub.Publish("invoices", message.NewMessage(msg.UUID+"-published", []byte("p"))); err != nil {
					return nil, err
				}
				return outputs(msg, 2), nil
			})
			f.slowCommit(time.Second)
			msg := message.NewMessage(watermill.NewUUID(), nil)
			if f.in.deliver(t, labelled(msg, "first")) {
				t.Fatal("acked a message whose COMMIT outlived CommitTimeout")
			}
			if err := f.rec.lastOf("first"); !errors.Is(err, inbox.ErrCommitTimeout) || !inbox.IsTransient(err) {
				t.Errorf("router got %v, want a transient ErrCommitTimeout", err)
			}
			expectNoConnHeld(t, pool)
			f.fastCommit()
			// A loaded machine may need more than the bound for a plain
			// COMMIT too: a redelivery that timed out is redelivered again.
			for attempt := 1; !f.in.deliver(t, labelled(msg, "redelivery")); attempt++ {
				if err := f.rec.lastOf("redelivery"); !errors.Is(err, inbox.ErrCommitTimeout) || attempt == 5 {
					t.Fatalf("redelivery %d nacked: %v", attempt, err)
				}
			}
			f.expectRows(1, 1)
			want := []string{msg.UUID + "-published", msg.UUID + "-invoice-a", msg.UUID + "-invoice-b"}
			if got := f.relayed(t); !slices.Equal(got, want) {
				t.Errorf("relayed %v, want %v", got, want)
			}
			expectNoConnHeld(t, pool)
		})
	}
}

// A COMMIT sent with the returned messages that fails (a deferred
// constraint) nacks with the server's error in every mode: nothing stays,
// and no connection is kept.
func TestOutbox_ReturnedMessagesOfAFailedCommitInEveryMode(t *testing.T) {
	for _, mode := range allModes {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			pool := openPool(t, "", "pgx_outbox_commit_fails_"+testdb.RandomSuffix(), func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = mode })
			deferred := "pgx_deferred_" + testdb.RandomSuffix()
			f := newReturnedFixtureWith(t, pool, pgxinbox.Config{}, func(f *returnedFixture, msg *message.Message) ([]*message.Message, error) {
				tx, _ := pgxinbox.TxFromContext(msg.Context())
				if _, err := tx.Exec(msg.Context(), "INSERT INTO "+deferred+" (k) VALUES (1)"); err != nil {
					return nil, err
				}
				return outputs(msg, 2), nil
			})
			f.exec("CREATE TABLE " + deferred + " (k int, CONSTRAINT " + deferred + "_k UNIQUE (k) DEFERRABLE INITIALLY DEFERRED)")
			f.dropLater(deferred)
			f.exec("INSERT INTO " + deferred + " (k) VALUES (1)")
			if f.in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
				t.Fatal("acked a message whose COMMIT failed")
			}
			var pgErr *pgconn.PgError
			if err := f.rec.last(); !errors.As(err, &pgErr) || pgErr.Code != "23505" {
				t.Errorf("router got %v, want the COMMIT's 23505", err)
			}
			if n, rows := f.outboxRows(), f.inboxRows(); n != 0 || rows != 0 {
				t.Errorf("outbox rows %d, inbox rows %d after the failed COMMIT, want 0 and 0", n, rows)
			}
			expectNoConnHeld(t, pool)
		})
	}
}
