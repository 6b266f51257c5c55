package pgxinbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// After the inbox commits, the handler's pgx.Tx is finished: a statement on
// it (from an inbox.AfterCommit function, or a goroutine of the handler)
// fails with pgx.ErrTxClosed, as a *sqlx.Tx of inbox.New fails with
// sql.ErrTxDone. When the handler returned messages, pgxinbox sends their
// INSERT and COMMIT in one batch on the pgx.Tx (CommitWith), which pgx does
// not count as the end of the transaction: the pgx.Tx stays open on a
// connection the pool has already taken back, and its statements run there,
// in autocommit or in another message's transaction: it is ended too now.
func TestPgxTxIsClosedAfterTheCommitWhetherOrNotTheHandlerReturnedMessages(t *testing.T) {
	t.Parallel()
	for _, returns := range []bool{false, true} {
		name := "no returned messages"
		if returns {
			name = "returned messages"
		}
		t.Run(name, func(t *testing.T) {
			pool := openPool(t, "", "after_commit_"+testdb.RandomSuffix(), nil)
			f := newFixture(t, pool)
			broker := &countingBroker{}
			ob := f.newRelayOutbox(broker)
			ib := f.newInbox(pgxinbox.Config{Outbox: pgxinbox.OutboxPublisher(ob)})
			late := make(chan error, 1)
			in := newFeed()
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(ib.Middleware)
				r.AddHandler("billing", "orders", in, "invoices", broker, func(msg *message.Message) ([]*message.Message, error) {
					tx, _ := pgxinbox.TxFromContext(msg.Context())
					if err := f.writeEffect(msg); err != nil {
						return nil, err
					}
					inbox.AfterCommit(msg.Context(), func() {
						_, err := tx.Exec(context.Background(), "INSERT INTO "+f.effect+" (message_id) VALUES ('after-commit')")
						late <- err
					})
					if !returns {
						return nil, nil
					}
					return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("invoice"))}, nil
				})
			})
			if !in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
				t.Fatal("nacked")
			}
			err := <-late
			var n int
			if qerr := pool.QueryRow(context.Background(), "SELECT count(*) FROM "+f.effect+" WHERE message_id = 'after-commit'").Scan(&n); qerr != nil {
				t.Fatal(qerr)
			}
			if !errors.Is(err, pgx.ErrTxClosed) || n != 0 {
				t.Errorf("a statement on the committed pgx.Tx returned %v and wrote %d rows; want pgx.ErrTxClosed and none (the "+
					"transaction is over, its connection back in the pool)", err, n)
			}
		})
	}
}

// The same on a pool of one connection, with a second message in flight:
// the first message's late statement on its committed pgx.Tx runs inside the
// second message's transaction, reports success, and is rolled back with
// that message's failure: the write was lost although Exec returned nil.
func TestLateStatementOnACommittedPgxTxIsNotRunInAnotherMessagesTransaction(t *testing.T) {
	t.Parallel()
	pool := openPool(t, "", "late_stmt_"+testdb.RandomSuffix(), func(c *pgxpool.Config) { c.MaxConns = 1 })
	f := newFixture(t, pool)
	broker := &countingBroker{}
	ob := f.newRelayOutbox(broker)
	ib := f.newInbox(pgxinbox.Config{Outbox: pgxinbox.OutboxPublisher(ob)})
	aCommitted, bInHandler, aWrote := make(chan struct{}), make(chan struct{}), make(chan struct{})
	late := make(chan error, 1)
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(ib.Middleware)
		r.AddHandler("billing", "orders", in, "invoices", broker, func(msg *message.Message) ([]*message.Message, error) {
			tx, _ := pgxinbox.TxFromContext(msg.Context())
			if msg.Metadata.Get("delivery") == "B" {
				close(bInHandler)
				select {
				case <-aWrote:
				case <-time.After(caseTimeout):
				}
				return nil, errors.New("B fails")
			}
			inbox.AfterCommit(msg.Context(), func() {
				close(aCommitted) // A's transaction committed and its connection is back in the pool
				select {
				case <-bInHandler:
				case <-time.After(10 * time.Second):
					late <- errors.New("B never started")
					close(aWrote)
					return
				}
				_, err := tx.Exec(context.Background(), "INSERT INTO "+f.effect+" (message_id) VALUES ('late-A')")
				late <- err
				close(aWrote)
			})
			return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("invoice"))}, nil
		})
	})
	a := in.deliverAsync(t, labelled(message.NewMessage(watermill.NewUUID(), nil), "A"))
	select {
	case <-aCommitted: // its AfterCommit function now waits for B
	case <-time.After(caseTimeout):
		t.Fatal("A never committed")
	}
	b := in.deliverAsync(t, labelled(message.NewMessage(watermill.NewUUID(), nil), "B"))
	if !<-a {
		t.Fatal("A nacked")
	}
	<-b
	err := <-late
	var n int
	if qerr := pool.QueryRow(context.Background(), "SELECT count(*) FROM "+f.effect+" WHERE message_id = 'late-A'").Scan(&n); qerr != nil {
		t.Fatal(qerr)
	}
	if err == nil && n == 0 {
		t.Errorf("A's statement on its committed pgx.Tx returned nil, yet its row is not there: it ran inside B's transaction" +
			" on the pool's connection and was rolled back with B")
	} else {
		t.Logf("late statement: %v, rows %d", err, n)
	}
}
