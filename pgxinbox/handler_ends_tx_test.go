package pgxinbox_test

import (
	"context"
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/puddle/v2"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// A handler that ends the pgx transaction itself (a COMMIT or ROLLBACK
// statement through it, tx.Commit, tx.Rollback) and returns nil is nacked,
// never acked, with an error that wraps ErrTransactionEnded and is not
// transient. What the handler committed stays (its row and the inbox row
// together); what it rolled back is gone; no connection stays checked out.
func TestHandlerEndsTransaction_IsNackedWithErrTransactionEnded(t *testing.T) {
	forEachDialect(t, func(t *testing.T, d inbox.Dialect) {
		for _, c := range []struct {
			name      string
			end       func(ctx context.Context, tx pgx.Tx) error
			committed bool
		}{
			{"ROLLBACK statement", func(ctx context.Context, tx pgx.Tx) error { _, err := tx.Exec(ctx, "ROLLBACK"); return err }, false},
			{"COMMIT statement", func(ctx context.Context, tx pgx.Tx) error { _, err := tx.Exec(ctx, "COMMIT"); return err }, true},
			{"tx.Rollback", func(ctx context.Context, tx pgx.Tx) error { return tx.Rollback(ctx) }, false},
			{"tx.Commit", func(ctx context.Context, tx pgx.Tx) error { return tx.Commit(ctx) }, true},
		} {
			t.Run(c.name, func(t *testing.T) {
				t.Parallel()
				pool := openPool(t, "", "ends_tx", nil)
				f := newFixture(t, pool)
				var hooks hookCounts
				ib := f.newInbox(hooks.config(pgxinbox.Config{Dialect: d}))
				rec := &recorder{}
				in := consume(t, ib, func(msg *message.Message) error {
					if err := f.writeEffect(msg); err != nil {
						return err
					}
					tx, _ := pgxinbox.TxFromContext(msg.Context())
					if err := c.end(msg.Context(), tx); err != nil {
						t.Errorf("the handler's %s: %v", c.name, err)
					}
					return nil
				}, rec.Middleware)
				if in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
					t.Fatalf("acked a message whose handler ended the transaction itself (router got %v)", rec.last())
				}
				err := rec.last()
				if !errors.Is(err, inbox.ErrTransactionEnded) || inbox.IsTransient(err) {
					t.Errorf("router got %v (transient %v), want ErrTransactionEnded, not transient", err, inbox.IsTransient(err))
				}
				if h := hooks.get(); h != [3]int32{0, 0, 1} {
					t.Errorf("hooks processed/duplicate/failed = %v, want [0 0 1]", h)
				}
				n := 0
				if c.committed {
					n = 1
				}
				f.expectRows(n, n)
				expectNoConnHeld(t, pool)
			})
		}
	})
}

// A handler that commits or rolls back the pgx transaction itself and then
// returns an error, with more messages in flight than the pool has
// connections: each message is nacked with the handler's error, and the
// inbox never touches a connection after it went back to the pool (where
// another message already uses it): the race detector guards this.
func TestHandlerEndsTransactionThenFails_ConnectionNotTouchedAfterRelease(t *testing.T) {
	forEachDialect(t, func(t *testing.T, d inbox.Dialect) {
		pool := openPool(t, "", "ends_tx_race", func(cfg *pgxpool.Config) { cfg.MaxConns = 2 })
		f := newFixture(t, pool)
		ib := f.newInbox(pgxinbox.Config{Dialect: d})
		errHandler := errors.New("handler failed after ending its transaction")
		rec := &recorder{}
		in := consume(t, ib, func(msg *message.Message) error {
			tx, _ := pgxinbox.TxFromContext(msg.Context())
			if msg.Metadata.Get("end") == "commit" {
				_ = tx.Commit(msg.Context())
			} else {
				_ = tx.Rollback(msg.Context())
			}
			// Keep the released connection busy for whoever takes it next.
			return errHandler
		}, rec.Middleware)
		const n = 16
		var results []<-chan bool
		for i := range n {
			msg := message.NewMessage(watermill.NewUUID(), nil)
			msg.Metadata.Set("end", []string{"commit", "rollback"}[i%2])
			results = append(results, in.deliverAsync(t, msg))
		}
		for _, r := range results {
			if <-r {
				t.Error("acked a message whose handler returned an error")
			}
		}
		for _, err := range rec.All() {
			if !errors.Is(err, errHandler) {
				t.Errorf("router got %v, want the handler's error", err)
			}
		}
		expectNoConnHeld(t, pool)
	})
}

// A handler that leaves rows open on the transaction ("conn busy", a bug in
// the handler) is nacked with an error IsTransient rejects, so that a poison
// filter takes it instead of redelivering it forever; nothing is kept.
func TestTransient_ConnBusyIsNotTransient(t *testing.T) {
	forEachDialect(t, func(t *testing.T, d inbox.Dialect) {
		for _, handler := range []string{"ReturnsNil", "ReturnsTheNextStatementsError"} {
			t.Run(handler, func(t *testing.T) {
				t.Parallel()
				pool := openPool(t, "", "conn_busy", nil)
				f := newFixture(t, pool)
				ib := f.newInbox(pgxinbox.Config{Dialect: d})
				rec := &recorder{}
				in := consume(t, ib, func(msg *message.Message) error {
					if err := f.writeEffect(msg); err != nil {
						return err
					}
					tx, _ := pgxinbox.TxFromContext(msg.Context())
					rows, err := tx.Query(msg.Context(), "SELECT generate_series(1, 10000)")
					if err != nil {
						return err
					}
					_ = rows // left open: the bug
					if handler == "ReturnsNil" {
						return nil
					}
					return f.writeEffect(msg)
				}, rec.Middleware)
				if in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
					t.Fatal("acked a message whose handler left rows open")
				}
				if err := rec.last(); err == nil || inbox.IsTransient(err) {
					t.Errorf("router got %v (transient %v), want a non-transient error", err, inbox.IsTransient(err))
				}
				f.expectRows(0, 0)
				expectNoConnHeld(t, pool)
			})
		}
	})
}

// A message that arrives after the pgx pool closed (a deploy shutting the
// service down) is nacked with an error IsTransient accepts, so that a
// poison filter leaves it for a redelivery; errors.Is reaches puddle's
// ErrClosedPool.
func TestTransient_ClosedPoolIsTransient(t *testing.T) {
	forEachDialect(t, func(t *testing.T, d inbox.Dialect) {
		f := newFixture(t, openPool(t, "", "closed_pool", nil))
		pool := openPool(t, "", "closed_pool", nil) // the inbox's, closed below
		ib := f.newInbox(pgxinbox.Config{Dialect: d, Pool: pool})
		rec := &recorder{}
		in := consume(t, ib, f.writeEffect, rec.Middleware)
		if !in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
			t.Fatalf("nacked before the pool closed: %v", rec.last())
		}
		f.expectRows(1, 1)
		pool.Close()
		if in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
			t.Fatal("acked a message on a closed pool")
		}
		err := rec.last()
		if !errors.Is(err, puddle.ErrClosedPool) || !inbox.IsTransient(err) {
			t.Errorf("router got %v (transient %v), want puddle.ErrClosedPool, transient", err, inbox.IsTransient(err))
		}
	})
}
