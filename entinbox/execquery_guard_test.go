package entinbox_test

import (
	"database/sql"
	"errors"
	"testing"

	"entgo.io/ent/dialect"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox/entinbox"
	"github.com/watermill-inbox/inbox/internal/testrouter"
)

// rawInvoiceInsert is a raw insert of an invoice in the dialect's placeholders.
func rawInvoiceInsert(dialectName string) string {
	if dialectName == dialect.Postgres {
		return "INSERT INTO entinbox_invoices (order_id, amount) VALUES ($1, $2)"
	}
	return "INSERT INTO entinbox_invoices (order_id, amount) VALUES (?, ?)"
}

// A repository writes the invoice with its client's ExecContext (ent's
// sql/execquery feature: the generated client.ExecContext asserts its
// driver to an interface with ExecContext) while the handler's client.Tx (an optional reservation) is
// open. While a Tx is open every client of the
// message refuses statements with ErrTxOpen, ExecContext too: entinbox's
// driver embeds entsql.Conn, whose ExecContext/QueryContext were promoted
// past the guard, so the write returned nil, the reservation's Rollback
// (ROLLBACK TO SAVEPOINT) undid it, and the message was acked without its
// invoice.
func TestDriver_client_ExecContext_is_refused_while_a_Tx_is_open(t *testing.T) {
	forEachDB(t, func(t *testing.T, fx *fixture) {
		var repoErr error
		in, out := fx.router(true, func(msg *message.Message) error {
			ctx, id := msg.Context(), msg.Metadata.Get("order_id")
			client, err := fx.clientFor(msg)
			if err != nil {
				return err
			}
			tx, err := client.Tx(ctx)
			if err != nil {
				return err
			}
			if _, err := tx.Line.Create().SetSku(id + "/reservation").Save(ctx); err != nil {
				_ = tx.Rollback()
				return err
			}
			repo, err := entinbox.Client(ctx, fx.dialect, newClient) // the repository's own client
			if err != nil {
				_ = tx.Rollback()
				return err
			}
			if _, repoErr = repo.ExecContext(ctx, rawInvoiceInsert(fx.dialect), id, 100); repoErr != nil {
				_ = tx.Rollback()
				return repoErr
			}
			return tx.Rollback() // out of stock: undo the reservation only
		})
		acked := in.Deliver(t, testrouter.Order(fx.orderID))
		_, _, found := fx.invoice(fx.orderID)
		if acked && !found {
			t.Errorf("acked, but the invoice written with the client's ExecContext (which returned %v) "+
				"was undone by the open Tx's Rollback", repoErr)
		}
		if !acked && !errors.Is(out.Last(), entinbox.ErrTxOpen) {
			t.Errorf("nacked with %v, want ErrTxOpen", out.Last())
		}
	})
}

// After an ent Tx's Rollback, database/sql's Tx (and the docs: "after its
// Commit or Rollback a statement through it returns sql.ErrTxDone") refuses
// statements. tx.ExecContext (sql/execquery; tx.Client().ExecContext too)
// reached the savepoint's promoted ExecContext, which skipped the done
// check: a write the code meant to make in the rolled-back Tx (a retry
// loop, a deferred cleanup) landed in the inbox transaction and committed
// with the message.
func TestDriver_Tx_ExecContext_after_Rollback_returns_ErrTxDone(t *testing.T) {
	forEachDB(t, func(t *testing.T, fx *fixture) {
		var lateErr error
		in, out := fx.router(true, func(msg *message.Message) error {
			ctx, id := msg.Context(), msg.Metadata.Get("order_id")
			client, err := entinbox.Client(ctx, fx.dialect, newClient)
			if err != nil {
				return err
			}
			tx, err := client.Tx(ctx)
			if err != nil {
				return err
			}
			if err := tx.Rollback(); err != nil {
				return err
			}
			_, lateErr = tx.ExecContext(ctx, rawInvoiceInsert(fx.dialect), id, 100)
			return nil
		})
		if !in.Deliver(t, testrouter.Order(fx.orderID)) {
			t.Fatalf("nacked: %v", out.Last())
		}
		if !errors.Is(lateErr, sql.ErrTxDone) {
			_, _, found := fx.invoice(fx.orderID)
			t.Errorf("ExecContext through the rolled-back Tx returned %v, want sql.ErrTxDone; its write committed with the message: %v",
				lateErr, found)
		}
	})
}
