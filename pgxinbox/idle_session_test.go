package pgxinbox_test

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// TestIdleSessionTimeoutIsNotPoisoned: the server closed the pool's idle
// session (idle_session_timeout, SQLSTATE 57P05). The next message's batch
// (BEGIN + claim) meets it: a nack that must be transient, not poisoned.
func TestIdleSessionTimeoutIsNotPoisoned(t *testing.T) {
	pool := openPool(t, "", "idle_session", func(c *pgxpool.Config) {
		c.MaxConns = 1
		c.ConnConfig.RuntimeParams["idle_session_timeout"] = "300"
	})
	f := newFixture(t, pool)
	ib := f.newInbox(pgxinbox.Config{})
	rec := &recorder{}
	var c calls
	in := consume(t, ib, func(msg *message.Message) error {
		c.inc(msg)
		return f.writeEffect(msg)
	}, rec.Middleware)
	const n = 4
	for i := range n {
		time.Sleep(600 * time.Millisecond) // idle past the server's timeout, under pgxpool's 1 s ping
		msg := message.NewMessage(watermill.NewUUID(), nil)
		for attempt := 1; !in.deliver(t, msg); attempt++ {
			err := rec.last()
			t.Logf("message %d attempt %d nacked: %v (IsTransient=%v)", i, attempt, err, inbox.IsTransient(err))
			if !inbox.IsTransient(err) {
				t.Errorf("message %d nacked with a non-transient error (poisoned by !IsTransient): %v", i, err)
			}
			if attempt > 5 {
				t.Fatal("never acked")
			}
		}
	}
	f.expectRows(n, n)
}
