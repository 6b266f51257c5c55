package gorminbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"gorm.io/driver/postgres"
	"gorm.io/gorm"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/gorminbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/internal/testrouter"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

var errHandler = errors.New("handler failed after its GORM writes")

// forEachDB runs f as a parallel subtest on every database, each with a
// fixture (tables) of its own.
func forEachDB(t *testing.T, f func(t *testing.T, fx *fixture)) {
	t.Helper()
	for _, d := range databases() {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			f(t, newFixture(t, d))
		})
	}
}

// createInvoice creates, through the inbox session, the invoice of the
// message's order with two lines (an association saved with it); its hooks
// stamp it and write an audit row.
func createInvoice(db *gorm.DB, orderID string) error {
	return db.Create(&Invoice{OrderID: orderID, Amount: 100, Lines: []Line{{SKU: "a"}, {SKU: "b"}}}).Error
}

// A message is processed once: the invoice, its lines and the rows its hooks
// write commit with the inbox row; the duplicate is acked without calling
// the handler.
func TestDB_commits_gorm_writes_with_the_inbox_row_once(t *testing.T) {
	forEachDB(t, func(t *testing.T, fx *fixture) {
		var calls atomic.Int32
		in, out := fx.router(true, func(msg *message.Message) error {
			calls.Add(1)
			db, err := gorminbox.DB(msg.Context(), fx.gdb)
			if err != nil {
				return err
			}
			return createInvoice(db, msg.Metadata.Get("order_id"))
		})
		id := "order-" + testdb.RandomSuffix()
		msg := testrouter.Order(id)

		if !in.Deliver(t, msg) {
			t.Fatalf("first delivery nacked: %v", out.Last())
		}
		if !in.Deliver(t, msg) {
			t.Fatalf("duplicate nacked: %v", out.Last())
		}

		if n := calls.Load(); n != 1 {
			t.Errorf("handler calls: %d, want 1 (the duplicate is skipped)", n)
		}
		if inv, lines, audits := fx.invoices(id); inv != 1 || lines != 2 || audits != 1 {
			t.Errorf("invoices %d, lines %d, audit rows %d; want 1, 2, 1", inv, lines, audits)
		}
		var got Invoice
		if err := fx.gdb.Where("order_id = ?", id).First(&got).Error; err != nil {
			t.Fatal(err)
		}
		if got.Stamp != "before-create" {
			t.Errorf("stamp %q: the BeforeCreate hook did not run", got.Stamp)
		}
		if n := fx.inboxRows(); n != 1 {
			t.Errorf("inbox rows: %d, want 1", n)
		}
	})
}

// A handler error after GORM writes (a Create with its association and
// hooks, and a nested Transaction that succeeded) rolls them all back with
// the inbox row; the redelivery processes the message.
func TestDB_handler_error_rolls_back_gorm_writes_with_the_inbox_row(t *testing.T) {
	forEachDB(t, func(t *testing.T, fx *fixture) {
		var calls atomic.Int32
		in, out := fx.router(true, func(msg *message.Message) error {
			attempt := calls.Add(1)
			db, err := gorminbox.DB(msg.Context(), fx.gdb)
			if err != nil {
				return err
			}
			id := msg.Metadata.Get("order_id")
			if err := createInvoice(db, id); err != nil {
				return err
			}
			err = db.Transaction(func(tx *gorm.DB) error { return createInvoice(tx, id+"-nested") })
			if err != nil {
				return err
			}
			if attempt == 1 {
				return errHandler
			}
			return nil
		})
		id := "order-" + testdb.RandomSuffix()
		msg := testrouter.Order(id)

		if in.Deliver(t, msg) {
			t.Fatal("the failing delivery was acked")
		}
		if err := out.Last(); !errors.Is(err, errHandler) {
			t.Fatalf("router got %v, want the handler's error", err)
		}
		for _, oid := range []string{id, id + "-nested"} {
			if inv, lines, audits := fx.invoices(oid); inv+lines+audits != 0 {
				t.Errorf("%s after the failure: invoices %d, lines %d, audit rows %d; want none", oid, inv, lines, audits)
			}
		}
		if n := fx.inboxRows(); n != 0 {
			t.Errorf("inbox rows after the failure: %d, want 0", n)
		}

		if !in.Deliver(t, msg) {
			t.Fatalf("redelivery nacked: %v", out.Last())
		}
		for _, oid := range []string{id, id + "-nested"} {
			if inv, lines, audits := fx.invoices(oid); inv != 1 || lines != 2 || audits != 1 {
				t.Errorf("%s after the redelivery: invoices %d, lines %d, audit rows %d; want 1, 2, 1", oid, inv, lines, audits)
			}
		}
		if n := fx.inboxRows(); n != 1 {
			t.Errorf("inbox rows after the redelivery: %d, want 1", n)
		}
	})
}

// A Transaction inside the handler is a savepoint: when its function fails
// (here on a duplicate key, which on PostgreSQL aborts the transaction until
// the rollback to the savepoint), only its writes are undone; the handler
// goes on, and everything else commits with the inbox row. Also when the
// application's *gorm.DB has DisableNestedTransaction, which made GORM run
// the function with no savepoint: its writes committed although it failed
// (outside the inbox that Transaction is a transaction of its own).
func TestDB_nested_Transaction_rolls_back_to_its_savepoint(t *testing.T) {
	forEachDB(t, func(t *testing.T, fx *fixture) {
		for name, app := range map[string]*gorm.DB{
			"default":                  fx.gdb,
			"DisableNestedTransaction": fx.gdb.Session(&gorm.Session{DisableNestedTransaction: true}),
		} {
			t.Run(name, func(t *testing.T) { testNestedTransactionRollsBackToItsSavepoint(t, fx, app) })
		}
	})
}

func testNestedTransactionRollsBackToItsSavepoint(t *testing.T, fx *fixture, app *gorm.DB) {
	before := fx.inboxRows()
	{
		in, out := fx.router(true, func(msg *message.Message) error {
			db, err := gorminbox.DB(msg.Context(), app)
			if err != nil {
				return err
			}
			id := msg.Metadata.Get("order_id")
			if err := createInvoice(db, id); err != nil {
				return err
			}
			err = db.Transaction(func(tx *gorm.DB) error {
				if err := createInvoice(tx, id+"-inner"); err != nil {
					return err
				}
				return createInvoice(tx, id) // a duplicate order id: fails
			})
			if err == nil {
				return errors.New("the nested transaction's duplicate insert succeeded")
			}
			if err := createInvoice(db, id+"-after"); err != nil {
				return fmt.Errorf("write after the rolled-back savepoint: %w", err)
			}
			return db.Transaction(func(tx *gorm.DB) error { return createInvoice(tx, id+"-kept") })
		})
		id := "order-" + testdb.RandomSuffix()

		if !in.Deliver(t, testrouter.Order(id)) {
			t.Fatalf("nacked: %v", out.Last())
		}
		want := map[string]int64{id: 1, id + "-inner": 0, id + "-after": 1, id + "-kept": 1}
		for oid, n := range want {
			if inv, lines, audits := fx.invoices(oid); inv != n || lines != 2*n || audits != n {
				t.Errorf("%s: invoices %d, lines %d, audit rows %d; want %d, %d, %d", oid, inv, lines, audits, n, 2*n, n)
			}
		}
		if n := fx.inboxRows() - before; n != 1 {
			t.Errorf("inbox rows: %d more, want 1", n)
		}
	}
}

// The session cannot end the inbox transaction or reach the pool: Commit and
// Rollback refuse, Begin and DB() fail, and the message still commits as
// one transaction when the handler returns nil.
func TestDB_session_cannot_end_the_inbox_transaction(t *testing.T) {
	forEachDB(t, func(t *testing.T, fx *fixture) {
		in, out := fx.router(true, func(msg *message.Message) error {
			db, err := gorminbox.DB(msg.Context(), fx.gdb)
			if err != nil {
				return err
			}
			if err := createInvoice(db, msg.Metadata.Get("order_id")); err != nil {
				return err
			}
			session := func() *gorm.DB {
				db, _ := gorminbox.DB(msg.Context(), fx.gdb) // it did not fail above
				return db
			}
			// GORM keeps an error on the session it was added to: each check
			// takes a session of its own.
			if err := session().Commit().Error; !errors.Is(err, gorminbox.ErrTxOwnedByInbox) {
				return fmt.Errorf("Commit: %v, want ErrTxOwnedByInbox", err)
			}
			if err := session().Rollback().Error; !errors.Is(err, gorminbox.ErrTxOwnedByInbox) {
				return fmt.Errorf("Rollback: %v, want ErrTxOwnedByInbox", err)
			}
			if err := session().Begin().Error; !errors.Is(err, gorm.ErrInvalidTransaction) {
				return fmt.Errorf("Begin: %v, want gorm.ErrInvalidTransaction", err)
			}
			if _, err := session().DB(); !errors.Is(err, gorm.ErrInvalidDB) {
				return fmt.Errorf("DB(): %v, want gorm.ErrInvalidDB", err)
			}
			return nil
		})
		id := "order-" + testdb.RandomSuffix()

		if !in.Deliver(t, testrouter.Order(id)) {
			t.Fatalf("nacked: %v", out.Last())
		}
		if inv, lines, audits := fx.invoices(id); inv != 1 || lines != 2 || audits != 1 {
			t.Errorf("invoices %d, lines %d, audit rows %d; want 1, 2, 1", inv, lines, audits)
		}
		if n := fx.inboxRows(); n != 1 {
			t.Errorf("inbox rows: %d, want 1", n)
		}
	})
}

// Without the inbox middleware DB refuses with an error wrapping
// inbox.ErrNoTx, and the handler writes nothing through the pool.
func TestDB_refuses_without_the_inbox_middleware(t *testing.T) {
	forEachDB(t, func(t *testing.T, fx *fixture) {
		in, out := fx.router(false, func(msg *message.Message) error {
			db, err := gorminbox.DB(msg.Context(), fx.gdb)
			if err != nil {
				return err
			}
			return createInvoice(db, msg.Metadata.Get("order_id"))
		})
		id := "order-" + testdb.RandomSuffix()

		if in.Deliver(t, testrouter.Order(id)) {
			t.Fatal("acked without the inbox middleware")
		}
		if err := out.Last(); !errors.Is(err, inbox.ErrNoTx) {
			t.Errorf("router got %v, want an error wrapping inbox.ErrNoTx", err)
		}
		if inv, lines, audits := fx.invoices(id); inv+lines+audits != 0 {
			t.Errorf("invoices %d, lines %d, audit rows %d; want none", inv, lines, audits)
		}
	})
}

// DB refuses a context that is not a message's, and a nil *gorm.DB.
func TestDB_refuses_a_context_without_inbox_transaction_and_a_nil_db(t *testing.T) {
	t.Parallel()
	fx := newFixture(t, databases()[0])
	if db, err := gorminbox.DB(context.Background(), fx.gdb); !errors.Is(err, inbox.ErrNoTx) || db != nil {
		t.Errorf("DB(context.Background()) = %v, %v; want nil and an error wrapping inbox.ErrNoTx", db, err)
	}
	if db, err := gorminbox.DB(context.Background(), nil); err == nil || db != nil {
		t.Errorf("DB(nil) = %v, %v; want nil and an error", db, err)
	}
}

// A message claimed by pgxinbox carries a pgx.Tx, not a database/sql one:
// DB refuses with an error wrapping inbox.ErrNoTx that names pgxinbox,
// instead of writing through another connection.
func TestDB_refuses_a_message_claimed_by_pgxinbox(t *testing.T) {
	t.Parallel()
	pool := testdb.OpenPgxPool(t, "")
	table := "gorm_pgx_inbox_" + testdb.RandomSuffix()
	sqlDB := pgxinbox.DB(pool)
	t.Cleanup(func() { sqlDB.Close() })
	testdb.DropLater(t, sqlDB, table)
	gdb, err := gorm.Open(postgres.New(postgres.Config{Conn: sqlDB.DB}), &gorm.Config{})
	if err != nil {
		t.Fatal(err)
	}
	ib, err := pgxinbox.New(pgxinbox.Config{Pool: pool, Table: table})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ib.Close() })
	if err := ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	in, out := testrouter.Run(t, func(msg *message.Message) error {
		db, err := gorminbox.DB(msg.Context(), gdb)
		if db != nil {
			t.Error("DB returned a session for a pgxinbox message")
		}
		return err
	}, ib.Middleware)
	if in.Deliver(t, testrouter.Order("pgx-1")) {
		t.Fatal("acked a message whose handler had no GORM session")
	}
	if err := out.Last(); !errors.Is(err, inbox.ErrNoTx) || !strings.Contains(err.Error(), "pgxinbox") {
		t.Errorf("router got %v, want an error wrapping inbox.ErrNoTx that names pgxinbox", err)
	}
}

// Once the inbox has ended the message's transaction, DB refuses, with an
// error wrapping inbox.ErrNoTx and sql.ErrTxDone, instead of returning a
// session whose every statement fails later: from an inbox.AfterCommit
// function and from a goroutine that outlived the handler (here the test's,
// after the ack). The message itself is processed.
func TestDB_refuses_once_the_inbox_transaction_has_ended(t *testing.T) {
	forEachDB(t, func(t *testing.T, fx *fixture) {
		var afterCommitErr error
		var afterCommitDB *gorm.DB
		var handlerCtx context.Context
		in, out := fx.router(true, func(msg *message.Message) error {
			ctx := msg.Context()
			handlerCtx = ctx
			db, err := gorminbox.DB(ctx, fx.gdb)
			if err != nil {
				return err
			}
			if !inbox.AfterCommit(ctx, func() { afterCommitDB, afterCommitErr = gorminbox.DB(ctx, fx.gdb) }) {
				return errors.New("AfterCommit refused in the handler")
			}
			return createInvoice(db, msg.Metadata.Get("order_id"))
		})
		id := "order-" + testdb.RandomSuffix()
		if !in.Deliver(t, testrouter.Order(id)) {
			t.Fatalf("nacked: %v", out.Last())
		}
		if inv, _, _ := fx.invoices(id); inv != 1 {
			t.Errorf("invoices %d, want 1", inv)
		}
		for name, got := range map[string]struct {
			db  *gorm.DB
			err error
		}{
			"in an AfterCommit function": {afterCommitDB, afterCommitErr},
			"after the handler returned": func() (r struct {
				db  *gorm.DB
				err error
			}) {
				r.db, r.err = gorminbox.DB(handlerCtx, fx.gdb)
				return r
			}(),
		} {
			if got.db != nil || !errors.Is(got.err, inbox.ErrNoTx) || !errors.Is(got.err, sql.ErrTxDone) {
				t.Errorf("DB %s = %v, %v; want nil and an error wrapping inbox.ErrNoTx and sql.ErrTxDone", name, got.db, got.err)
			}
		}
	})
}
