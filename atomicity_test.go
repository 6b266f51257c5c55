package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/go-sql-driver/mysql"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// The inbox row and the handler's writes are kept together or not at all. The
// handler writes a business row and then fails, or the commit fails: nothing
// of either is kept and the message is nacked; after a redelivery there is
// exactly one of each. Inside the handler, the claim is checked to be on the
// handler's transaction.
//
// The handler's statement is a deadlock victim and the handler ignores the
// error. The database has rolled the whole transaction back, the inbox row
// with it. PostgreSQL then fails every statement and turns COMMIT into
// ROLLBACK; MySQL/MariaDB run the handler's later statements outside any
// transaction (autocommit: they are kept) and accept the COMMIT with nothing
// to commit. Either way the message must be nacked, never acked without its
// inbox row.
func TestAtomicity_InboxRowAndBusinessWritesCommitTogether(t *testing.T) {
	t.Parallel()
	for _, failure := range []string{"handler fails", "commit fails", "handler ignores a deadlock"} {
		t.Run(failure, func(t *testing.T) {
			t.Parallel()
			forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
				if failure == "handler ignores a deadlock" && tdb.Dialect == inbox.SQLite {
					t.Skip("one writer at a time: no deadlock")
				}
				f := newFixture(t, db)
				var hooks hookCounts
				ib := f.newInbox(hooks.config(inbox.Config{}))
				breakCommit := commitBreaker(t, tdb.Dialect, db)
				var victim func(*message.Message, *sqlx.Tx) error
				var ignored error
				if failure == "handler ignores a deadlock" {
					victim = deadlockVictim(t, tdb.Dialect, db)
				}
				var failing atomic.Bool
				failing.Store(true)
				out := &outcomes{}
				in := newFeed()
				runRouter(t, func(r *message.Router) {
					r.AddMiddleware(out.Middleware, ib.Middleware)
					r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
						if err := claimOnThisTx(msg, tdb.Dialect, db, f.inbox); err != nil {
							t.Errorf("delivery %s: %v", msg.Metadata.Get("delivery"), err)
						}
						if err := f.writeBusinessRow(msg); err != nil {
							return err
						}
						if !failing.Load() {
							return nil
						}
						tx, _ := inbox.TxFromContext(msg.Context())
						switch failure {
						case "handler fails":
							return errors.New("payment service unavailable")
						case "commit fails":
							return breakCommit(msg, tx)
						}
						// A sloppy handler: it ignores the errors of its statements.
						ignored = victim(msg, tx)
						_ = f.insertRow(msg, msg.UUID+":after the ignored error")
						return nil
					})
				})
				ctx, cancel := context.WithTimeout(context.Background(), caseTimeout)
				defer cancel()

				msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
				if acked, err := in.send(ctx, delivery(msg, "first")); err != nil || acked {
					t.Fatalf("failed delivery: acked %v (%v), want a nack (ignored error: %v)", acked, err, ignored)
				}
				t.Logf("first delivery: %v", out.last("first"))
				if failure != "handler fails" && hooks.failed.Load() != 1 {
					t.Errorf("OnFailed calls = %d, want 1", hooks.failed.Load())
				}
				afterRows := 0
				if failure == "handler ignores a deadlock" {
					var code string
					var myErr *mysql.MySQLError
					if errors.As(ignored, &myErr) {
						code = fmt.Sprint(myErr.Number)
					}
					if code != "1213" && sqlState(ignored) != "40P01" {
						t.Fatalf("the handler's statement failed with %v, want a deadlock", ignored)
					}
					if tdb.Dialect == inbox.MySQL {
						if err := out.last("first"); !errors.Is(err, inbox.ErrTxRolledBack) || !inbox.IsTransient(err) {
							t.Errorf("nacked with %v, want ErrTxRolledBack (transient)", err)
						}
						afterRows = 1 // autocommitted: writes after an ignored deadlock are not the inbox's
					}
				}
				if f.businessRows() != afterRows || f.inboxRows() != 0 {
					t.Fatalf("after the failure: business rows %d, inbox rows %d, want %d and 0", f.businessRows(), f.inboxRows(), afterRows)
				}
				failing.Store(false)
				for _, label := range []string{"redelivery", "second redelivery"} {
					if acked, err := in.send(ctx, delivery(msg, label)); err != nil || !acked {
						t.Fatalf("%s: acked %v (%v), last error %v", label, acked, err, out.last(label))
					}
				}
				if f.businessRows() != afterRows+1 || f.inboxRows() != 1 || hooks.processed.Load() != 1 || hooks.duplicates.Load() != 1 {
					t.Errorf("after redeliveries: business rows %d, inbox rows %d, commits %d, duplicates %d; want %d, 1, 1, 1",
						f.businessRows(), f.inboxRows(), hooks.processed.Load(), hooks.duplicates.Load(), afterRows+1)
				}
			})
		})
	}
}

// claimOnThisTx checks, from inside the handler, that the message's inbox
// row was written by the handler's own transaction: visible through it,
// invisible from another connection (it is not committed yet), and on
// PostgreSQL stamped with this transaction's id.
func claimOnThisTx(msg *message.Message, d inbox.Dialect, db *sqlx.DB, table string) error {
	ctx := msg.Context()
	tx, ok := inbox.TxFromContext(ctx)
	if !ok {
		return errors.New("no inbox transaction")
	}
	consumer := message.HandlerNameFromCtx(ctx)
	where := " FROM " + table + " WHERE consumer = ? AND message_id = ?"
	var inTx, outside int
	if err := tx.GetContext(ctx, &inTx, tx.Rebind("SELECT COUNT(*)"+where), consumer, msg.UUID); err != nil {
		return err
	}
	if err := db.GetContext(ctx, &outside, db.Rebind("SELECT COUNT(*)"+where), consumer, msg.UUID); err != nil {
		return err
	}
	if inTx != 1 || outside != 0 {
		return fmt.Errorf("inbox row seen %d times through the handler's transaction and %d times from another connection, want 1 and 0", inTx, outside)
	}
	if isPostgres(d) {
		var same bool
		if err := tx.GetContext(ctx, &same, tx.Rebind("SELECT (SELECT xmin::text"+where+") = pg_current_xact_id()::xid::text"),
			consumer, msg.UUID); err != nil {
			return err
		}
		if !same {
			return errors.New("the inbox row's xmin is not the handler's transaction id")
		}
	}
	return nil
}
