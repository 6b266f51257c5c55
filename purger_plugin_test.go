package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

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
	r := pluginRouter(t, 10*time.Second, watermill.NopLogger{}, p.RouterPlugin)
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

// A Purger whose PurgeConfig.Table names no table (the inbox's Config.Table
// was set and the purge's was not) fails router.Run at once, with an error
// that matches ErrTableNotFound and names the setting, on every database;
// it ran every round against the missing table before, each failure logged
// to no one. Purge itself says the same.
func TestPurgerPluginFailsTheRouterWhenItsTableDoesNotExist(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		missing := "inbox_missing_" + randomSuffix()
		_, err := inbox.Purge(context.Background(), inbox.PurgeConfig{DB: db, Dialect: tdb.Dialect, Table: missing, OlderThan: time.Hour})
		if !errors.Is(err, inbox.ErrTableNotFound) || !strings.Contains(err.Error(), "PurgeConfig.Table") {
			t.Errorf("Purge of a missing table: %v, want ErrTableNotFound naming PurgeConfig.Table", err)
		}
		p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Dialect: tdb.Dialect, Table: missing, OlderThan: time.Hour}})
		if err != nil {
			t.Fatal(err)
		}
		r := pluginRouter(t, 10*time.Second, watermill.NopLogger{}, p.RouterPlugin)
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		err = r.Run(ctx)
		_ = r.Close()
		if !errors.Is(err, inbox.ErrTableNotFound) || !strings.Contains(err.Error(), "PurgeConfig.Table") {
			t.Errorf("router.Run with a purger of a missing table: %v, want ErrTableNotFound naming PurgeConfig.Table", err)
		}
	})
}

// A Purger, an Outbox and an Inbox given no Logger log, under their
// RouterPlugin, to the router's logger: a purger whose rounds failed, a
// relay that could not publish, an outcome hook that panicked, all logged
// to watermill.NopLogger, and nothing said so.
func TestPluginsWithoutALoggerLogToTheRouters(t *testing.T) {
	db := sqliteDB(t)
	f := newFixture(t, db)
	ib := f.newInbox(inbox.Config{OnProcessed: func(inbox.Event) { panic("a bug in the metrics hook") }})
	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Table: f.inbox, OlderThan: time.Hour},
		Interval: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ob := newTestOutbox(t, db, inbox.SQLite, inbox.OutboxConfig{Publisher: refusingPublisher{}, PollInterval: 20 * time.Millisecond})
	writeOutbox(t, db, ob, "invoices", 1)
	logger := newCaptureLogger()
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		t.Fatal(err)
	}
	r.AddPlugin(ib.RouterPlugin, p.RouterPlugin, ob.RouterPlugin)
	r.AddMiddleware(ib.Middleware)
	in := newFeed()
	r.AddConsumerHandler("billing", "orders", in, func(*message.Message) error { return nil })
	go func() { _ = r.Run(context.Background()) }()
	defer r.Close()
	<-r.Running()
	if !in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
		t.Fatal("the message was not acked")
	}
	for _, line := range []string{"Inbox purge round", "Inbox outbox relay round failed", "Inbox OnProcessed hook panicked"} {
		waitFor(t, func() bool { return logger.has(line) })
	}
}

// refusingPublisher refuses every message.
type refusingPublisher struct{}

func (refusingPublisher) Publish(string, ...*message.Message) error {
	return errors.New("the broker refuses the message")
}
func (refusingPublisher) Close() error { return nil }

// After router.Run returned, WaitStopped returns once the relay and the
// purger that the plugins started have stopped (router.Run does not wait
// for them), so that the publisher and the database can be closed under
// nothing: users slept for "the second" docs/outbox.md spoke of. Here the
// relay is in a Publish that does not return when the router closes:
// WaitStopped waits for it, and returns once it has returned.
func TestWaitStoppedReturnsOnceThePluginsLoopsStopped(t *testing.T) {
	db := sqliteDB(t)
	f := newFixture(t, db)
	f.newInbox(inbox.Config{})
	var rounds atomic.Int32
	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Table: f.inbox, OlderThan: time.Hour},
		Interval: 10 * time.Millisecond, OnRound: func(inbox.PurgeRound) { rounds.Add(1) }})
	if err != nil {
		t.Fatal(err)
	}
	broker := &stuckPublisher{publishing: make(chan struct{}), release: make(chan struct{})}
	ob := newTestOutbox(t, db, inbox.SQLite, inbox.OutboxConfig{Publisher: broker, PollInterval: 10 * time.Millisecond})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, c := range []interface{ WaitStopped(context.Context) error }{p, ob} {
		if err := c.WaitStopped(ctx); err != nil {
			t.Fatalf("WaitStopped before anything ran: %v, want nil at once", err)
		}
	}
	r := pluginRouter(t, 10*time.Second, watermill.NopLogger{}, p.RouterPlugin, ob.RouterPlugin)
	runCtx, stop := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- r.Run(runCtx) }()
	<-r.Running()
	writeOutbox(t, db, ob, "invoices", 1)
	<-broker.publishing
	waitFor(t, func() bool { return rounds.Load() > 0 })
	stop()
	if err := <-ran; err != nil {
		t.Fatal(err)
	}
	short, cancelShort := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancelShort()
	if err := ob.WaitStopped(short); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Outbox.WaitStopped while the relay's Publish has not returned: %v, want it to wait (the deadline)", err)
	}
	close(broker.release)
	for _, c := range []interface{ WaitStopped(context.Context) error }{p, ob} {
		if err := c.WaitStopped(ctx); err != nil {
			t.Fatalf("WaitStopped once the loops can stop: %v", err)
		}
	}
	after := rounds.Load()
	time.Sleep(100 * time.Millisecond) // ten intervals
	if rounds.Load() != after {
		t.Errorf("%d purge rounds after WaitStopped returned, want 0", rounds.Load()-after)
	}
}

// stuckPublisher's Publish says it was called (publishing, once) and
// returns an error once release is closed, whatever its caller's context.
type stuckPublisher struct {
	once       sync.Once
	publishing chan struct{}
	release    chan struct{}
}

func (s *stuckPublisher) Publish(string, ...*message.Message) error {
	s.once.Do(func() { close(s.publishing) })
	<-s.release
	return fmt.Errorf("%w: the broker went away", inbox.ErrBrokerUnavailable)
}
func (s *stuckPublisher) Close() error { return nil }

// WaitStopped after a router.Run that failed (a later plugin's error: the
// router neither starts nor closes) returns at once: nothing ran. It
// waited for RouterPluginStartTimeout (5 minutes).
func TestWaitStoppedAfterARouterRunThatFailedReturnsAtOnce(t *testing.T) {
	db := sqliteDB(t)
	f := newFixture(t, db)
	f.newInbox(inbox.Config{})
	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Table: f.inbox, OlderThan: time.Hour}})
	if err != nil {
		t.Fatal(err)
	}
	ob := newTestOutbox(t, db, inbox.SQLite, inbox.OutboxConfig{Publisher: newBrokerStub()})
	missing, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Table: "inbox_missing_" + randomSuffix(), OlderThan: time.Hour}})
	if err != nil {
		t.Fatal(err)
	}
	r := pluginRouter(t, 100*time.Millisecond, watermill.NopLogger{}, p.RouterPlugin, ob.RouterPlugin, missing.RouterPlugin)
	if err := r.Run(context.Background()); !errors.Is(err, inbox.ErrTableNotFound) {
		t.Fatalf("router.Run: %v, want the missing table's plugin error", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	for _, c := range []interface{ WaitStopped(context.Context) error }{p, ob} {
		if err := c.WaitStopped(ctx); err != nil {
			t.Errorf("WaitStopped after a router.Run that failed: %v, want nil at once", err)
		}
	}
	_ = r.Close() // lets the plugins' goroutines go (it times out: no handler ever started)
}
