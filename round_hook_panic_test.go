package inbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
)

// An OutboxConfig.OnRound that panics (a bug in metrics code) is logged,
// and the relay goes on: under RouterPlugin the relay runs on a goroutine
// of its own, where the panic ended the whole process, every handler in
// flight with it, and again at every start while outputs were waiting.
func TestOutboxOnRoundThatPanicsIsLoggedAndTheRelayGoesOn(t *testing.T) {
	db := sqliteDB(t)
	broker := newBrokerStub()
	logger := newCaptureLogger()
	ob := newTestOutbox(t, db, inbox.SQLite, inbox.OutboxConfig{Publisher: broker, Logger: logger,
		OnRound: func(inbox.OutboxRound) { panic("a bug in the relay's metrics") }})
	ib := newFixture(t, db).newInbox(inbox.Config{Outbox: ob.Publisher})
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddPlugin(ob.RouterPlugin)
		r.AddMiddleware(ib.Middleware)
		r.AddHandler("billing", "orders", in, "documents", nil, func(msg *message.Message) ([]*message.Message, error) {
			return []*message.Message{message.NewMessage(msg.UUID+"-out", []byte("invoice"))}, nil
		})
	})
	var want []string
	for range 3 {
		m := message.NewMessage(watermill.NewUUID(), []byte("order"))
		if !in.deliver(t, m) {
			t.Fatal("nacked")
		}
		want = append(want, m.UUID+"-out")
		waitFor(t, func() bool { return len(broker.uuids("documents")) == len(want) })
	}
	if got := broker.uuids("documents"); len(got) != 3 {
		t.Fatalf("relayed %v, want %v", got, want)
	}
	if !logger.has("OnRound panicked") {
		t.Error("the panic was not logged")
	}
}

// The same for PurgerConfig.OnRound: Run's goroutine is the purger's own.
func TestPurgerOnRoundThatPanicsIsLoggedAndTheRoundsGoOn(t *testing.T) {
	db := sqliteDB(t)
	f := newFixture(t, db)
	f.newInbox(inbox.Config{})
	insertRows(t, db, inbox.SQLite, f.inbox, "billing", "old", 10, 2*time.Hour)
	logger := newCaptureLogger()
	p, err := inbox.NewPurger(inbox.PurgerConfig{
		Purge:  inbox.PurgeConfig{DB: db, Table: f.inbox, OlderThan: time.Hour},
		Logger: logger, OnRound: func(inbox.PurgeRound) { panic("a bug in the purge's metrics") },
	})
	if err != nil {
		t.Fatal(err)
	}
	if round := p.RunOnce(context.Background()); round.Err != nil || round.Deleted != 10 {
		t.Fatalf("round %+v, want 10 deleted", round)
	}
	if !logger.has("OnRound panicked") {
		t.Error("the panic was not logged")
	}
}
