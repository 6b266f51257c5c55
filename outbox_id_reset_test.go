package inbox_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
)

// holdingPublisher accepts every message, and holds its first call until
// release is closed.
type holdingPublisher struct {
	*brokerStub
	once             sync.Once
	entered, release chan struct{}
}

func (p *holdingPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.once.Do(func() { close(p.entered); <-p.release })
	return p.brokerStub.Publish(topic, msgs...)
}

// On SQLite the relay holds no lock while it publishes. The outbox table is
// re-created meanwhile (its ids start again), and new messages take the ids
// of the round's: the round's DELETE by id removed them unsent, and its
// move to the dead-letter table set a new message aside untried. The
// round's statements find a row by its id and its uuid: the new messages
// are sent.
func TestSQLiteOutboxIDsStartingAgainDuringARoundLoseNothing(t *testing.T) {
	for _, refuse := range []bool{false, true} {
		name := map[bool]string{false: "sent", true: "refused-for-good"}[refuse]
		t.Run(name, func(t *testing.T) {
			db := sqliteDB(t)
			pub := &holdingPublisher{brokerStub: newBrokerStub(), entered: make(chan struct{}), release: make(chan struct{})}
			ob := newTestOutbox(t, db, inbox.SQLite, inbox.OutboxConfig{Publisher: pub, PollInterval: time.Hour, MaxAttempts: 1})
			old := writeOutbox(t, db, ob, "old", 3) // ids 1..3
			if refuse {
				pub.setRefuse(refuseUUIDs(inbox.ErrMessageRejected, old...))
			}
			done := make(chan inbox.OutboxRound, 1)
			go func() { done <- ob.RelayOnce(context.Background()) }()
			<-pub.entered
			exec(t, db, "DROP TABLE "+ob.Table())
			exec(t, db, "DROP TABLE "+ob.DeadLetterTable())
			if err := ob.InitializeSchema(context.Background()); err != nil {
				t.Fatal(err)
			}
			fresh := writeOutbox(t, db, ob, "new", 3) // ids 1..3 again
			close(pub.release)
			if r := <-done; r.Err != nil && !errors.Is(r.Err, inbox.ErrMessageRejected) {
				t.Fatal(r.Err)
			}
			pub.setRefuse(nil)
			relayUntilEmpty(t, ob)
			if got := pub.uuids("new"); len(got) != len(fresh) {
				st, _ := ob.Stats(context.Background())
				t.Fatalf("of %d messages committed after the ids started again, %d reached the broker; outbox %+v", len(fresh), len(got), st)
			}
		})
	}
}
