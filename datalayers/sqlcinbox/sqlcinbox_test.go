package sqlcinbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/datalayers/internal/harness"
	"github.com/watermill-inbox/inbox/datalayers/internal/invoices/invoicesmysql"
	"github.com/watermill-inbox/inbox/datalayers/internal/invoices/invoicespg"
	"github.com/watermill-inbox/inbox/datalayers/internal/invoices/invoicespgx"
	"github.com/watermill-inbox/inbox/datalayers/internal/invoices/invoicessqlite"
	"github.com/watermill-inbox/inbox/datalayers/sqlcinbox"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// Each binding form, on each database and driver sqlc generates for, keeps
// the contract (harness.Run): the generated queries write in the inbox
// transaction, and refuse when there is none.
func TestGeneratedQueriesInTheInboxTx(t *testing.T) {
	t.Parallel()
	onSQL := func(k harness.Kind, write func(*message.Message) error) func(t *testing.T) harness.Env {
		return func(t *testing.T) harness.Env {
			d := harness.Open(t, k)
			return harness.Env{Inbox: d.Inbox(t), Write: write, Count: d.Count}
		}
	}
	onPgx := func(write func(*message.Message) error) func(t *testing.T) harness.Env {
		return func(t *testing.T) harness.Env {
			d := harness.Open(t, harness.PostgreSQL)
			return harness.Env{Inbox: harness.PgxInbox(t, d.PgxPool(t)), Write: write, Count: d.Count}
		}
	}
	subjects := []struct {
		name string
		open func(t *testing.T) harness.Env
	}{
		{"postgres/database-sql/New(tx)", onSQL(harness.PostgreSQL, writePG(pgFromTx))},
		{"postgres/database-sql/Queries", onSQL(harness.PostgreSQL, writePG(pgFromHelper))},
		{"postgres/pgx/New(tx)", onPgx(writePgx(pgxFromTx))},
		{"postgres/pgx/Queries", onPgx(writePgx(pgxFromHelper))},
		{"mariadb/New(tx)", onSQL(harness.MariaDB, writeMySQL(mysqlFromTx))},
		{"mariadb/Queries", onSQL(harness.MariaDB, writeMySQL(mysqlFromHelper))},
		{"sqlite/New(tx)", onSQL(harness.SQLite, writeSQLite(sqliteFromTx))},
		{"sqlite/Queries", onSQL(harness.SQLite, writeSQLite(sqliteFromHelper))},
	}
	for _, s := range subjects {
		t.Run(s.name, func(t *testing.T) {
			t.Parallel()
			harness.Run(t, s.open)
		})
	}
}

// Queries refuses code generated for the other driver, before any
// statement: pgx code under a database/sql inbox and database/sql code under
// a pgxinbox. The error wraps inbox.ErrNoTx and names the fix.
func TestQueriesRefusesTheOtherDriversCode(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name  string
		inbox func(t *testing.T, d *harness.Database) message.HandlerMiddleware
		write func(*message.Message) error
		want  string
	}{
		{
			name:  "pgx code, database/sql inbox",
			inbox: func(t *testing.T, d *harness.Database) message.HandlerMiddleware { return d.Inbox(t) },
			write: writePgx(pgxFromHelper),
			want:  "sql_package database/sql",
		},
		{
			name: "database/sql code, pgx inbox",
			inbox: func(t *testing.T, d *harness.Database) message.HandlerMiddleware {
				return harness.PgxInbox(t, d.PgxPool(t))
			},
			write: writePG(pgFromHelper),
			want:  "sql_package pgx/v5",
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			d := harness.Open(t, harness.PostgreSQL)
			var got error
			h := c.inbox(t, d)(func(msg *message.Message) ([]*message.Message, error) {
				got = c.write(msg)
				return nil, got
			})
			feed := harness.RunRouter(t, h)
			if feed.Deliver(t, harness.NewMessage(1250)) {
				t.Fatal("acked")
			}
			if !errors.Is(got, inbox.ErrNoTx) || !strings.Contains(got.Error(), c.want) {
				t.Fatalf("got %v, want an error that wraps inbox.ErrNoTx and says %q", got, c.want)
			}
			t.Logf("the refusal: %v", got)
			if n := d.Count(t, "invoices"); n != 0 {
				t.Fatalf("%d invoices written", n)
			}
		})
	}
}

// The two ways a handler gets the generated queries: New on the inbox
// transaction it takes from the context itself, or sqlcinbox.Queries.

func pgFromTx(ctx context.Context) (*invoicespg.Queries, error) {
	tx, ok := inbox.TxFromContext(ctx)
	if !ok {
		return nil, inbox.MissingTxError(ctx)
	}
	return invoicespg.New(tx), nil
}

func pgFromHelper(ctx context.Context) (*invoicespg.Queries, error) {
	return sqlcinbox.Queries(ctx, invoicespg.New)
}

func pgxFromTx(ctx context.Context) (*invoicespgx.Queries, error) {
	tx, ok := pgxinbox.TxFromContext(ctx)
	if !ok {
		return nil, pgxinbox.MissingTxError(ctx)
	}
	return invoicespgx.New(tx), nil
}

func pgxFromHelper(ctx context.Context) (*invoicespgx.Queries, error) {
	return sqlcinbox.Queries(ctx, invoicespgx.New)
}

func mysqlFromTx(ctx context.Context) (*invoicesmysql.Queries, error) {
	tx, ok := inbox.TxFromContext(ctx)
	if !ok {
		return nil, inbox.MissingTxError(ctx)
	}
	return invoicesmysql.New(tx), nil
}

func mysqlFromHelper(ctx context.Context) (*invoicesmysql.Queries, error) {
	return sqlcinbox.Queries(ctx, invoicesmysql.New)
}

func sqliteFromTx(ctx context.Context) (*invoicessqlite.Queries, error) {
	tx, ok := inbox.TxFromContext(ctx)
	if !ok {
		return nil, inbox.MissingTxError(ctx)
	}
	return invoicessqlite.New(tx), nil
}

func sqliteFromHelper(ctx context.Context) (*invoicessqlite.Queries, error) {
	return sqlcinbox.Queries(ctx, invoicessqlite.New)
}

// The handler bodies (harness.Env.Write), one per generated package: write
// the message's invoice, then read it back through the same queries.

func writePG(queries func(context.Context) (*invoicespg.Queries, error)) func(*message.Message) error {
	return func(msg *message.Message) error {
		ctx := msg.Context()
		q, err := queries(ctx)
		if err != nil {
			return err
		}
		id, amount, err := harness.Invoice(msg)
		if err != nil {
			return err
		}
		if err := q.CreateInvoice(ctx, invoicespg.CreateInvoiceParams{OrderID: id, AmountCents: amount}); err != nil {
			return err
		}
		got, err := q.GetInvoice(ctx, id)
		return readBack(err, got.AmountCents, amount)
	}
}

func writePgx(queries func(context.Context) (*invoicespgx.Queries, error)) func(*message.Message) error {
	return func(msg *message.Message) error {
		ctx := msg.Context()
		q, err := queries(ctx)
		if err != nil {
			return err
		}
		id, amount, err := harness.Invoice(msg)
		if err != nil {
			return err
		}
		if err := q.CreateInvoice(ctx, invoicespgx.CreateInvoiceParams{OrderID: id, AmountCents: amount}); err != nil {
			return err
		}
		got, err := q.GetInvoice(ctx, id)
		return readBack(err, got.AmountCents, amount)
	}
}

func writeMySQL(queries func(context.Context) (*invoicesmysql.Queries, error)) func(*message.Message) error {
	return func(msg *message.Message) error {
		ctx := msg.Context()
		q, err := queries(ctx)
		if err != nil {
			return err
		}
		id, amount, err := harness.Invoice(msg)
		if err != nil {
			return err
		}
		if err := q.CreateInvoice(ctx, invoicesmysql.CreateInvoiceParams{OrderID: id, AmountCents: amount}); err != nil {
			return err
		}
		got, err := q.GetInvoice(ctx, id)
		return readBack(err, got.AmountCents, amount)
	}
}

func writeSQLite(queries func(context.Context) (*invoicessqlite.Queries, error)) func(*message.Message) error {
	return func(msg *message.Message) error {
		ctx := msg.Context()
		q, err := queries(ctx)
		if err != nil {
			return err
		}
		id, amount, err := harness.Invoice(msg)
		if err != nil {
			return err
		}
		if err := q.CreateInvoice(ctx, invoicessqlite.CreateInvoiceParams{OrderID: id, AmountCents: amount}); err != nil {
			return err
		}
		got, err := q.GetInvoice(ctx, id)
		return readBack(err, got.AmountCents, amount)
	}
}

// readBack checks the invoice a handler read back after writing it.
func readBack(err error, got, want int64) error {
	if err != nil {
		return fmt.Errorf("read the invoice back in the inbox transaction: %w", err)
	}
	if got != want {
		return fmt.Errorf("read back amount %d, wrote %d", got, want)
	}
	return nil
}

// Once the inbox has ended the message's transaction, Queries refuses with
// an error that wraps inbox.ErrNoTx and what the transaction's statements
// would fail with (sql.ErrTxDone, pgx.ErrTxClosed): from an
// inbox.AfterCommit function and from a goroutine that outlived the
// handler.
func TestQueriesRefusesOnceTheTransactionHasEnded(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name  string
		kind  harness.Kind
		pgx   bool
		write func(*message.Message) error
		done  error
	}{
		{"postgres/database-sql", harness.PostgreSQL, false, writePG(pgFromHelper), sql.ErrTxDone},
		{"postgres/pgx", harness.PostgreSQL, true, writePgx(pgxFromHelper), pgx.ErrTxClosed},
		{"mariadb", harness.MariaDB, false, writeMySQL(mysqlFromHelper), sql.ErrTxDone},
		{"sqlite", harness.SQLite, false, writeSQLite(sqliteFromHelper), sql.ErrTxDone},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			d := harness.Open(t, c.kind)
			mw := d.Inbox(t)
			if c.pgx {
				mw = harness.PgxInbox(t, d.PgxPool(t))
			}
			inAfterCommit, afterReturn := harness.WriteAfterTheTransactionEnded(t, harness.Env{Inbox: mw, Write: c.write, Count: d.Count})
			for name, err := range map[string]error{"in an AfterCommit function": inAfterCommit, "after the handler returned": afterReturn} {
				if !errors.Is(err, inbox.ErrNoTx) || !errors.Is(err, c.done) {
					t.Errorf("%s: %v; want an error that wraps inbox.ErrNoTx and %v", name, err, c.done)
				}
			}
		})
	}
}
