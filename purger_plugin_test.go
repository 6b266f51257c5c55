package inbox_test

import (
	"bytes"
	"context"
	"errors"
	"runtime"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
)

// pluginGoroutines counts the goroutines running Purger.RouterPlugin's
// watcher or the Purger it started.
func pluginGoroutines() int {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	var count int
	for _, g := range bytes.Split(buf, []byte("\n\n")) {
		if bytes.Contains(g, []byte("inbox.(*Purger).RouterPlugin")) || bytes.Contains(g, []byte("inbox.(*Purger).Run(")) {
			count++
		}
	}
	return count
}

// A router whose Run failed after loading the plugin (a later plugin's
// error) and that is then closed leaves no purger goroutine behind: the
// plugin sees the close instead of waiting out RouterPluginStartTimeout (5
// minutes). Found by goleak in TestMain. Not parallel: it counts goroutines.
func TestRouterPluginStopsWhenClosedBeforeRunning(t *testing.T) {
	before := pluginGoroutines()
	db := sqliteDB(t)
	f := newFixture(t, db)
	f.newInbox(inbox.Config{})
	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Table: f.inbox, OlderThan: time.Hour}})
	if err != nil {
		t.Fatal(err)
	}
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 100 * time.Millisecond}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r.AddPlugin(p.RouterPlugin, func(*message.Router) error { return errors.New("metrics plugin: port in use") })
	r.AddConsumerHandler("billing", "orders", newFeed(), func(*message.Message) error { return nil })
	if err := r.Run(context.Background()); err == nil {
		t.Fatal("want Run to fail")
	}
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
