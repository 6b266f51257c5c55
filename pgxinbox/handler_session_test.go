package pgxinbox_test

import (
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// poisonTopic is a poison topic that counts what it is given.
type poisonTopic struct {
	mu sync.Mutex
	n  int
}

func (p *poisonTopic) Publish(_ string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.n += len(msgs)
	return nil
}

func (p *poisonTopic) Close() error { return nil }

func (p *poisonTopic) count() int { p.mu.Lock(); defer p.mu.Unlock(); return p.n }

// A handler runs DEALLOCATE ALL on the inbox transaction and is processed.
// Under pgx's statement cache (cache_statement, its default) the next
// message's BEGIN and claim, sent in one batch, fail once with 26000 on
// that connection, and pgx prepares them afresh afterwards. That message
// did nothing wrong: it was failed with a non-transient error, and the
// poison queue the README recommends took it. Now it is nacked as
// transient, and its redelivery is processed, once.
func TestMessagesAfterAHandlerDeallocatedTheStatementsAreNotPoisoned(t *testing.T) {
	t.Parallel()
	pool := openPool(t, "", "pgxinbox_deallocate_"+testdb.RandomSuffix(), func(c *pgxpool.Config) {
		c.MaxConns = 1 // every message on the connection whose statements went
		c.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeCacheStatement
	})
	f := newFixture(t, pool)
	ib := f.newInbox(pgxinbox.Config{})
	sink := &poisonTopic{}
	poison, err := middleware.PoisonQueueWithFilter(sink, "poison", func(err error) bool { return !inbox.IsTransient(err) })
	if err != nil {
		t.Fatal(err)
	}
	rec := &recorder{}
	in := consume(t, ib, func(msg *message.Message) error {
		tx, _ := pgxinbox.TxFromContext(msg.Context())
		// No arguments: pgx sends it unprepared (a cached statement of the
		// handler's own would fail once too, as the handler's error).
		if _, err := tx.Exec(msg.Context(), "INSERT INTO "+f.effect+" (message_id) VALUES ('"+msg.UUID+"')"); err != nil {
			return err
		}
		if msg.Metadata.Get("deallocate") == "yes" {
			if _, err := tx.Exec(msg.Context(), "DEALLOCATE ALL"); err != nil {
				return err
			}
		}
		return nil
	}, rec.Middleware, poison)
	for i := range 3 { // the statements prepared and cached
		if !in.deliver(t, labelled(message.NewMessage(watermill.NewUUID(), nil), "warm")) {
			t.Fatalf("warm-up %d nacked: %v", i, rec.lastOf("warm"))
		}
	}
	deallocating := message.NewMessage(watermill.NewUUID(), nil)
	deallocating.Metadata.Set("deallocate", "yes")
	if !in.deliver(t, labelled(deallocating, "deallocating")) {
		t.Fatalf("the message whose handler deallocated nacked: %v", rec.lastOf("deallocating"))
	}
	nacked := 0
	for i := range 5 {
		msg := labelled(message.NewMessage(watermill.NewUUID(), nil), "after")
		for attempt := 1; !in.deliver(t, msg); attempt++ {
			nacked++
			if err := rec.lastOf("after"); !inbox.IsTransient(err) || attempt == 3 {
				t.Fatalf("message %d after the DEALLOCATE, delivery %d: %v (transient %v)", i, attempt, err, inbox.IsTransient(err))
			}
		}
	}
	if nacked+sink.count() == 0 {
		t.Fatal("no message after the DEALLOCATE failed: the case did not happen")
	}
	if n := sink.count(); n != 0 {
		t.Errorf("%d message(s) poisoned, want none", n)
	}
	f.expectRows(9, 9)
}
