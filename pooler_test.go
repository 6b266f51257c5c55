package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// The tests in this file run behind PgBouncer in transaction pooling mode
// with four server connections (.ci/pgbouncer), where each transaction may
// get another server connection: nothing the inbox runs may need a server
// session to outlive one transaction. Each runs with every driver setting
// the README names for a pooler (lib/pq's defaults, pgx exec and
// simple_protocol).

// forEachPooledDriver runs f as a parallel subtest for every driver setting,
// with a pool through PgBouncer.
func forEachPooledDriver(t *testing.T, f func(t *testing.T, drv testdb.PgBouncerDriver, db *sqlx.DB)) {
	t.Helper()
	for _, drv := range testdb.PgBouncerDrivers {
		t.Run(drv.Name, func(t *testing.T) {
			t.Parallel()
			f(t, drv, testdb.OpenPgBouncer(t, drv))
		})
	}
}

// pooledService is one service behind the pooler: its own pool, inbox
// table, business table and router with one handler.
type pooledService struct {
	*fixture
	feed  *feed
	calls calls
	fail  func(msg *message.Message) error // if set, called first; an error fails the handler
}

func newPooledService(t *testing.T, db *sqlx.DB, d inbox.Dialect) *pooledService {
	t.Helper()
	s := &pooledService{fixture: newFixture(t, db), feed: newFeed()}
	ib := s.newInbox(inbox.Config{Dialect: d})
	runRouter(t, func(r *message.Router) {
		r.AddConsumerHandler("billing", "orders", s.feed, func(msg *message.Message) error {
			if s.fail != nil {
				if err := s.fail(msg); err != nil {
					return err
				}
			}
			s.calls.inc(msg.UUID)
			return s.writeBusinessRow(msg)
		})
		r.AddMiddleware(ib.Middleware)
	})
	return s
}

// deliverAll delivers every message from its own goroutine at once and
// returns how many were acked.
func (s *pooledService) deliverAll(t *testing.T, msgs []*message.Message) int {
	t.Helper()
	var acked atomic.Int64
	var wg sync.WaitGroup
	for _, m := range msgs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if s.feed.deliver(t, m) {
				acked.Add(1)
			}
		}()
	}
	wg.Wait()
	return int(acked.Load())
}

// Every message delivered twice, concurrently, is processed once; on the
// partitioned dialect too.
func TestPooler_DuplicatesAreSkipped(t *testing.T) {
	forEachPooledDriver(t, func(t *testing.T, _ testdb.PgBouncerDriver, db *sqlx.DB) {
		for _, d := range []inbox.Dialect{inbox.PostgreSQL, inbox.PostgreSQLPartitioned} {
			t.Run(d.String(), func(t *testing.T) {
				s := newPooledService(t, db, d)
				msgs := newMessages(40)
				if acked := s.deliverAll(t, append(msgs, msgs...)); acked != 80 {
					t.Errorf("acked %d of 80 deliveries", acked)
				}
				for _, m := range msgs {
					if n := s.calls.get(m.UUID); n != 1 {
						t.Errorf("message %s: %d handler calls, want 1", m.UUID, n)
					}
				}
				if b, i := s.businessRows(), s.inboxRows(); b != 40 || i != 40 {
					t.Errorf("business rows %d, inbox rows %d, want 40 and 40", b, i)
				}
			})
		}
	})
}

// The same message delivered from eight goroutines at once runs the handler
// once, and every delivery is acked: the duplicates wait on the key's row
// lock, whatever server connection they got, and are then skipped.
func TestPooler_SameMessageFromEightGoroutines(t *testing.T) {
	forEachPooledDriver(t, func(t *testing.T, _ testdb.PgBouncerDriver, db *sqlx.DB) {
		s := newPooledService(t, db, inbox.PostgreSQL)
		msg := message.NewMessage(watermill.NewUUID(), nil)
		same := make([]*message.Message, 8)
		for i := range same {
			same[i] = msg
		}
		if acked := s.deliverAll(t, same); acked != 8 {
			t.Errorf("acked %d of 8 deliveries", acked)
		}
		if n := s.calls.get(msg.UUID); n != 1 {
			t.Errorf("%d handler calls, want 1", n)
		}
		if b, i := s.businessRows(), s.inboxRows(); b != 1 || i != 1 {
			t.Errorf("business rows %d, inbox rows %d, want 1 and 1", b, i)
		}
	})
}

// A handler error rolls back the claim and the business write: the message
// is nacked, and its redelivery processes it.
func TestPooler_HandlerErrorRollsBack(t *testing.T) {
	forEachPooledDriver(t, func(t *testing.T, _ testdb.PgBouncerDriver, db *sqlx.DB) {
		s := newPooledService(t, db, inbox.PostgreSQL)
		var failed sync.Map
		errFirst := errors.New("first attempt fails")
		s.fail = func(msg *message.Message) error {
			if _, seen := failed.LoadOrStore(msg.UUID, true); !seen {
				// Written, then rolled back with the claim.
				if err := s.writeBusinessRow(msg); err != nil {
					return err
				}
				return errFirst
			}
			return nil
		}
		msgs := newMessages(20)
		if acked := s.deliverAll(t, msgs); acked != 0 {
			t.Errorf("acked %d first attempts, want 0 (each failed)", acked)
		}
		if b, i := s.businessRows(), s.inboxRows(); b != 0 || i != 0 {
			t.Errorf("after failed attempts: business rows %d, inbox rows %d, want 0 and 0", b, i)
		}
		if acked := s.deliverAll(t, msgs); acked != 20 {
			t.Errorf("acked %d redeliveries, want 20", acked)
		}
		if b, i := s.businessRows(), s.inboxRows(); b != 20 || i != 20 {
			t.Errorf("after redelivery: business rows %d, inbox rows %d, want 20 and 20", b, i)
		}
	})
}

// Two services, each with its own pool and inbox table, behind one pooler
// that shares its server connections between them: each processes every
// message once, and writes only into its own tables.
func TestPooler_TwoServicesBehindOnePool(t *testing.T) {
	forEachPooledDriver(t, func(t *testing.T, drv testdb.PgBouncerDriver, db *sqlx.DB) {
		a := newPooledService(t, db, inbox.PostgreSQL)
		b := newPooledService(t, testdb.OpenPgBouncer(t, drv), inbox.PostgreSQL)
		msgs := newMessages(60)
		var wg sync.WaitGroup
		for _, s := range []*pooledService{a, b} {
			for range 2 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					if acked := s.deliverAll(t, msgs); acked != len(msgs) {
						t.Errorf("acked %d of %d", acked, len(msgs))
					}
				}()
			}
		}
		wg.Wait()
		for name, s := range map[string]*pooledService{"a": a, "b": b} {
			calls := 0
			for _, m := range msgs {
				calls += s.calls.get(m.UUID)
			}
			if calls != 60 {
				t.Errorf("service %s: %d handler calls for 60 messages delivered twice, want 60", name, calls)
			}
			if bz, i := s.businessRows(), s.inboxRows(); bz != 60 || i != 60 {
				t.Errorf("service %s: business rows %d, inbox rows %d, want 60 and 60", name, bz, i)
			}
		}
	})
}

// Two instances' Purgers that take turns, while other clients use the same
// pooler, each get the lock when the other does not hold it, and a Purger
// skips its round while the other holds it. A lock that outlived its round
// would make the next instance skip; a lock released on another server
// connection than it was taken on would stay held.
func TestPooler_PurgersTakeTurns(t *testing.T) {
	forEachPooledDriver(t, func(t *testing.T, drv testdb.PgBouncerDriver, db *sqlx.DB) {
		f := newFixture(t, db)
		f.newInbox(inbox.Config{})
		other := testdb.OpenPgBouncer(t, drv)
		newPurger := func(db *sqlx.DB) *inbox.Purger {
			p, err := inbox.NewPurger(inbox.PurgerConfig{
				// Flat out: the test is about the lock's turns; a paced
				// round only holds the lock's server connection longer.
				Purge: inbox.PurgeConfig{DB: db, Table: f.inbox, OlderThan: time.Hour, BatchSize: 7, DutyCycle: 1},
			})
			if err != nil {
				t.Fatal(err)
			}
			return p
		}
		purgers := []*inbox.Purger{newPurger(db), newPurger(other)}

		ctx, stopLoad := context.WithCancel(context.Background())
		var load sync.WaitGroup
		for _, pool := range []*sqlx.DB{db, other} {
			load.Add(1)
			go func() { // other clients of the pooler, in and out of transactions
				defer load.Done()
				for ctx.Err() == nil {
					tx, err := pool.BeginTxx(ctx, nil)
					if err != nil {
						continue
					}
					_, _ = tx.ExecContext(ctx, "SELECT pg_sleep(0.001), $1::int", 1)
					_ = tx.Rollback()
					_, _ = pool.ExecContext(ctx, "SELECT 1")
				}
			}()
		}
		defer func() { stopLoad(); load.Wait() }()

		for i := range 30 {
			insertRows(t, db, inbox.PostgreSQL, f.inbox, "billing", fmt.Sprintf("old-%d", i), 10, 2*time.Hour)
			round := purgers[i%2].RunOnce(context.Background())
			if round.Err != nil || round.Skipped || round.Deleted != 10 {
				t.Errorf("round %d (instance %d): %+v, want 10 rows deleted", i, i%2, round)
			}
		}

		release, got, err := inbox.PurgeLock(context.Background(), db, purgers[0])
		if !got || err != nil {
			t.Fatalf("instance 0 takes the lock: %v %v", got, err)
		}
		if round := purgers[1].RunOnce(context.Background()); !round.Skipped || round.Err != nil {
			t.Errorf("instance 1 while instance 0 holds the lock: %+v, want skipped", round)
		}
		if err := release(); err != nil {
			t.Fatal(err)
		}
		if round := purgers[1].RunOnce(context.Background()); round.Skipped || round.Err != nil {
			t.Errorf("instance 1 after instance 0 released the lock: %+v, want a round", round)
		}
	})
}

// Every statement the inbox runs outside a message's transaction works
// behind the pooler: the schema's creation from several starters at once,
// its verification, the stats, the dry run and the purge itself.
func TestPooler_StatementsOutsideTheMessageTransaction(t *testing.T) {
	forEachPooledDriver(t, func(t *testing.T, _ testdb.PgBouncerDriver, db *sqlx.DB) {
		ctx := context.Background()
		table := "inbox_" + randomSuffix()
		dropLater(t, db, table)
		ib, err := inbox.New(inbox.Config{DB: db, Table: table, Dialect: inbox.PostgreSQL})
		if err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		for range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := ib.InitializeSchema(ctx); err != nil {
					t.Errorf("InitializeSchema: %v", err)
				}
			}()
		}
		wg.Wait()
		if err := ib.Verify(ctx); err != nil {
			t.Errorf("Verify: %v", err)
		}
		insertRows(t, db, inbox.PostgreSQL, table, "billing", "old", 25, 2*time.Hour)
		insertRows(t, db, inbox.PostgreSQL, table, "billing", "new", 5, time.Minute)
		if _, err := inbox.EstimateRows(ctx, db, inbox.PostgreSQL, table); err != nil {
			t.Errorf("EstimateRows: %v", err)
		}
		st, err := inbox.Stats(ctx, db, inbox.PostgreSQL, table)
		if err != nil || st.Rows != 30 || st.Consumers["billing"] != 30 || st.SizeBytes <= 0 {
			t.Errorf("Stats = %+v, %v; want 30 rows of billing and a size", st, err)
		}
		cfg := inbox.PurgeConfig{DB: db, Dialect: inbox.PostgreSQL, Table: table, OlderThan: time.Hour, BatchSize: 10, Consumer: "billing"}
		if n, err := inbox.CountExpired(ctx, cfg); n != 25 || err != nil {
			t.Errorf("CountExpired = %d, %v; want 25", n, err)
		}
		if n, err := inbox.Purge(ctx, cfg); n != 25 || err != nil {
			t.Errorf("Purge = %d, %v; want 25", n, err)
		}
		if n := count(t, db, table, ""); n != 5 {
			t.Errorf("rows left %d, want 5", n)
		}
	})
}

// A partitioned inbox's partitions are created, and dropped past the
// window, behind the pooler, by DropPartitions and by a Purger round.
func TestPooler_PartitionsAreMaintained(t *testing.T) {
	forEachPooledDriver(t, func(t *testing.T, _ testdb.PgBouncerDriver, db *sqlx.DB) {
		ctx := context.Background()
		table := "inbox_" + randomSuffix()
		t.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + table + " CASCADE") })
		newPartitionedInbox(t, db, table, nil)
		now := dbNow(t, db)
		if err := inbox.CreatePartitions(ctx, db, table, now.AddDate(0, 0, -6), 4); err != nil {
			t.Fatal(err)
		}
		exec(t, db, "INSERT INTO "+table+" VALUES ('billing', 'old', now() - interval '5 days')")
		dropped, err := inbox.DropPartitions(ctx, db, table, 72*time.Hour, nil)
		if err != nil || len(dropped) == 0 {
			t.Fatalf("DropPartitions = %v, %v; want the partitions older than 3 days", dropped, err)
		}
		var rows int64
		for _, d := range dropped {
			rows += d.Rows
		}
		if rows != 1 {
			t.Errorf("dropped partitions held %d rows, want 1", rows)
		}
		if err := inbox.CreatePartitions(ctx, db, table, now.AddDate(0, 0, -6), 2); err != nil {
			t.Fatal(err)
		}
		p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{
			DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table, OlderThan: 72 * time.Hour,
		}})
		if err != nil {
			t.Fatal(err)
		}
		if round := p.RunOnce(ctx); round.Err != nil || len(round.DroppedPartitions) != 2 {
			t.Errorf("Purger round = %+v, want the two old partitions dropped", round)
		}
	})
}

// Concurrent DropPartitions calls behind a pooler with as few server
// connections as callers all finish: a caller waiting for the lock holds no
// server connection (it polls), so the holder gets the second one it works
// on. A caller that blocked in pg_advisory_xact_lock held one each, and the
// pool deadlocked.
func TestPooler_ConcurrentDropPartitionsDoNotDeadlockThePool(t *testing.T) {
	forEachPooledDriver(t, func(t *testing.T, drv testdb.PgBouncerDriver, db *sqlx.DB) {
		table := "inbox_" + randomSuffix()
		t.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + table + " CASCADE") })
		newPartitionedInbox(t, db, table, nil)
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := inbox.CreatePartitions(ctx, db, table, dbNow(t, db).AddDate(0, 0, -8), 4); err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		var dropped atomic.Int64
		for range 4 { // the test PgBouncer's default_pool_size
			caller := testdb.OpenPgBouncer(t, drv)
			wg.Add(1)
			go func() {
				defer wg.Done()
				parts, err := inbox.DropPartitions(ctx, caller, table, 72*time.Hour, nil)
				if err != nil {
					t.Errorf("DropPartitions: %v", err)
				}
				dropped.Add(int64(len(parts)))
			}()
		}
		wg.Wait()
		if n := dropped.Load(); n != 4 {
			t.Errorf("partitions dropped by the four calls together: %d, want 4 (each once)", n)
		}
	})
}
