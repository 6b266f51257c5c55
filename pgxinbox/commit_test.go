package pgxinbox_test

import (
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// A COMMIT that fails (a deferred unique constraint checked at COMMIT) is a
// nack with the database's error; nothing is committed, and the message is
// never acked.
func TestCommit_FailingCommitIsANack(t *testing.T) {
	forEachDialect(t, func(t *testing.T, d inbox.Dialect) {
		pool := testdb.OpenPgxPool(t, "")
		f := newFixtureWith(t, pool, "(message_id text NOT NULL UNIQUE DEFERRABLE INITIALLY DEFERRED)")
		var hooks hookCounts
		ib := f.newInbox(hooks.config(pgxinbox.Config{Dialect: d}))
		rec := &recorder{}
		in := consume(t, ib, func(msg *message.Message) error {
			// Both inserts succeed; the constraint fails at COMMIT.
			if err := f.writeEffect(msg); err != nil {
				return err
			}
			return f.writeEffect(msg)
		}, rec.Middleware)
		msg := message.NewMessage(watermill.NewUUID(), nil)
		for i := range 2 {
			if in.deliver(t, msg) {
				t.Fatalf("delivery %d acked although its COMMIT failed", i+1)
			}
			var pgErr *pgconn.PgError
			if err := rec.last(); !errors.As(err, &pgErr) || pgErr.Code != "23505" {
				t.Errorf("router got %v, want the unique violation (23505) from COMMIT", err)
			}
		}
		f.expectRows(0, 0)
		if got := hooks.get(); got != [3]int32{0, 0, 2} {
			t.Errorf("hooks processed/duplicate/failed %v, want [0 0 2]", got)
		}
		expectNoConnHeld(t, pool)
	})
}

// Above READ COMMITTED, a concurrent delivery of a key whose first delivery
// commits fails with a serialization failure (40001): a transient nack,
// never an ack, and its redelivery is skipped as a duplicate.
func TestCommit_SerializationFailureIsATransientNack(t *testing.T) {
	t.Parallel()
	for _, level := range []pgx.TxIsoLevel{pgx.RepeatableRead, pgx.Serializable} {
		t.Run(string(level), func(t *testing.T) {
			t.Parallel()
			app := "pgxinbox_ser_" + testdb.RandomSuffix()
			pool := openPool(t, "", app, nil)
			f := newFixture(t, pool)
			ib := f.newInbox(pgxinbox.Config{IsoLevel: level})
			rec := &recorder{}
			var c calls
			in := consume(t, ib, func(msg *message.Message) error {
				c.inc(msg)
				tx, _ := pgxinbox.TxFromContext(msg.Context())
				var iso string
				if err := tx.QueryRow(msg.Context(), "SHOW transaction_isolation").Scan(&iso); err != nil {
					return err
				}
				if iso != string(level) {
					t.Errorf("transaction isolation %q, want %q", iso, level)
				}
				if err := f.writeEffect(msg); err != nil {
					return err
				}
				if msg.Metadata.Get("delivery") == "first" {
					waitFor(t, "second delivery waiting on the key", func() bool { return lockWaiters(t, pool, app) == 1 })
				}
				return nil
			}, rec.Middleware)
			msg := message.NewMessage(watermill.NewUUID(), nil)
			firstAcked := in.deliverAsync(t, labelled(msg, "first"))
			waitFor(t, "first delivery claimed", func() bool { return c.get("first") == 1 })
			secondAcked := in.deliverAsync(t, labelled(msg, "second"))
			if !<-firstAcked {
				t.Errorf("first nacked: %v", rec.lastOf("first"))
			}
			if <-secondAcked {
				t.Error("second acked")
			}
			err := rec.lastOf("second")
			var pgErr *pgconn.PgError
			if !errors.As(err, &pgErr) || pgErr.Code != "40001" || !inbox.IsTransient(err) {
				t.Errorf("second got %v, want a transient serialization failure (40001)", err)
			}
			if !in.deliver(t, labelled(msg, "third")) {
				t.Errorf("redelivery nacked: %v", rec.lastOf("third"))
			}
			if c.get("second")+c.get("third") != 0 {
				t.Error("handler called for the concurrent duplicate or its redelivery")
			}
			f.expectRows(1, 1)
			expectNoConnHeld(t, pool)
		})
	}
}

// middleware.Timeout outside the inbox whose deadline passes during a slow
// COMMIT does not abandon the COMMIT: the committed message is acked, its
// AfterCommit function runs, and its effect is there once.
func TestCommit_DeadlineDuringCommitStillAcks(t *testing.T) {
	forEachDialect(t, func(t *testing.T, d inbox.Dialect) {
		pool := slowCommitPool(t)
		f := newFixture(t, pool)
		// The deadline (1 s from the start of the delivery) passes during
		// the COMMIT, which takes 2 s after the handler returned.
		f.slowCommit(2 * time.Second)
		ib := f.newInbox(pgxinbox.Config{Dialect: d})
		rec := &recorder{}
		var afterCommit calls
		in := consume(t, ib, func(msg *message.Message) error {
			if _, ok := msg.Context().Deadline(); !ok {
				t.Error("no deadline in the message context: Timeout is not outside the inbox")
			}
			inbox.AfterCommit(msg.Context(), func() { afterCommit.inc(msg) })
			return f.writeEffect(msg)
		}, rec.Middleware, middleware.Timeout(time.Second))
		msg := message.NewMessage(watermill.NewUUID(), nil)
		if !in.deliver(t, msg) {
			t.Fatalf("nacked a message whose transaction committed: %v", rec.last())
		}
		if afterCommit.get("") != 1 {
			t.Error("AfterCommit function did not run")
		}
		f.expectRows(1, 1)
		if !in.deliver(t, msg) {
			t.Fatalf("redelivery nacked: %v", rec.last())
		}
		f.expectRows(1, 1)
		expectNoConnHeld(t, pool)
	})
}

// A COMMIT that outlives CommitTimeout is a transient nack wrapping
// ErrCommitTimeout. pgx cancels it (a cancel request, then it closes the
// connection), so the COMMIT is in doubt: the server usually rolls it back,
// but may have finished it. The redelivery settles it either way: the
// effect is there exactly once.
func TestCommit_CommitTimeoutIsATransientNack(t *testing.T) {
	forEachDialect(t, func(t *testing.T, d inbox.Dialect) {
		pool := slowCommitPool(t)
		f := newFixture(t, pool)
		f.slowCommit(time.Second)
		var hooks hookCounts
		ib := f.newInbox(hooks.config(pgxinbox.Config{Dialect: d, CommitTimeout: 100 * time.Millisecond}))
		rec := &recorder{}
		var c calls
		handler := func(msg *message.Message) error { c.inc(msg); return f.writeEffect(msg) }
		in := consume(t, ib, handler, rec.Middleware)
		msg := message.NewMessage(watermill.NewUUID(), nil)
		if in.deliver(t, msg) {
			t.Fatal("acked a message whose COMMIT outlived CommitTimeout")
		}
		if err := rec.last(); !errors.Is(err, inbox.ErrCommitTimeout) || !inbox.IsTransient(err) {
			t.Errorf("router got %v, want a transient ErrCommitTimeout", err)
		}
		expectNoConnHeld(t, pool)
		f.fastCommit()
		// The redelivery waits on the in-doubt COMMIT's locks while the
		// server still runs it, then claims the key (rolled back) or finds
		// it claimed (committed). It goes to a consumer restarted with the
		// default bound: on 2 busy cores a plain COMMIT can outlast 100 ms,
		// and a second timeout would be a second failure.
		restarted := consume(t, f.newInbox(hooks.config(pgxinbox.Config{Dialect: d})), handler, rec.Middleware)
		if !restarted.deliver(t, msg) {
			t.Fatalf("redelivery nacked: %v", rec.last())
		}
		f.expectRows(1, 1)
		if got := hooks.get(); got[0]+got[1] != 1 || got[2] != 1 {
			t.Errorf("hooks processed/duplicate/failed %v, want one failure, then processed or duplicate", got)
		}
		if n := c.get(""); n != int(1+hooks.processed.Load()) {
			t.Errorf("handler calls %d with %d processed", n, hooks.processed.Load())
		}
		expectNoConnHeld(t, pool)
	})
}
