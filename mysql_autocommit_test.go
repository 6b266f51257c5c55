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

// MySQL/MariaDB sessions with autocommit off (the DSN's autocommit=0) are
// refused: after a deadlock that rolled the message's transaction back (an
// error the handler ignored), the next statement opens a new transaction
// that no status, @@in_transaction or read of the claim tells from the
// message's, and the inbox would commit the handler's later writes and
// outputs with the message not processed. Verify says so at startup; a
// message is nacked as transient (nothing about it is wrong), its handler
// not called and nothing written.
func TestMySQLSessionsWithAutocommitOffAreRefused(t *testing.T) {
	t.Parallel()
	plain := testdb.OpenMySQL(t, "")
	f := newFixture(t, plain)
	f.newInbox(inbox.Config{}) // the table, made on sessions with autocommit on
	db := testdb.OpenMySQL(t, "autocommit=0")
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
	if err := ib.Verify(ctx); !errors.Is(err, inbox.ErrInvalidConfig) || !strings.Contains(err.Error(), "autocommit") {
		t.Errorf("Verify: %v, want ErrInvalidConfig naming autocommit", err)
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
	if in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
		t.Fatal("a message was acked on sessions with autocommit off")
	}
	if err := rec.last(); !errors.Is(err, inbox.ErrInvalidConfig) || !inbox.IsTransient(err) {
		t.Errorf("nacked with %v, want ErrInvalidConfig, transient", err)
	}
	if calls != 0 || count(t, plain, f.inbox, "") != 0 {
		t.Errorf("handler calls %d, inbox rows written; want none", calls)
	}
}
