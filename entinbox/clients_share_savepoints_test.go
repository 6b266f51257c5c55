package entinbox_test

import (
	"context"
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox/entinbox"
	"github.com/watermill-inbox/inbox/internal/testrouter"
)

// invoiceRepo is a repository as applications write them: each method takes
// the context and its client from it with the one call.
type invoiceRepo struct{ dialect string }

func (r invoiceRepo) create(ctx context.Context, orderID string) error {
	client, err := entinbox.Client(ctx, r.dialect, newClient)
	if err != nil {
		return err
	}
	return client.Invoice.Create().SetOrderID(orderID).SetAmount(100).Exec(ctx)
}

// While the handler's client.Tx (an optional reservation) is open, a
// repository writes the invoice through a client of its own on the same
// message. A savepoint spans the whole inbox transaction: the repository's
// write is refused with ErrTxOpen, as the Tx's own client's is, and never
// acked without it. The guard was per client: the write returned nil, the
// reservation's Rollback undid it, and the message was acked without its
// invoice.
func TestDriver_every_client_of_the_message_refuses_statements_while_a_Tx_is_open(t *testing.T) {
	forEachDB(t, func(t *testing.T, fx *fixture) {
		repo := invoiceRepo{dialect: fx.dialect}
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
			if repoErr = repo.create(ctx, id); repoErr != nil {
				_ = tx.Rollback()
				return repoErr
			}
			return tx.Rollback() // out of stock: undo the reservation only
		})
		acked := in.Deliver(t, testrouter.Order(fx.orderID))
		_, _, found := fx.invoice(fx.orderID)
		if acked && !found {
			t.Errorf("acked, but the invoice the repository wrote (its Exec returned %v) was undone by the other client's Rollback", repoErr)
		}
		if !acked && !errors.Is(out.Last(), entinbox.ErrTxOpen) {
			t.Errorf("nacked with %v, want ErrTxOpen from the repository's client", out.Last())
		}
	})
}
