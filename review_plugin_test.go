package inbox_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
)

// The router's Run fails after our plugin started (a later plugin fails):
// Run returns without ever closing the router, so r.IsClosed() stays false
// and the purger goroutines run for ever, purging for a dead router.
func TestReviewRouterPluginLeaksWhenRunFails(t *testing.T) {
	db := sqliteDB(t)
	f := newFixture(t, db)
	f.newInbox(inbox.Config{})
	var rounds atomic.Int32
	p, err := inbox.NewPurger(inbox.PurgerConfig{
		Purge:    inbox.PurgeConfig{DB: db, Table: f.inbox, OlderThan: time.Hour},
		Interval: 50 * time.Millisecond,
		OnRound:  func(inbox.PurgeRound) { rounds.Add(1) },
	})
	if err != nil {
		t.Fatal(err)
	}
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r.AddPlugin(p.RouterPlugin, func(*message.Router) error { return errors.New("metrics plugin: port in use") })
	r.AddConsumerHandler("billing", "orders", newFeed(), func(*message.Message) error { return nil })
	if err := r.Run(context.Background()); err == nil {
		t.Fatal("want Run to fail")
	}
	time.Sleep(1500 * time.Millisecond) // "stops within a second of the router closing"
	before := rounds.Load()
	time.Sleep(1 * time.Second)
	if after := rounds.Load(); after != before {
		t.Errorf("router.Run returned an error %v ago, purger still running: %d rounds then %d (IsClosed=%v)",
			2500*time.Millisecond, before, after, r.IsClosed())
	}
	_ = r.Close()
}
