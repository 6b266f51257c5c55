package inbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// A SQLite database opened in shared-cache mode (cache=shared: a shared
// in-memory database, or a file whose connections share one cache) with
// PRAGMA read_uncommitted on (which shared-cache users set so that readers
// are not refused with SQLITE_LOCKED while a writer works): the relay reads
// its batch outside any transaction, so it sees the outbox rows a handler's
// transaction has written and not committed, and publishes them. When that
// transaction then rolls back (the handler fails), the message has already
// reached the broker: an output sent for a delivery whose transaction did
// not commit, which the contract (semantics 14: sent if and only if the
// transaction commits) rules out. New, InitializeSchema and Verify accept
// such sessions.
//
// The relay must never publish a row that has not committed: refuse such
// sessions at startup, or read only committed rows.
func TestOutboxRelayOnSharedCacheReadUncommittedSendsOnlyCommittedOutputs(t *testing.T) {
	for name, dsn := range map[string]string{
		"memory": "file:sess_ru_" + randomSuffix() + "?mode=memory&cache=shared&_busy_timeout=10000&_txlock=immediate&_pragma=read_uncommitted(1)",
		"file":   "file:" + t.TempDir() + "/relay.db?cache=shared&_journal_mode=WAL&_busy_timeout=10000&_txlock=immediate&_pragma=read_uncommitted(1)",
	} {
		t.Run(name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			db, err := sqlx.Open("sqlite", dsn)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { db.Close() })
			if err := db.PingContext(ctx); err != nil {
				t.Fatal(err)
			}
			broker := newBrokerStub()
			ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Table: "sess_outbox", Publisher: broker})
			if err != nil {
				t.Fatal(err)
			}
			if err := ob.InitializeSchema(ctx); err != nil {
				return // refused at startup: fine
			}
			ib, err := inbox.New(inbox.Config{DB: db, Table: "sess_inbox", Outbox: ob.Publisher})
			if err != nil {
				return
			}
			if err := ib.InitializeSchema(ctx); err != nil {
				return
			}
			entered, release := make(chan struct{}), make(chan struct{})
			in := newFeed()
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(ib.Middleware)
				r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
					pub, ok := inbox.OutboxFromContext(msg.Context())
					if !ok {
						return errors.New("no outbox publisher")
					}
					if err := pub.Publish("invoices", message.NewMessage(watermill.NewUUID(), []byte("invoice"))); err != nil {
						return err
					}
					close(entered)
					<-release
					return errors.New("card declined") // the transaction rolls back
				})
			})
			acked := make(chan bool, 1)
			go func() { acked <- in.deliver(t, message.NewMessage(watermill.NewUUID(), []byte("order"))) }()
			<-entered
			// A relay round while the handler's transaction is open.
			roundCtx, roundCancel := context.WithTimeout(ctx, 2*time.Second)
			ob.RelayOnce(roundCtx)
			roundCancel()
			close(release)
			if <-acked {
				t.Fatal("a failing handler's message was acked")
			}
			relayUntilEmpty(t, ob)
			if got := broker.uuids("invoices"); len(got) != 0 {
				t.Errorf("the broker got %d outputs of a delivery whose transaction rolled back; want none", len(got))
			}
		})
	}
}
