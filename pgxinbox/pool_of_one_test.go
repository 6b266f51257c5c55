package pgxinbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// A purge round needs two connections at once (its lock's and its batches'):
// on a pgx pool of one connection it is refused with ErrInvalidConfig, as
// on a database/sql pool of one. Through ib.DB() (stdlib.OpenDBFromPool,
// which reported no limit) it took the only connection and waited for a
// second one for ever, and every message waited on the pool behind it.
func TestPurgeOnAPgxPoolOfOneConnectionIsRefused(t *testing.T) {
	t.Parallel()
	pool := openPool(t, "", "pool_of_one", func(c *pgxpool.Config) { c.MaxConns = 1 })
	f := newFixture(t, pool)
	ib := f.newInbox(pgxinbox.Config{})
	f.exec("INSERT INTO " + f.table + " (consumer, message_id, processed_at) VALUES ('billing', 'old', now() - interval '2 hours')")
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: ib.DB(), Dialect: inbox.PostgreSQL, Table: f.table, OlderThan: time.Hour}})
	if err != nil {
		t.Fatal(err)
	}
	if r := p.RunOnce(ctx); !errors.Is(r.Err, inbox.ErrInvalidConfig) {
		t.Errorf("purge round on a pgx pool of one connection: %v, want ErrInvalidConfig (not a wait for a second connection)", r.Err)
	}
}
