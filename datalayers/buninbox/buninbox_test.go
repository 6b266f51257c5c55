package buninbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/uptrace/bun"
	"github.com/uptrace/bun/dialect/mysqldialect"
	"github.com/uptrace/bun/dialect/pgdialect"
	"github.com/uptrace/bun/dialect/sqlitedialect"
	"github.com/uptrace/bun/schema"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/datalayers/buninbox"
	"github.com/watermill-inbox/inbox/datalayers/internal/harness"
)

// invoice is the bun model of the tests' invoices table.
type invoice struct {
	bun.BaseModel `bun:"table:invoices"`
	OrderID       string `bun:"order_id,pk"`
	AmountCents   int64  `bun:"amount_cents,notnull"`
}

// dialects are bun's dialects for the test databases.
var dialects = map[harness.Kind]func() schema.Dialect{
	harness.PostgreSQL: func() schema.Dialect { return pgdialect.New() },
	harness.MariaDB:    func() schema.Dialect { return mysqldialect.New() },
	harness.SQLite:     func() schema.Dialect { return sqlitedialect.New() },
}

// openBun opens a fresh database of kind k and the application's bun.DB on
// its pool.
func openBun(t *testing.T, k harness.Kind) (*harness.Database, *bun.DB) {
	t.Helper()
	d := harness.Open(t, k)
	return d, bun.NewDB(d.DB.DB, dialects[k]())
}

// The bun handle keeps the contract (harness.Run) on every database: its
// writes are in the inbox transaction, and without one Tx refuses.
func TestBunInTheInboxTx(t *testing.T) {
	t.Parallel()
	for _, k := range []harness.Kind{harness.PostgreSQL, harness.MariaDB, harness.SQLite} {
		t.Run(string(k), func(t *testing.T) {
			t.Parallel()
			harness.Run(t, func(t *testing.T) harness.Env {
				d, db := openBun(t, k)
				return harness.Env{Inbox: d.Inbox(t), Write: writeInvoice(db), Count: d.Count}
			})
		})
	}
}

// writeInvoice is the handler body (harness.Env.Write): insert the
// message's invoice with a query builder, then read it back through the
// builder and through QueryRowContext, both on the inbox transaction.
func writeInvoice(db *bun.DB) func(*message.Message) error {
	return func(msg *message.Message) error {
		ctx := msg.Context()
		idb, err := buninbox.Tx(ctx, db)
		if err != nil {
			return err
		}
		id, amount, err := harness.Invoice(msg)
		if err != nil {
			return err
		}
		if _, err := idb.NewInsert().Model(&invoice{OrderID: id, AmountCents: amount}).Exec(ctx); err != nil {
			return err
		}
		var got invoice
		if err := idb.NewSelect().Model(&got).Where("order_id = ?", id).Scan(ctx); err != nil {
			return fmt.Errorf("select the invoice back: %w", err)
		}
		var raw int64
		if err := idb.QueryRowContext(ctx, "SELECT amount_cents FROM invoices WHERE order_id = ?", id).Scan(&raw); err != nil {
			return fmt.Errorf("query the invoice back: %w", err)
		}
		if got.AmountCents != amount || raw != amount {
			return fmt.Errorf("read back %d and %d, wrote %d", got.AmountCents, raw, amount)
		}
		return nil
	}
}

// BeginTx and RunInTx refuse with ErrNestedTx instead of beginning a
// transaction of their own on the pool; the handler's error rolls the
// message back.
func TestBunRefusesNestedTx(t *testing.T) {
	t.Parallel()
	d, db := openBun(t, harness.SQLite)
	var begin, run error
	ran := false
	h := d.Inbox(t)(func(msg *message.Message) ([]*message.Message, error) {
		idb, err := buninbox.Tx(msg.Context(), db)
		if err != nil {
			return nil, err
		}
		_, begin = idb.BeginTx(msg.Context(), nil)
		run = idb.RunInTx(msg.Context(), nil, func(ctx context.Context, tx bun.Tx) error {
			ran = true
			_, err := tx.NewInsert().Model(&invoice{OrderID: "nested", AmountCents: 1}).Exec(ctx)
			return err
		})
		return nil, errors.Join(begin, run)
	})
	feed := harness.RunRouter(t, h)
	if feed.Deliver(t, harness.NewMessage(1250)) {
		t.Fatal("acked")
	}
	if !errors.Is(begin, buninbox.ErrNestedTx) || !errors.Is(run, buninbox.ErrNestedTx) {
		t.Fatalf("BeginTx: %v; RunInTx: %v; want ErrNestedTx from both", begin, run)
	}
	if ran {
		t.Error("RunInTx ran its function")
	}
	if n := d.Count(t, "invoices"); n != 0 {
		t.Errorf("%d invoices written", n)
	}
}

// The application's query hooks see the builders' queries on the handle,
// as they see a bun.Tx's.
func TestBunQueryHooksSeeTheBuilders(t *testing.T) {
	t.Parallel()
	d, plain := openBun(t, harness.SQLite)
	hook := &queryLog{}
	db := plain.WithQueryHook(hook)
	feed := harness.RunRouter(t, d.Inbox(t)(func(msg *message.Message) ([]*message.Message, error) {
		return nil, writeInvoice(db)(msg)
	}))
	msg := harness.NewMessage(1250)
	if !feed.Deliver(t, msg) {
		t.Fatal("nacked")
	}
	got := hook.all()
	if len(got) != 2 || !strings.HasPrefix(got[0], "INSERT INTO") || !strings.Contains(got[0], msg.UUID) ||
		!strings.HasPrefix(got[1], "SELECT") {
		t.Fatalf("the hook saw %q, want the INSERT and the SELECT of the builders (not the QueryRowContext)", got)
	}
}

// Under a pgxinbox.Inbox the message's transaction is a pgx.Tx, which bun
// (database/sql only) cannot use: Tx refuses with an error that wraps
// inbox.ErrNoTx and names pgxinbox.
func TestBunRefusesPgxInbox(t *testing.T) {
	t.Parallel()
	d, db := openBun(t, harness.PostgreSQL)
	var got error
	feed := harness.RunRouter(t, harness.PgxInbox(t, d.PgxPool(t))(func(msg *message.Message) ([]*message.Message, error) {
		got = writeInvoice(db)(msg)
		return nil, got
	}))
	if feed.Deliver(t, harness.NewMessage(1250)) {
		t.Fatal("acked")
	}
	if !errors.Is(got, inbox.ErrNoTx) || !strings.Contains(got.Error(), "pgxinbox") {
		t.Fatalf("got %v, want an error that wraps inbox.ErrNoTx and names pgxinbox", got)
	}
	t.Logf("the refusal: %v", got)
	if n := d.Count(t, "invoices"); n != 0 {
		t.Errorf("%d invoices written", n)
	}
}

// queryLog is a bun.QueryHook that records each query it sees.
type queryLog struct {
	mu      sync.Mutex
	queries []string
}

func (l *queryLog) BeforeQuery(ctx context.Context, _ *bun.QueryEvent) context.Context { return ctx }

func (l *queryLog) AfterQuery(_ context.Context, e *bun.QueryEvent) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.queries = append(l.queries, e.Query)
}

func (l *queryLog) all() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.queries...)
}

// Once the inbox has ended the message's transaction, Tx refuses with an
// error that wraps inbox.ErrNoTx and sql.ErrTxDone, on every database:
// from an inbox.AfterCommit function and from a goroutine that outlived
// the handler.
func TestBunRefusesOnceTheTransactionHasEnded(t *testing.T) {
	t.Parallel()
	for _, k := range []harness.Kind{harness.PostgreSQL, harness.MariaDB, harness.SQLite} {
		t.Run(string(k), func(t *testing.T) {
			t.Parallel()
			d, db := openBun(t, k)
			inAfterCommit, afterReturn := harness.WriteAfterTheTransactionEnded(t,
				harness.Env{Inbox: d.Inbox(t), Write: writeInvoice(db), Count: d.Count})
			for name, err := range map[string]error{"in an AfterCommit function": inAfterCommit, "after the handler returned": afterReturn} {
				if !errors.Is(err, inbox.ErrNoTx) || !errors.Is(err, sql.ErrTxDone) {
					t.Errorf("%s: %v; want an error that wraps inbox.ErrNoTx and sql.ErrTxDone", name, err)
				}
			}
		})
	}
}
