package inbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// MySQL/MariaDB sessions the inbox cannot work with are refused:
//   - autocommit off (the DSN's autocommit=0): after a deadlock that rolled
//     the message's transaction back (an error the handler ignored), the
//     next statement opens a new transaction that no status,
//     @@in_transaction or read of the claim tells from the message's, and
//     the inbox would commit the handler's later writes and outputs with
//     the message not processed;
//   - a character_set_client other than the character_set_connection (the
//     DSN's character_set_client=latin1): the server converts every string
//     on its way in, so the 16-byte fingerprint grew past its column and
//     every claim failed for good (1406: poisoned under Middlewares), and
//     with the check off an id was stored other than it was;
//   - completion_type CHAIN or RELEASE (the DSN's completion_type=1, 2):
//     each COMMIT opens the session's next transaction (or ends the
//     session), a BEGIN with an isolation level then fails (1568), and
//     statements meant to commit alone (the purge's DELETEs) run in a
//     transaction nobody commits.
//
// Verify says so at startup; a message is nacked as transient (nothing
// about it is wrong), its handler not called and nothing written.
func TestMySQLSessionsTheInboxCannotWorkWithAreRefused(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ param, names string }{
		{"autocommit=0", "autocommit"},
		{"character_set_client=latin1", "character_set_client"},
		{"completion_type=1", "completion_type"},
		{"completion_type=2", "completion_type"},
	} {
		t.Run(c.param, func(t *testing.T) {
			t.Parallel()
			refusesSessions(t, c.param, c.names)
		})
	}
}

// An Outbox on MySQL/MariaDB sessions it cannot work with is refused by
// InitializeSchema, Verify (RouterPlugin) and each relay round, with an
// ErrInvalidConfig that names the setting, as the Inbox refuses them, and
// sends nothing:
//   - autocommit off: a statement it runs outside a transaction of its own
//     (Stats, which the metrics module scrapes) left a transaction open on
//     the pooled session, and every later relay round on that session
//     failed to begin (1568) and sent nothing;
//   - a character_set_client other than the character_set_connection: the
//     server converted the topic, UUID and metadata of every message on
//     their way in, and the relay sent "order-Ã¼" to "tenant-Ã¼";
//   - completion_type CHAIN: each COMMIT opened the session's next
//     transaction, and every relay round on it failed to begin (1568).
func TestMySQLSessionsTheOutboxCannotWorkWithAreRefused(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ param, names string }{
		{"autocommit=0", "autocommit"},
		{"character_set_client=latin1", "character_set_client"},
		{"completion_type=1", "completion_type"},
	} {
		t.Run(c.param, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			plain := testdb.OpenMySQL(t, "")
			table := "outbox_sessions_" + randomSuffix()
			dropLater(t, plain, table)
			dropLater(t, plain, table+"_dead")
			made, err := inbox.NewOutbox(inbox.OutboxConfig{DB: plain, Table: table, Publisher: newBrokerStub()})
			if err != nil {
				t.Fatal(err)
			}
			if err := made.InitializeSchema(ctx); err != nil {
				t.Fatal(err)
			}
			writeOutbox(t, plain, made, "invoices", 2) // pending, written on sessions the outbox works with

			db := testdb.OpenMySQL(t, c.param)
			db.SetMaxOpenConns(1)
			broker := newBrokerStub()
			newOutbox := func() *inbox.Outbox {
				ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Table: table, Publisher: broker})
				if err != nil {
					t.Fatal(err)
				}
				return ob
			}
			refused := func(what string, err error) {
				if !errors.Is(err, inbox.ErrInvalidConfig) || !strings.Contains(err.Error(), c.names) {
					t.Errorf("%s on sessions with %s: %v, want ErrInvalidConfig naming %s", what, c.param, err, c.names)
				}
			}
			refused("InitializeSchema", newOutbox().InitializeSchema(ctx))
			refused("Verify", newOutbox().Verify(ctx))
			ob := newOutbox() // neither: its first round checks
			if _, err := ob.Stats(ctx); !errors.Is(err, inbox.ErrInvalidConfig) {
				t.Errorf("Stats on sessions with %s: %v, want ErrInvalidConfig", c.param, err)
			}
			refused("a relay round", ob.RelayOnce(ctx).Err)
			if got := broker.uuids("invoices"); len(got) != 0 {
				t.Errorf("the relay sent %d messages on sessions with %s; want none", len(got), c.param)
			}
		})
	}
}

// refusesSessions checks that an inbox on MySQL sessions opened with param
// refuses them, with an ErrInvalidConfig that names names.
func refusesSessions(t *testing.T, param, names string) {
	plain := testdb.OpenMySQL(t, "")
	f := newFixture(t, plain)
	f.newInbox(inbox.Config{}) // the table, made on sessions the inbox works with
	db := testdb.OpenMySQL(t, param)
	newInbox := func() *inbox.Inbox {
		ib, err := inbox.New(inbox.Config{DB: db, Table: f.inbox})
		if err != nil {
			t.Fatal(err)
		}
		return ib
	}
	ib := newInbox()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := ib.Verify(ctx); !errors.Is(err, inbox.ErrInvalidConfig) || !strings.Contains(err.Error(), names) {
		t.Errorf("Verify: %v, want ErrInvalidConfig naming %s", err, names)
	}
	fresh := newInbox() // not verified: the first message checks
	var calls int
	rec := &recorder{}
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(rec.Middleware, fresh.Middleware)
		r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
			calls++
			return f.writeBusinessRow(msg)
		})
	})
	if in.deliver(t, message.NewMessage("ünï-"+watermill.NewUUID(), []byte("payload"))) {
		t.Fatalf("a message was acked on sessions with %s", param)
	}
	if err := rec.last(); !errors.Is(err, inbox.ErrInvalidConfig) || !inbox.IsTransient(err) {
		t.Errorf("nacked with %v, want ErrInvalidConfig, transient", err)
	}
	if calls != 0 || count(t, plain, f.inbox, "") != 0 {
		t.Errorf("handler calls %d, inbox rows written; want none", calls)
	}
}
