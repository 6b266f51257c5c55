package inbox_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// A round deletes the expired rows, measures the oldest row left, and logs
// one Info line.
func TestPurgerRound(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		f := newFixture(t, db)
		f.newInbox(inbox.Config{})
		insertRows(t, db, tdb.Dialect, f.inbox, "billing", "old", 1200, 2*time.Hour)
		insertRows(t, db, tdb.Dialect, f.inbox, "billing", "recent", 10, 30*time.Minute)
		logger := newCaptureLogger()
		p, err := inbox.NewPurger(inbox.PurgerConfig{
			Purge:  inbox.PurgeConfig{DB: db, Table: f.inbox, OlderThan: time.Hour, BatchSize: 500},
			Logger: logger,
		})
		if err != nil {
			t.Fatal(err)
		}
		round := p.RunOnce(context.Background())
		if round.Err != nil || round.Skipped || round.Deleted != 1200 {
			t.Fatalf("round = %+v, want 1200 deleted", round)
		}
		if round.OldestAge < 29*time.Minute || round.OldestAge > 31*time.Minute {
			t.Errorf("oldest age = %v, want about 30m", round.OldestAge)
		}
		if f.inboxRows() != 10 {
			t.Errorf("rows left = %d, want 10", f.inboxRows())
		}
		var infos int
		for _, l := range *logger.lines {
			if l.level == "info" && l.fields["deleted"] == int64(1200) {
				infos++
			}
		}
		if infos != 1 {
			t.Errorf("log lines %v, want one Info line with deleted=1200", *logger.lines)
		}
	})
}

// Another instance holding the lock makes a round skip; two purgers racing
// never fail and together delete exactly the expired rows.
func TestPurgerInstancesDoNotFight(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		f := newFixture(t, db)
		f.newInbox(inbox.Config{})
		insertRows(t, db, tdb.Dialect, f.inbox, "billing", "old", 3000, 2*time.Hour)
		insertRows(t, db, tdb.Dialect, f.inbox, "billing", "recent", 10, 30*time.Minute)
		newPurger := func() *inbox.Purger {
			p, err := inbox.NewPurger(inbox.PurgerConfig{
				Purge: inbox.PurgeConfig{DB: db, Table: f.inbox, OlderThan: time.Hour, BatchSize: 100},
			})
			if err != nil {
				t.Fatal(err)
			}
			return p
		}
		a, b := newPurger(), newPurger()
		db.SetMaxOpenConns(5) // two rounds and the test's lock: a round needs two connections on PostgreSQL
		if tdb.Dialect != inbox.SQLite {
			ctx := context.Background()
			release, got, err := inbox.PurgeLock(ctx, db, a)
			if !got || err != nil {
				t.Fatalf("lock: %v %v", got, err)
			}
			if round := b.RunOnce(ctx); !round.Skipped || round.Deleted != 0 || round.Err != nil {
				t.Errorf("round while another instance holds the lock = %+v, want skipped", round)
			}
			if err := release(); err != nil {
				t.Fatal(err)
			}
		}
		var deleted atomic.Int64
		var wg sync.WaitGroup
		for _, p := range []*inbox.Purger{a, b, a, b} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				round := p.RunOnce(context.Background())
				if round.Err != nil {
					t.Errorf("round: %v", round.Err)
				}
				deleted.Add(round.Deleted)
			}()
		}
		wg.Wait()
		if deleted.Load() != 3000 || f.inboxRows() != 10 {
			t.Errorf("deleted %d, rows left %d; want 3000 and 10", deleted.Load(), f.inboxRows())
		}
	})
}

// A Window refuses a purge that would delete rows the broker can still
// redeliver, and supplies the window when OlderThan is zero.
func TestPurgeWindowSource(t *testing.T) {
	db := sqliteDB(t)
	f := newFixture(t, db)
	f.newInbox(inbox.Config{})
	insertRows(t, db, inbox.SQLite, f.inbox, "billing", "old", 20, 3*time.Hour)
	insertRows(t, db, inbox.SQLite, f.inbox, "billing", "mid", 20, 90*time.Minute)
	cfg := inbox.PurgeConfig{DB: db, Table: f.inbox, OlderThan: time.Hour, Window: fixedWindow(2 * time.Hour)}
	n, err := inbox.Purge(context.Background(), cfg)
	if !errors.Is(err, inbox.ErrWindowTooShort) || n != 0 || f.inboxRows() != 40 {
		t.Fatalf("1h window under a 2h safe window: %d, %v, rows %d; want ErrWindowTooShort and nothing deleted", n, err, f.inboxRows())
	}
	cfg.OlderThan = 0
	if n, err := inbox.Purge(context.Background(), cfg); err != nil || n != 20 {
		t.Errorf("window from the source: %d, %v; want 20 deleted", n, err)
	}
}

// As a router plugin the purger runs while the router runs and stops when
// it closes.
func TestPurgerRouterPlugin(t *testing.T) {
	db := sqliteDB(t)
	f := newFixture(t, db)
	f.newInbox(inbox.Config{})
	var rounds atomic.Int32
	p, err := inbox.NewPurger(inbox.PurgerConfig{
		Purge:    inbox.PurgeConfig{DB: db, Table: f.inbox, OlderThan: time.Hour},
		Interval: 20 * time.Millisecond,
		OnRound:  func(inbox.PurgeRound) { rounds.Add(1) },
	})
	if err != nil {
		t.Fatal(err)
	}
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

func TestNewPurgerErrors(t *testing.T) {
	if _, err := inbox.NewPurger(inbox.PurgerConfig{}); !errors.Is(err, inbox.ErrInvalidConfig) {
		t.Errorf("empty config: %v", err)
	}
	if _, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: sqliteDB(t), OlderThan: time.Hour}, Interval: -time.Second}); !errors.Is(err, inbox.ErrInvalidConfig) {
		t.Errorf("negative interval: %v", err)
	}
}
