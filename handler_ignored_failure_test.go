package inbox_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// On PostgreSQL a handler that ignores a failed statement (a "duplicate key
// is fine" pattern) and returns nil has its transaction aborted: the COMMIT
// rolls it back, or an output's outbox INSERT fails with 25P02. The error
// that reaches the router names that cause and the fix; it said only
// "commit unexpectedly resulted in rollback", or blamed the outbox. It still
// matches the driver's error, nothing is written, and the redelivery runs
// the handler again.
func TestHandlerThatIgnoresAFailedStatementIsToldWhy(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if !isPostgres(tdb.Dialect) {
			t.Skip("only PostgreSQL aborts a transaction after a failed statement")
		}
		for _, output := range []bool{false, true} {
			t.Run(map[bool]string{false: "no-output", true: "output"}[output], func(t *testing.T) {
				f := newFixture(t, db)
				ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: newBrokerStub(), PollInterval: time.Hour})
				ib := f.newInbox(inbox.Config{Outbox: ob.Publisher})
				rec := &recorder{}
				in := newFeed()
				runRouter(t, func(r *message.Router) {
					r.AddMiddleware(rec.Middleware, ib.Middleware)
					r.AddHandler("billing", "orders", in, "invoices", nil, func(msg *message.Message) ([]*message.Message, error) {
						tx, _ := inbox.TxFromContext(msg.Context())
						// The mistake: the error of a failed statement ignored.
						_, _ = tx.ExecContext(msg.Context(), "INSERT INTO "+f.business+" (id, consumer) VALUES ($1, NULL)", msg.UUID)
						if output {
							return []*message.Message{message.NewMessage(msg.UUID+"-invoice", nil)}, nil
						}
						return nil, nil
					})
				})
				if in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
					t.Fatal("acked a message whose transaction PostgreSQL aborted")
				}
				err := rec.last()
				if !strings.Contains(err.Error(), "a statement of the handler failed and the handler returned nil without its error") {
					t.Errorf("router got %q, want the hint that the handler ignored a failed statement", err)
				}
				if !output && !errors.Is(err, pgx.ErrTxCommitRollback) {
					t.Errorf("router got %v, want it to match pgx.ErrTxCommitRollback still", err)
				}
				if b, i, o := f.businessRows(), f.inboxRows(), count(t, db, ob.Table(), ""); b != 0 || i != 0 || o != 0 {
					t.Errorf("%d business rows, %d inbox rows, %d outputs; want none", b, i, o)
				}
			})
		}
	})
}

// A handler that recovered from its failed statement (ROLLBACK TO
// SAVEPOINT), after an outbox publish while its transaction was failed
// (whose error it ignored: another goroutine's, say), and whose COMMIT then
// fails for a reason of its own (a deferred foreign key) is not told that it
// ignored a failed statement: the hint went by the first failed status the
// inbox had seen, not by the transaction's state at the COMMIT.
func TestHandlerThatRecoveredWithASavepointIsNotBlamedForTheCommitsFailure(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if !isPostgres(tdb.Dialect) {
			t.Skip("only PostgreSQL aborts a transaction after a failed statement")
		}
		f := newFixture(t, db)
		sfx := randomSuffix()
		parent, child := "parent_"+sfx, "child_"+sfx
		exec(t, db, "CREATE TABLE "+parent+" (id int PRIMARY KEY)")
		dropLater(t, db, parent)
		exec(t, db, "CREATE TABLE "+child+" (id int PRIMARY KEY, ref int REFERENCES "+parent+"(id) DEFERRABLE INITIALLY DEFERRED)")
		dropLater(t, db, child)
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: newBrokerStub(), PollInterval: time.Hour})
		ib := f.newInbox(inbox.Config{Outbox: ob.Publisher})
		rec := &recorder{}
		in := newFeed()
		runRouter(t, func(r *message.Router) {
			r.AddMiddleware(rec.Middleware, ib.Middleware)
			r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
				ctx := msg.Context()
				tx, _ := inbox.TxFromContext(ctx)
				pub, _ := inbox.OutboxFromContext(ctx)
				if _, err := tx.ExecContext(ctx, "SAVEPOINT sp"); err != nil {
					return err
				}
				if _, err := tx.ExecContext(ctx, "INSERT INTO "+f.business+" (id, consumer) VALUES ($1, NULL)", msg.UUID); err == nil {
					return errors.New("the NOT NULL insert succeeded")
				}
				_ = pub.Publish("audit", message.NewMessage(watermill.NewUUID(), nil)) // refused: the transaction is failed
				if _, err := tx.ExecContext(ctx, "ROLLBACK TO SAVEPOINT sp"); err != nil {
					return err
				}
				if err := pub.Publish("audit", message.NewMessage(watermill.NewUUID(), nil)); err != nil {
					return err
				}
				_, err := tx.ExecContext(ctx, "INSERT INTO "+child+" (id, ref) VALUES (1, 999)") // fails at COMMIT
				return err
			})
		})
		if in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
			t.Fatal("acked a message whose COMMIT failed")
		}
		if err := rec.last(); strings.Contains(err.Error(), "a statement of the handler failed and the handler returned nil") {
			t.Errorf("COMMIT failed on a deferred foreign key after the handler recovered, and the error blames an ignored statement: %v", err)
		}
	})
}

// Through a driver wrapper that hides the driver connection (ngrok/sqlmw,
// instrumentedsql: no transaction status, so the inbox reads its claim
// before the COMMIT), a handler that ignored a failed statement is told
// why too: that read's 25P02 says the transaction failed, where the error
// was the bare "commit unexpectedly resulted in rollback".
func TestHandlerThatIgnoresAFailedStatementIsToldWhyThroughAWrappedDriver(t *testing.T) {
	db := sqlx.NewDb(testdb.OpenPostgresWith(t, hiddenConnPgx(), "").DB, "pgx")
	f := newFixture(t, db)
	ib := f.newInbox(inbox.Config{})
	rec := &recorder{}
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(rec.Middleware, ib.Middleware)
		r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
			tx, _ := inbox.TxFromContext(msg.Context())
			_, _ = tx.ExecContext(msg.Context(), "INSERT INTO "+f.business+" (id, consumer) VALUES ($1, NULL)", msg.UUID)
			return nil
		})
	})
	if in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
		t.Fatal("acked a message whose transaction PostgreSQL aborted")
	}
	if err := rec.last(); !strings.Contains(err.Error(), "a statement of the handler failed and the handler returned nil without its error") {
		t.Errorf("router got %q, want the hint that the handler ignored a failed statement", err)
	}
	if b, i := f.businessRows(), f.inboxRows(); b != 0 || i != 0 {
		t.Errorf("%d business rows, %d inbox rows; want none", b, i)
	}
}
