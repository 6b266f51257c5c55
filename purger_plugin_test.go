package inbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
)

// As a router plugin the purger runs while the router runs and stops when
// it closes.
func TestPurgerRouterPlugin(t *testing.T) {
	db := sqliteDB(t)
	f := newFixture(t, db)
	f.newInbox(inbox.Config{})
	p, rounds := countingPurger(t, db, f.inbox, 20*time.Millisecond)
	router := runRouter(t, func(r *message.Router) {
		r.AddPlugin(p.RouterPlugin)
		r.AddConsumerHandler("billing", "orders", newFeed(), func(*message.Message) error { return nil })
	})
	waitFor(t, func() bool { return rounds.Load() >= 3 })
	if err := router.Close(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1500 * time.Millisecond) // the plugin notices within a second
	stopped := rounds.Load()
	time.Sleep(200 * time.Millisecond)
	if rounds.Load() != stopped {
		t.Errorf("purger still running after the router closed")
	}
}

// A router whose Run failed after loading the plugin (a later plugin's
// error) and that is then closed leaves no purger goroutine behind: the
// plugin sees the close instead of waiting out RouterPluginStartTimeout (5
// minutes). Not parallel: it counts goroutines.
func TestRouterPluginStopsWhenClosedBeforeRunning(t *testing.T) {
	before := pluginGoroutines()
	db := sqliteDB(t)
	f := newFixture(t, db)
	f.newInbox(inbox.Config{})
	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Table: f.inbox, OlderThan: time.Hour}})
	if err != nil {
		t.Fatal(err)
	}
	r := runFailingRouter(t, p, 100*time.Millisecond)
	if pluginGoroutines() <= before {
		t.Fatal("the plugin started no goroutine: the test proves nothing")
	}
	_ = r.Close() // times out: watermill waits for handlers that never started
	waitFor(t, func() bool { return pluginGoroutines() <= before })
}

// When a running router closes, RouterPlugin returns only after the Purger
// it runs has returned: nothing of it outlives the plugin's goroutine.
func TestRouterPluginStopsWithRouter(t *testing.T) {
	before := pluginGoroutines()
	db := sqliteDB(t)
	f := newFixture(t, db)
	f.newInbox(inbox.Config{})
	rounds := make(chan struct{}, 1)
	p, err := inbox.NewPurger(inbox.PurgerConfig{
		Purge:    inbox.PurgeConfig{DB: db, Table: f.inbox, OlderThan: time.Hour},
		Interval: 10 * time.Millisecond,
		OnRound: func(inbox.PurgeRound) {
			select {
			case rounds <- struct{}{}:
			default:
			}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r.AddPlugin(p.RouterPlugin)
	r.AddConsumerHandler("billing", "orders", newFeed(), func(*message.Message) error { return nil })
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	<-rounds
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { return pluginGoroutines() <= before })
}

// A router whose Run failed after loading the plugin (a later plugin's
// error), and that nobody closes (r.IsClosed() stays false), stops the
// purger within a second, as a closed router does: no rounds for a dead
// router.
func TestRouterPluginStopsWhenRunFails(t *testing.T) {
	db := sqliteDB(t)
	f := newFixture(t, db)
	f.newInbox(inbox.Config{})
	p, rounds := countingPurger(t, db, f.inbox, 50*time.Millisecond)
	r := runFailingRouter(t, p, time.Second)
	time.Sleep(1500 * time.Millisecond) // "stops within a second of the router closing"
	before := rounds.Load()
	time.Sleep(1 * time.Second)
	if after := rounds.Load(); after != before {
		t.Errorf("router.Run returned an error %v ago, purger still running: %d rounds then %d (IsClosed=%v)",
			2500*time.Millisecond, before, after, r.IsClosed())
	}
	_ = r.Close()
}
