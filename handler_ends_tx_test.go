package inbox_test

import (
	"context"
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A handler that ends the inbox transaction itself (a COMMIT or ROLLBACK
// statement through it, database/sql's tx.Commit or tx.Rollback, on
// MySQL/MariaDB a statement that commits implicitly) and returns nil is
// nacked, never acked: its writes and the inbox row were not committed
// together by the inbox. The error wraps ErrTransactionEnded and is not
// transient. Rows: what the handler itself committed stays (business row and
// inbox row together), what it rolled back is gone. On MySQL/MariaDB and
// SQLite a ROLLBACK statement removes the inbox row and cannot be told from
// a rollback the database made itself after an error the handler ignored
// (a deadlock; a full disk): ErrTxRolledBack.
func TestHandlerEndsTransaction_IsNackedWithErrTransactionEnded(t *testing.T) {
	t.Parallel()
	dbs := append([]testDB{{Name: "postgres-libpq", Dialect: inbox.PostgreSQL, Open: func(tb testing.TB) *sqlx.DB {
		return testdb.OpenPostgresWith(tb, "postgres", "")
	}}, {Name: "postgres-otelsql", Dialect: inbox.PostgreSQL, Open: func(tb testing.TB) *sqlx.DB {
		// pgx wrapped by an instrumentation driver (XSAM/otelsql), as
		// services that trace their SQL run it.
		return sqlx.NewDb(testdb.OpenPostgresWith(tb, otelsqlPgx(tb), "").DB, "pgx")
	}}, {Name: "postgres-hidden-conn", Dialect: inbox.PostgreSQL, Open: func(tb testing.TB) *sqlx.DB {
		// pgx wrapped as ngrok/sqlmw and instrumentedsql wrap it: the
		// connection unexported, its transaction status out of reach.
		return sqlx.NewDb(testdb.OpenPostgresWith(tb, hiddenConnPgx(), "").DB, "pgx")
	}}, {Name: "mysql-otelsql", Dialect: inbox.MySQL, Open: func(tb testing.TB) *sqlx.DB {
		return sqlx.NewDb(testdb.OpenMySQLWith(tb, otelsqlMySQL(tb), "").DB, "mysql")
	}}}, testDBs...)
	for _, tdb := range dbs {
		t.Run(tdb.Name, func(t *testing.T) {
			t.Parallel()
			db := tdb.Open(t)
			dialectOf.Store(db, tdb.Dialect)
			mysqlDB := tdb.Dialect == inbox.MySQL
			cases := []struct {
				name           string
				end            func(ctx context.Context, tx *sqlx.Tx, f *fixture) error
				committed      bool // the handler's own end committed its row and the inbox row
				mysqlRolledBak bool // on MySQL/MariaDB and SQLite: reported as ErrTxRolledBack
			}{
				{name: "ROLLBACK statement", end: func(ctx context.Context, tx *sqlx.Tx, _ *fixture) error {
					_, err := tx.ExecContext(ctx, "ROLLBACK")
					return err
				}, mysqlRolledBak: true},
				{name: "COMMIT statement", committed: true, end: func(ctx context.Context, tx *sqlx.Tx, _ *fixture) error {
					_, err := tx.ExecContext(ctx, "COMMIT")
					return err
				}},
				{name: "tx.Commit", committed: true, end: func(_ context.Context, tx *sqlx.Tx, _ *fixture) error {
					return tx.Commit()
				}},
				{name: "tx.Rollback", end: func(_ context.Context, tx *sqlx.Tx, _ *fixture) error {
					return tx.Rollback()
				}},
			}
			if mysqlDB {
				cases = append(cases, struct {
					name           string
					end            func(ctx context.Context, tx *sqlx.Tx, f *fixture) error
					committed      bool
					mysqlRolledBak bool
				}{name: "implicit commit (CREATE TABLE)", committed: true, end: func(ctx context.Context, tx *sqlx.Tx, f *fixture) error {
					table := "implicit_" + randomSuffix()
					dropLater(f.t, f.db, table)
					_, err := tx.ExecContext(ctx, "CREATE TABLE "+table+" (id int)")
					return err
				}})
			}
			for _, c := range cases {
				t.Run(c.name, func(t *testing.T) {
					t.Parallel()
					f := newFixture(t, db)
					var hooks hookCounts
					ib := f.newInbox(hooks.config(inbox.Config{}))
					out := &outcomes{}
					in := newFeed()
					runRouter(t, func(r *message.Router) {
						r.AddMiddleware(out.Middleware, ib.Middleware)
						r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
							if err := f.writeBusinessRow(msg); err != nil {
								return err
							}
							tx, _ := inbox.TxFromContext(msg.Context())
							if err := c.end(msg.Context(), tx, f); err != nil {
								t.Errorf("the handler's %s: %v", c.name, err)
							}
							return nil
						})
					})
					ctx, cancel := context.WithTimeout(context.Background(), caseTimeout)
					defer cancel()
					msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
					acked, err := in.send(ctx, delivery(msg, "first"))
					if err != nil {
						t.Fatal(err)
					}
					got := out.last("first")
					if acked {
						t.Fatalf("acked a message whose handler ended the transaction itself (router got %v)", got)
					}
					want := inbox.ErrTransactionEnded
					if (mysqlDB || tdb.Dialect == inbox.SQLite) && c.mysqlRolledBak {
						want = inbox.ErrTxRolledBack
					}
					if !errors.Is(got, want) {
						t.Errorf("router got %v, want an error wrapping %v", got, want)
					}
					if errors.Is(got, inbox.ErrTransactionEnded) && inbox.IsTransient(got) {
						t.Errorf("IsTransient(%v) = true, want false: the handler ends the transaction again on a redelivery", got)
					}
					if hooks.processed.Load() != 0 || hooks.failed.Load() != 1 {
						t.Errorf("OnProcessed %d, OnFailed %d; want 0 and 1", hooks.processed.Load(), hooks.failed.Load())
					}
					want01 := 0
					if c.committed {
						want01 = 1
					}
					if f.businessRows() != want01 || f.inboxRows() != want01 {
						t.Errorf("business rows %d, inbox rows %d; want %d and %d", f.businessRows(), f.inboxRows(), want01, want01)
					}
				})
			}
		})
	}
}
