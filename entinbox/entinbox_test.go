package entinbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"

	"entgo.io/ent/dialect"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/entinbox"
	"github.com/watermill-inbox/inbox/entinbox/internal/invoiceent"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/internal/testrouter"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

var errHandler = errors.New("handler failed after its ent writes")

// forEachDB runs f as a parallel subtest on every database, each with a
// fixture of its own.
func forEachDB(t *testing.T, f func(t *testing.T, fx *fixture)) {
	t.Helper()
	for _, d := range databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			f(t, newFixture(t, d))
		})
	}
}

// newClient builds the generated client on a driver, as an application
// writes it once for entinbox.Client.
func newClient(drv dialect.Driver) *invoiceent.Client {
	return invoiceent.NewClient(invoiceent.Driver(drv))
}

// clientFor returns the ent client on the inbox transaction of msg.
func (f *fixture) clientFor(msg *message.Message) (*invoiceent.Client, error) {
	return entinbox.Client(msg.Context(), f.dialect, newClient)
}

// issue writes, through client, the invoice of orderID with two lines and
// then raises its amount from 100 to 101: the lines' foreign key is in their
// own table, so the create, and the update as always, run in a transaction
// ent starts on the driver.
func issue(ctx context.Context, client *invoiceent.Client, orderID string) error {
	lines, err := client.Line.CreateBulk(
		client.Line.Create().SetSku(orderID+"/a"),
		client.Line.Create().SetSku(orderID+"/b"),
	).Save(ctx)
	if err != nil {
		return err
	}
	inv, err := client.Invoice.Create().SetOrderID(orderID).SetAmount(100).AddLines(lines...).Save(ctx)
	if err != nil {
		return err
	}
	return client.Invoice.UpdateOne(inv).AddAmount(1).Exec(ctx)
}

// A message is processed once: the invoice, its lines and the update commit
// with the inbox row; the duplicate is acked without calling the handler.
func TestDriver_commits_ent_writes_with_the_inbox_row_once(t *testing.T) {
	forEachDB(t, func(t *testing.T, fx *fixture) {
		var calls atomic.Int32
		in, out := fx.router(true, func(msg *message.Message) error {
			calls.Add(1)
			client, err := fx.clientFor(msg)
			if err != nil {
				return err
			}
			return issue(msg.Context(), client, msg.Metadata.Get("order_id"))
		})
		msg := testrouter.Order(fx.orderID)

		if !in.Deliver(t, msg) {
			t.Fatalf("first delivery nacked: %v", out.Last())
		}
		if !in.Deliver(t, msg) {
			t.Fatalf("duplicate nacked: %v", out.Last())
		}

		if n := calls.Load(); n != 1 {
			t.Errorf("handler calls: %d, want 1 (the duplicate is skipped)", n)
		}
		if amount, lines, ok := fx.invoice(fx.orderID); !ok || amount != 101 || lines != 2 {
			t.Errorf("invoice: found %t, amount %d, lines %d; want true, 101, 2", ok, amount, lines)
		}
		if n := fx.inboxRows(); n != 1 {
			t.Errorf("inbox rows: %d, want 1", n)
		}
	})
}

// A handler error after ent writes rolls them back with the inbox row; the
// redelivery processes the message.
func TestDriver_handler_error_rolls_back_ent_writes_with_the_inbox_row(t *testing.T) {
	forEachDB(t, func(t *testing.T, fx *fixture) {
		var calls atomic.Int32
		in, out := fx.router(true, func(msg *message.Message) error {
			attempt := calls.Add(1)
			client, err := fx.clientFor(msg)
			if err != nil {
				return err
			}
			if err := issue(msg.Context(), client, msg.Metadata.Get("order_id")); err != nil {
				return err
			}
			if attempt == 1 {
				return errHandler
			}
			return nil
		})
		msg := testrouter.Order(fx.orderID)

		if in.Deliver(t, msg) {
			t.Fatal("the failing delivery was acked")
		}
		if err := out.Last(); !errors.Is(err, errHandler) {
			t.Fatalf("router got %v, want the handler's error", err)
		}
		if _, _, ok := fx.invoice(fx.orderID); ok {
			t.Error("the invoice survived the failed delivery")
		}
		if n := fx.lines(fx.orderID); n != 0 {
			t.Errorf("lines after the failure: %d, want 0", n)
		}
		if n := fx.inboxRows(); n != 0 {
			t.Errorf("inbox rows after the failure: %d, want 0", n)
		}

		if !in.Deliver(t, msg) {
			t.Fatalf("redelivery nacked: %v", out.Last())
		}
		if amount, lines, ok := fx.invoice(fx.orderID); !ok || amount != 101 || lines != 2 {
			t.Errorf("invoice after the redelivery: found %t, amount %d, lines %d; want true, 101, 2", ok, amount, lines)
		}
		if n := fx.inboxRows(); n != 1 {
			t.Errorf("inbox rows after the redelivery: %d, want 1", n)
		}
	})
}

// client.Tx inside the handler is a savepoint in the inbox transaction: its
// Rollback undoes only its own writes (also after a duplicate key, which on
// PostgreSQL aborts the transaction until the rollback to the savepoint),
// its Commit keeps them for the inbox's commit, and a second end is
// sql.ErrTxDone. BeginTx with an isolation level is refused.
func TestDriver_client_Tx_is_a_savepoint(t *testing.T) {
	forEachDB(t, func(t *testing.T, fx *fixture) {
		in, out := fx.router(true, func(msg *message.Message) error {
			ctx := msg.Context()
			client, err := fx.clientFor(msg)
			if err != nil {
				return err
			}
			id := msg.Metadata.Get("order_id")
			if err := issue(ctx, client, id); err != nil {
				return err
			}

			tx, err := client.Tx(ctx)
			if err != nil {
				return fmt.Errorf("client.Tx: %w", err)
			}
			if err := issue(ctx, tx.Client(), id+"-rolled-back"); err != nil {
				return err
			}
			if err := tx.Invoice.Create().SetOrderID(id).SetAmount(1).Exec(ctx); err == nil {
				return errors.New("a duplicate order id was created")
			}
			if err := tx.Rollback(); err != nil {
				return fmt.Errorf("rollback: %w", err)
			}
			if err := tx.Rollback(); !errors.Is(err, sql.ErrTxDone) {
				return fmt.Errorf("second rollback: %v, want sql.ErrTxDone", err)
			}

			tx, err = client.Tx(ctx)
			if err != nil {
				return fmt.Errorf("client.Tx: %w", err)
			}
			if err := issue(ctx, tx.Client(), id+"-committed"); err != nil {
				return err
			}
			if err := tx.Commit(); err != nil {
				return fmt.Errorf("commit: %w", err)
			}

			if _, err := client.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelSerializable}); err == nil {
				return errors.New("BeginTx with an isolation level succeeded")
			}
			return issue(ctx, client, id+"-after")
		})

		if !in.Deliver(t, testrouter.Order(fx.orderID)) {
			t.Fatalf("nacked: %v", out.Last())
		}
		want := map[string]bool{fx.orderID: true, fx.orderID + "-rolled-back": false, fx.orderID + "-committed": true, fx.orderID + "-after": true}
		for oid, present := range want {
			amount, lines, ok := fx.invoice(oid)
			if ok != present || present && (amount != 101 || lines != 2) {
				t.Errorf("%s: found %t, amount %d, lines %d; want found %t, 101, 2", oid, ok, amount, lines, present)
			}
		}
		if n := fx.lines(fx.orderID + "-rolled-back"); n != 0 {
			t.Errorf("lines of the rolled-back savepoint: %d, want 0", n)
		}
		if n := fx.inboxRows(); n != 1 {
			t.Errorf("inbox rows: %d, want 1", n)
		}
	})
}

// While a client.Tx is open, the client itself refuses statements and
// transactions with ErrTxOpen, and what it wrote before and after stays: a
// client write made while the Tx was open returned nil and was then undone
// by the Tx's Rollback (the savepoint holds every statement after it),
// where on a pool it would have been kept.
func TestDriver_client_refuses_statements_while_its_Tx_is_open(t *testing.T) {
	forEachDB(t, func(t *testing.T, fx *fixture) {
		in, out := fx.router(true, func(msg *message.Message) error {
			ctx := msg.Context()
			client, err := fx.clientFor(msg)
			if err != nil {
				return err
			}
			id := msg.Metadata.Get("order_id")
			inv, err := client.Invoice.Create().SetOrderID(id).SetAmount(100).Save(ctx)
			if err != nil {
				return err
			}
			tx, err := client.Tx(ctx)
			if err != nil {
				return fmt.Errorf("client.Tx: %w", err)
			}
			if err := client.Invoice.UpdateOneID(inv.ID).AddAmount(1).Exec(ctx); !errors.Is(err, entinbox.ErrTxOpen) {
				return fmt.Errorf("update on the client while its Tx is open: %v, want ErrTxOpen", err)
			}
			if _, err := client.Tx(ctx); !errors.Is(err, entinbox.ErrTxOpen) {
				return fmt.Errorf("a second client.Tx while one is open: %v, want ErrTxOpen", err)
			}
			if err := tx.Invoice.UpdateOneID(inv.ID).AddAmount(10).Exec(ctx); err != nil {
				return err
			}
			if err := tx.Rollback(); err != nil { // a business failure the handler handles
				return err
			}
			return client.Invoice.UpdateOneID(inv.ID).AddAmount(1).Exec(ctx)
		})
		if !in.Deliver(t, testrouter.Order(fx.orderID)) {
			t.Fatalf("nacked: %v", out.Last())
		}
		if amount, _, ok := fx.invoice(fx.orderID); !ok || amount != 101 {
			t.Errorf("invoice: found %t, amount %d; want 101 (the Tx's +10 undone, the client's +1 after it kept)", ok, amount)
		}
	})
}

// A client.Tx whose context ends is rolled back by its Rollback, and by its
// Commit (which returns the context's error), as database/sql rolls back a
// transaction whose context ended: its writes were kept and committed with
// the inbox row, the statements that undo them cancelled with the context.
func TestDriver_client_Tx_whose_context_ended_rolls_back(t *testing.T) {
	forEachDB(t, func(t *testing.T, fx *fixture) {
		in, out := fx.router(true, func(msg *message.Message) error {
			client, err := fx.clientFor(msg)
			if err != nil {
				return err
			}
			id := msg.Metadata.Get("order_id")
			inv, err := client.Invoice.Create().SetOrderID(id).SetAmount(100).Save(msg.Context())
			if err != nil {
				return err
			}
			for _, end := range []string{"rollback", "commit"} {
				ctx, cancel := context.WithCancel(msg.Context())
				tx, err := client.Tx(ctx)
				if err != nil {
					cancel()
					return err
				}
				if err := tx.Invoice.UpdateOneID(inv.ID).AddAmount(5000).Exec(ctx); err != nil {
					cancel()
					return err
				}
				cancel()
				if end == "rollback" {
					err = tx.Rollback()
				} else if err = tx.Commit(); errors.Is(err, context.Canceled) {
					err = nil
				} else {
					err = fmt.Errorf("commit after the context ended: %v, want context.Canceled", err)
				}
				if err != nil {
					return fmt.Errorf("%s: %w", end, err)
				}
			}
			return nil
		})
		if !in.Deliver(t, testrouter.Order(fx.orderID)) {
			t.Fatalf("nacked: %v", out.Last())
		}
		if amount, _, ok := fx.invoice(fx.orderID); !ok || amount != 100 {
			t.Errorf("invoice: found %t, amount %d; want 100 (both +5000 undone)", ok, amount)
		}
	})
}

// A client.Tx behaves as database/sql's Tx once it ends: a statement
// through it after its Commit or Rollback returns sql.ErrTxDone and writes
// nothing (it ran, and committed with the inbox row), and the client takes
// statements again.
func TestDriver_client_Tx_ends_as_database_sql_s_does(t *testing.T) {
	forEachDB(t, func(t *testing.T, fx *fixture) {
		in, out := fx.router(true, func(msg *message.Message) error {
			client, err := fx.clientFor(msg)
			if err != nil {
				return err
			}
			id := msg.Metadata.Get("order_id")
			inv, err := client.Invoice.Create().SetOrderID(id).SetAmount(100).Save(msg.Context())
			if err != nil {
				return err
			}
			tx, err := client.Tx(msg.Context())
			if err != nil {
				return err
			}
			if err := tx.Rollback(); err != nil {
				return err
			}
			if err := tx.Invoice.UpdateOneID(inv.ID).AddAmount(1000).Exec(msg.Context()); !errors.Is(err, sql.ErrTxDone) {
				return fmt.Errorf("an update through the Tx after its Rollback: %v, want sql.ErrTxDone", err)
			}
			return client.Invoice.UpdateOneID(inv.ID).AddAmount(1).Exec(msg.Context())
		})
		if !in.Deliver(t, testrouter.Order(fx.orderID)) {
			t.Fatalf("nacked: %v", out.Last())
		}
		if amount, _, ok := fx.invoice(fx.orderID); !ok || amount != 101 {
			t.Errorf("invoice: found %t, amount %d; want 101 (+1000 refused, +1 kept)", ok, amount)
		}
	})
}

// Without the inbox middleware Driver refuses with an error wrapping
// inbox.ErrNoTx, and the handler writes nothing through the pool.
func TestDriver_refuses_without_the_inbox_middleware(t *testing.T) {
	forEachDB(t, func(t *testing.T, fx *fixture) {
		in, out := fx.router(false, func(msg *message.Message) error {
			client, err := fx.clientFor(msg)
			if err != nil {
				return err
			}
			return issue(msg.Context(), client, msg.Metadata.Get("order_id"))
		})

		if in.Deliver(t, testrouter.Order(fx.orderID)) {
			t.Fatal("acked without the inbox middleware")
		}
		if err := out.Last(); !errors.Is(err, inbox.ErrNoTx) {
			t.Errorf("router got %v, want an error wrapping inbox.ErrNoTx", err)
		}
		if _, _, ok := fx.invoice(fx.orderID); ok {
			t.Error("an invoice was written")
		}
		if n := fx.lines(fx.orderID); n != 0 {
			t.Errorf("lines: %d, want 0", n)
		}
	})
}

// Driver refuses a context that is not a message's, and a dialect other
// than ent's three SQL dialects.
func TestDriver_refuses_a_context_without_inbox_transaction_and_an_unknown_dialect(t *testing.T) {
	t.Parallel()
	if drv, err := entinbox.Driver(context.Background(), dialect.Postgres); !errors.Is(err, inbox.ErrNoTx) || drv != nil {
		t.Errorf("Driver(context.Background()) = %v, %v; want nil and an error wrapping inbox.ErrNoTx", drv, err)
	}
	if drv, err := entinbox.Driver(context.Background(), "pgx"); err == nil || drv != nil {
		t.Errorf(`Driver(ctx, "pgx") = %v, %v; want nil and an error`, drv, err)
	}
}

// A message claimed by pgxinbox carries a pgx.Tx, not a database/sql one:
// Client refuses with an error wrapping inbox.ErrNoTx that names
// pgxinbox, instead of writing through another connection.
func TestClient_refuses_a_message_claimed_by_pgxinbox(t *testing.T) {
	t.Parallel()
	pool := testdb.OpenPgxPool(t, "")
	table := "ent_pgx_inbox_" + testdb.RandomSuffix()
	db := pgxinbox.DB(pool)
	t.Cleanup(func() { db.Close() })
	testdb.DropLater(t, db, table)
	ib, err := pgxinbox.New(pgxinbox.Config{Pool: pool, Table: table})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ib.Close() })
	if err := ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	called := false
	in, out := testrouter.Run(t, func(msg *message.Message) error {
		client, err := entinbox.Client(msg.Context(), dialect.Postgres, newClient)
		called = client != nil
		return err
	}, ib.Middleware)
	if in.Deliver(t, testrouter.Order("pgx-1")) {
		t.Fatal("acked a message whose handler had no ent client")
	}
	if err := out.Last(); !errors.Is(err, inbox.ErrNoTx) || !strings.Contains(err.Error(), "pgxinbox") || called {
		t.Errorf("router got %v (client built: %v), want an error wrapping inbox.ErrNoTx that names pgxinbox", err, called)
	}
}

// Once the inbox has ended the message's transaction, Driver (and Client)
// refuse, with an error wrapping inbox.ErrNoTx and sql.ErrTxDone, instead of
// returning a driver whose every statement fails later: from an
// inbox.AfterCommit function and from a goroutine that outlived the handler
// (here the test's, after the ack). The message itself is processed.
func TestDriver_refuses_once_the_inbox_transaction_has_ended(t *testing.T) {
	forEachDB(t, func(t *testing.T, fx *fixture) {
		var afterCommitErr error
		var handlerCtx context.Context
		in, out := fx.router(true, func(msg *message.Message) error {
			ctx := msg.Context()
			handlerCtx = ctx
			client, err := fx.clientFor(msg)
			if err != nil {
				return err
			}
			if !inbox.AfterCommit(ctx, func() { _, afterCommitErr = entinbox.Client(ctx, fx.dialect, newClient) }) {
				return errors.New("AfterCommit refused in the handler")
			}
			return issue(ctx, client, msg.Metadata.Get("order_id"))
		})
		if !in.Deliver(t, testrouter.Order(fx.orderID)) {
			t.Fatalf("nacked: %v", out.Last())
		}
		if _, _, ok := fx.invoice(fx.orderID); !ok {
			t.Error("no invoice written")
		}
		drv, afterErr := entinbox.Driver(handlerCtx, fx.dialect)
		for name, err := range map[string]error{"in an AfterCommit function": afterCommitErr, "after the handler returned": afterErr} {
			if !errors.Is(err, inbox.ErrNoTx) || !errors.Is(err, sql.ErrTxDone) {
				t.Errorf("Driver %s: %v; want an error wrapping inbox.ErrNoTx and sql.ErrTxDone", name, err)
			}
		}
		if drv != nil {
			t.Errorf("Driver after the handler returned = %v; want nil", drv)
		}
	})
}
