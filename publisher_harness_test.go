package inbox_test

// Publishers for the tests: the poison topic, outbox publishers and a
// router publisher that can fail or panic.

import (
	"errors"
	"slices"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// poisonSink is the poison topic: a publisher that keeps what it is given.
type poisonSink struct {
	mu   sync.Mutex
	msgs []*message.Message
}

func (p *poisonSink) Publish(_ string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.msgs = append(p.msgs, msgs...)
	return nil
}

func (p *poisonSink) Close() error { return nil }

func (p *poisonSink) poisoned() []*message.Message {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.msgs)
}

// poisonUnlessTransient is the poison queue the README recommends: every
// error except a transient one (IsTransient) goes to the poison topic.
func poisonUnlessTransient(t *testing.T) (message.HandlerMiddleware, *poisonSink) {
	t.Helper()
	sink := &poisonSink{}
	mw, err := middleware.PoisonQueueWithFilter(sink, "poison", func(err error) bool { return !inbox.IsTransient(err) })
	if err != nil {
		t.Fatal(err)
	}
	return mw, sink
}

// panicPublisher panics on Publish.
type panicPublisher struct{}

func (panicPublisher) Publish(string, ...*message.Message) error { panic("outbox publisher bug") }

func (panicPublisher) Close() error { return nil }

// txPublisher is an outbox publisher bound to one transaction: it writes
// each message as a row of the outbox table, as watermill-sql's publisher
// does. failing makes Publish fail.
type txPublisher struct {
	tx      *sqlx.Tx
	table   string
	failing bool
}

func (p *txPublisher) Publish(topic string, msgs ...*message.Message) error {
	if p.failing {
		return errors.New("outbox unavailable")
	}
	for _, m := range msgs {
		if _, err := p.tx.Exec(p.tx.Rebind("INSERT INTO "+p.table+" (uuid, topic) VALUES (?, ?)"), m.UUID, topic); err != nil {
			return err
		}
	}
	return nil
}

func (p *txPublisher) Close() error { return nil }

// recordingPublisher is the router's own publisher; fail makes it fail.
type recordingPublisher struct {
	mu        sync.Mutex
	published int
	fail      bool
}

func (p *recordingPublisher) Publish(string, ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.fail {
		return errors.New("broker unavailable")
	}
	p.published++
	return nil
}

func (p *recordingPublisher) Close() error { return nil }

func outboxTable(t *testing.T, db *sqlx.DB) string {
	table := "outbox_" + randomSuffix()
	exec(t, db, "CREATE TABLE "+table+" (uuid VARCHAR(64) NOT NULL, topic VARCHAR(255) NOT NULL)")
	dropLater(t, db, table)
	return table
}
