package inbox_test

// The pool's connections and server sessions when handlers panic or write
// through the pool instead of the transaction.

import (
	"context"
	"database/sql/driver"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// Panics leave no connection in use and no session in a transaction: a pool
// of 2 connections, Recoverer outside, five handlers that write and then
// panic, all at once, then one normal message. No connection stays in use, no
// session of the pool is left in a transaction, nothing of the panicking
// handlers is written, every panic is reported to OnFailed, and the normal
// message is processed before a 2 s deadline (a bound on the wait, not a
// measurement). The same for the other user code the inbox calls inside the
// transaction: the Outbox factory and the outbox publisher of the handler's
// returned messages.
func TestConnections_PanicsLeaveNoneInUseOrInATransaction(t *testing.T) {
	t.Parallel()
	t.Run("handlers", func(t *testing.T) {
		t.Parallel()
		forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
			panicsAndThePool(t, tdb, db)
		})
	})
	t.Run("outbox publisher", func(t *testing.T) {
		t.Parallel()
		forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
			outboxPanicsAndThePool(t, tdb, db)
		})
	})
}

func panicsAndThePool(t *testing.T, tdb testDB, db *sqlx.DB) {
	f := newFixture(t, db)
	var hooks hookCounts
	ib := f.newInbox(hooks.config(inbox.Config{}))
	db.SetMaxOpenConns(2)
	probe := tdb.Open(t) // inspects the sessions from outside the pool
	if tdb.Dialect == inbox.SQLite {
		probe = db
	}
	var mu sync.Mutex
	var pids []int64
	var keys []inboxKey
	const panickers = 5
	feeds := make([]*feed, panickers)
	normal := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(middleware.Recoverer, ib.Middleware)
		for i := range feeds {
			feeds[i] = newFeed()
			r.AddConsumerHandler(fmt.Sprintf("panicker%d", i), "orders", feeds[i], func(msg *message.Message) error {
				var pid int64
				if isPostgres(tdb.Dialect) {
					tx, _ := inbox.TxFromContext(msg.Context())
					if err := tx.GetContext(msg.Context(), &pid, "SELECT pg_backend_pid()"); err != nil {
						return err
					}
				}
				mu.Lock()
				pids = append(pids, pid)
				keys = append(keys, inboxKey{message.HandlerNameFromCtx(msg.Context()), msg.UUID})
				mu.Unlock()
				if err := f.writeBusinessRow(msg); err != nil {
					return err
				}
				panic("handler bug")
			})
		}
		r.AddConsumerHandler("normal", "orders", normal, f.writeBusinessRow)
	})

	ctx, cancel := context.WithTimeout(context.Background(), caseTimeout)
	defer cancel()
	var wg sync.WaitGroup
	for i, in := range feeds {
		wg.Go(func() {
			acked, err := in.send(ctx, delivery(message.NewMessage(watermill.NewUUID(), nil), fmt.Sprint(i)))
			if err != nil || acked {
				t.Errorf("panicking handler %d: acked %v (%v), want a nack", i, acked, err)
			}
		})
	}
	wg.Wait()
	if inUse := db.Stats().InUse; inUse != 0 {
		t.Errorf("connections in use after the panics = %d, want 0", inUse)
	}
	if n := leftInTransaction(t, tdb.Dialect, probe, f.inbox, pids, keys); n != 0 {
		t.Errorf("%d sessions of the pool still in a transaction after the panics", n)
	}
	if f.businessRows() != 0 || f.inboxRows() != 0 || hooks.failed.Load() != panickers {
		t.Errorf("after the panics: business rows %d, inbox rows %d, OnFailed %d; want 0, 0, %d",
			f.businessRows(), f.inboxRows(), hooks.failed.Load(), panickers)
	}

	bound, cancelBound := context.WithTimeout(ctx, 2*time.Second)
	defer cancelBound()
	msg := message.NewMessage(watermill.NewUUID(), nil)
	if acked, err := normal.send(bound, msg); err != nil || !acked {
		t.Fatalf("normal message: acked %v (%v); want it processed within 2 s", acked, err)
	}
	if count(t, db, f.business, "consumer = ?", "normal") != 1 || hooks.processed.Load() != 1 {
		t.Errorf("normal message: business rows %d, commits %d; want 1 and 1",
			count(t, db, f.business, "consumer = ?", "normal"), hooks.processed.Load())
	}
	if inUse := db.Stats().InUse; inUse != 0 {
		t.Errorf("connections in use at the end = %d, want 0", inUse)
	}
}

func outboxPanicsAndThePool(t *testing.T, tdb testDB, db *sqlx.DB) {
	f := newFixture(t, db)
	var hooks hookCounts
	var panicAt atomic.Value // "factory", "publish" or ""
	panicAt.Store("factory")
	ib := f.newInbox(hooks.config(inbox.Config{Outbox: func(tx *sqlx.Tx) (message.Publisher, error) {
		switch panicAt.Load() {
		case "factory":
			panic("outbox factory bug")
		case "publish":
			return panicPublisher{}, nil
		}
		return &poisonSink{}, nil
	}}))
	db.SetMaxOpenConns(2)
	probe := tdb.Open(t)
	if tdb.Dialect == inbox.SQLite {
		probe = db
	}
	var mu sync.Mutex
	var pids []int64
	var keys []inboxKey
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(middleware.Recoverer, ib.Middleware)
		r.AddHandler("billing", "orders", in, "invoices", &poisonSink{}, func(msg *message.Message) ([]*message.Message, error) {
			var pid int64
			if isPostgres(tdb.Dialect) {
				tx, _ := inbox.TxFromContext(msg.Context())
				if err := tx.GetContext(msg.Context(), &pid, "SELECT pg_backend_pid()"); err != nil {
					return nil, err
				}
			}
			mu.Lock()
			pids = append(pids, pid)
			keys = append(keys, inboxKey{"billing", msg.UUID})
			mu.Unlock()
			if err := f.writeBusinessRow(msg); err != nil {
				return nil, err
			}
			return []*message.Message{message.NewMessage(watermill.NewUUID(), nil)}, nil
		})
	})
	ctx, cancel := context.WithTimeout(context.Background(), caseTimeout)
	defer cancel()
	for i, where := range []string{"factory", "publish"} {
		panicAt.Store(where)
		if acked, err := in.send(ctx, message.NewMessage(watermill.NewUUID(), nil)); err != nil || acked {
			t.Fatalf("panic in the outbox %s: acked %v (%v), want a nack", where, acked, err)
		}
		if inUse := db.Stats().InUse; inUse != 0 {
			t.Errorf("panic in the outbox %s: connections in use = %d, want 0", where, inUse)
		}
		if got := hooks.failed.Load(); got != int32(i+1) {
			t.Errorf("panic in the outbox %s: OnFailed calls = %d, want %d", where, got, i+1)
		}
	}
	if n := leftInTransaction(t, tdb.Dialect, probe, f.inbox, pids, keys); n != 0 {
		t.Errorf("%d sessions of the pool still in a transaction after the panics", n)
	}
	if f.businessRows() != 0 || f.inboxRows() != 0 {
		t.Errorf("after the panics: business rows %d, inbox rows %d; want 0 and 0", f.businessRows(), f.inboxRows())
	}
	panicAt.Store("")
	bound, cancelBound := context.WithTimeout(ctx, 2*time.Second)
	defer cancelBound()
	if acked, err := in.send(bound, message.NewMessage(watermill.NewUUID(), nil)); err != nil || !acked {
		t.Fatalf("normal message: acked %v (%v); want it processed within 2 s", acked, err)
	}
	if f.businessRows() != 1 || f.inboxRows() != 1 || hooks.processed.Load() != 1 {
		t.Errorf("normal message: business rows %d, inbox rows %d, commits %d; want 1, 1, 1",
			f.businessRows(), f.inboxRows(), hooks.processed.Load())
	}
}

// poolWritesInFlight is how many messages the pool-write tests have in
// flight, and their pool size.
const poolWritesInFlight = 4

// A handler that writes through the pool instead of the transaction deadlocks
// the pool until a deadline ends it, and its pool writes are not rolled back.
// A pool of 4 connections, 4 messages in flight (as from 4 partitions), a
// handler that writes with the *sqlx.DB. Each inbox transaction holds one of
// the 4 connections while its handler waits for a fifth: a deadlock that
// nothing inside the process breaks. (On SQLite, with the recommended
// _txlock=immediate, one transaction holds the write lock and its handler
// waits for a connection that the 3 others hold while they wait, in BEGIN,
// for that lock: only busy_timeout ends it, and the pool write would then
// wait for its own transaction's lock.)
//
// The way out is a deadline on the message context: Watermill's
// middleware.Timeout outside the inbox. When it fires, database/sql rolls the
// inbox transaction back (its context ended) and the handler's pool call
// fails: the message is nacked with a transient error, and its redelivery is
// processed. The inbox cannot see what the handler does with the pool, so the
// library documents it (use the transaction; size the pool above the messages
// in flight; put Timeout outside the inbox) instead of guessing.
func TestConnections_HandlerWritesThroughThePoolDeadlockWithoutADeadline(t *testing.T) {
	t.Parallel()
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		s := startPoolWriter(t, db)
		ctx, cancel := context.WithTimeout(context.Background(), caseTimeout)
		defer cancel()
		// The messages' own contexts, which the test cancels once the
		// deadlock is proven: the only way out, as nothing else ends.
		stuck, unstick := context.WithCancel(context.Background())
		defer unstick()
		baseWaits := db.Stats().WaitCount
		msgs := newPoolWriteMessages()
		for i, m := range msgs {
			m.SetContext(stuck)
			msgs[i] = m
		}
		done := make(chan []bool, 1)
		go func() { done <- sendAtOnce(t, ctx, s.in, msgs) }()

		// Deadlocked: every connection is in use by an inbox transaction
		// and handlers wait for a connection. On the servers all 4
		// handlers wait; on SQLite the one holding the write lock waits
		// while the other 3 wait for that lock in BEGIN.
		wantEntered := int32(poolWritesInFlight)
		if tdb.Dialect == inbox.SQLite {
			wantEntered = 1
		}
		for {
			st := db.Stats()
			if s.entered.Load() == wantEntered && st.InUse == poolWritesInFlight && st.WaitCount-baseWaits >= int64(wantEntered) {
				break
			}
			select {
			case acked := <-done:
				t.Fatalf("deliveries finished without a deadlock: acked %v, errors %v", acked, s.out.failures())
			case <-ctx.Done():
				t.Fatalf("never deadlocked: entered %d, stats %+v", s.entered.Load(), db.Stats())
			case <-time.After(5 * time.Millisecond):
			}
		}
		if s.hooks.processed.Load()+s.hooks.failed.Load() != 0 {
			t.Fatalf("a message finished while deadlocked")
		}
		unstick()
		acked := <-done
		for i, a := range acked {
			if err := s.out.failures(); a || len(err) != poolWritesInFlight {
				t.Fatalf("message %d: acked %v; errors %v; want every message nacked", i, a, err)
			}
		}
		for _, err := range s.out.failures() {
			if !errors.Is(err, context.Canceled) || !inbox.IsTransient(err) {
				t.Errorf("err %v, want context.Canceled (transient)", err)
			}
		}
		if s.f.businessRows() != 0 || s.f.inboxRows() != 0 || len(s.sink.poisoned()) != 0 {
			t.Errorf("business rows %d, inbox rows %d, poisoned %d; want 0, 0, 0",
				s.f.businessRows(), s.f.inboxRows(), len(s.sink.poisoned()))
		}
	})
}

// middleware.Timeout outside the inbox ends the deadlock of handlers that
// write through the pool: the messages it ends are nacked with a transient
// error, and their redeliveries, once the handler writes through its
// transaction, are processed.
func TestConnections_HandlerWritesThroughThePoolTimeoutOutsideEndsTheDeadlock(t *testing.T) {
	t.Parallel()
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		s := startPoolWriter(t, db, middleware.Timeout(500*time.Millisecond))
		ctx, cancel := context.WithTimeout(context.Background(), caseTimeout)
		defer cancel()
		msgs := newPoolWriteMessages()
		acked := sendAtOnce(t, ctx, s.in, msgs) // bounded: the deadline ends the deadlock
		if t.Failed() {
			return
		}
		nacked := 0
		for _, a := range acked {
			if !a {
				nacked++
			}
		}
		if nacked == 0 {
			t.Fatalf("every message acked; the first deadline to fire must nack its message")
		}
		// Every nack is transient, and the deadline is what broke the
		// deadlock. On MariaDB a handler's own pool call may instead
		// fail with driver.ErrBadConn (seen once in CI under load; the
		// exact path through database/sql and go-sql-driver, as other
		// deliveries' deadlines close their connections, is not known):
		// accepted there, from the handler only (not the inbox's own
		// statements, whose errors start with "inbox:"). So is the
		// handler's pool call that was dialling a new connection when the
		// deadline passed: the net package reports a dial that its
		// context's deadline ended as an "i/o timeout", a net.Error, not
		// as context.DeadlineExceeded (seen here on PostgreSQL under load).
		deadline := false
		for _, err := range s.out.failures() {
			deadline = deadline || errors.Is(err, context.DeadlineExceeded)
			fromHandler := !strings.HasPrefix(err.Error(), "inbox:")
			badConn := tdb.Dialect == inbox.MySQL && errors.Is(err, driver.ErrBadConn) && fromHandler
			var netErr net.Error
			dialTimeout := errors.As(err, &netErr) && netErr.Timeout() && fromHandler
			if !inbox.IsTransient(err) || !(errors.Is(err, context.DeadlineExceeded) || badConn || dialTimeout) {
				t.Errorf("err %v, want context.DeadlineExceeded (or the handler's dial timeout, or on MariaDB its driver.ErrBadConn), transient", err)
			}
		}
		if !deadline {
			t.Errorf("no nack by the deadline: %v", s.out.failures())
		}
		// The handler is fixed to write through its transaction; the
		// redeliveries are processed. Each is redelivered after a nack, as
		// a broker does: on a loaded machine a redelivery can itself meet
		// the 500 ms deadline (a transient nack).
		s.pool.Store(false)
		for i, m := range msgs {
			for a := acked[i]; !a; {
				var err error
				if a, err = s.in.send(ctx, m.Copy()); err != nil {
					t.Fatalf("redelivery of message %d: %v, last errors %v", i, err, s.out.failures())
				}
			}
		}
		if s.f.inboxRows() != poolWritesInFlight || count(t, db, s.f.business, "id LIKE ?", "%:tx") != poolWritesInFlight || len(s.sink.poisoned()) != 0 {
			t.Errorf("inbox rows %d, transactional business rows %d, poisoned %d; want %d, %d, 0",
				s.f.inboxRows(), count(t, db, s.f.business, "id LIKE ?", "%:tx"), len(s.sink.poisoned()), poolWritesInFlight, poolWritesInFlight)
		}
		t.Logf("%d of %d nacked by the deadline; pool rows kept: %d", nacked, poolWritesInFlight, count(t, db, s.f.business, "id LIKE ?", "%:pool"))
	})
}

// A handler's writes through the pool are not the inbox's: they stay when
// the handler fails, and the redelivery writes them again.
func TestConnections_HandlerPoolWritesAreNotRolledBack(t *testing.T) {
	t.Parallel()
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if tdb.Dialect == inbox.SQLite {
			t.Skip("on SQLite a pool write cannot happen while the inbox transaction holds the write lock (see the tests above)")
		}
		f := newFixture(t, db)
		ib := f.newInbox(inbox.Config{})
		var fail atomic.Bool
		fail.Store(true)
		in := newFeed()
		runRouter(t, func(r *message.Router) {
			r.AddMiddleware(ib.Middleware)
			r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
				if _, err := db.ExecContext(msg.Context(), db.Rebind("INSERT INTO "+f.business+" (id, consumer) VALUES (?, ?)"),
					watermill.NewUUID(), msg.UUID); err != nil {
					return err
				}
				if fail.Load() {
					return errors.New("card declined")
				}
				return nil
			})
		})
		msg := message.NewMessage(watermill.NewUUID(), nil)
		if in.deliver(t, msg) {
			t.Fatal("failed delivery acked")
		}
		if f.inboxRows() != 0 || f.businessRows() != 1 {
			t.Errorf("after the failure: inbox rows %d, business rows %d; the pool write is kept (1), the inbox row is not (0)",
				f.inboxRows(), f.businessRows())
		}
		fail.Store(false)
		if !in.deliver(t, msg) {
			t.Fatal("redelivery nacked")
		}
		if got := count(t, db, f.business, "consumer = ?", msg.UUID); got != 2 {
			t.Errorf("business rows for the message = %d; the documented outcome is 2 (one per handler run)", got)
		}
	})
}

// poolWriteSetup is a router whose handler, while pool is true, writes
// through db (and through its transaction); otherwise only through its
// transaction.
type poolWriteSetup struct {
	f     *fixture
	hooks *hookCounts
	in    *feed
	out   *outcomes
	sink  *poisonSink
	pool  *atomic.Bool
	// entered counts handler calls that reached the pool write.
	entered *atomic.Int32
}

// startPoolWriter starts a poolWriteSetup on db with poolWritesInFlight
// connections, behind outer.
func startPoolWriter(t *testing.T, db *sqlx.DB, outer ...message.HandlerMiddleware) poolWriteSetup {
	db.SetMaxOpenConns(poolWritesInFlight)
	s := poolWriteSetup{f: newFixture(t, db), hooks: &hookCounts{}, in: newFeed(), out: &outcomes{}, pool: &atomic.Bool{}, entered: &atomic.Int32{}}
	s.pool.Store(true)
	ib := s.f.newInbox(s.hooks.config(inbox.Config{}))
	var poison message.HandlerMiddleware
	poison, s.sink = poisonUnlessTransient(t)
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(poison, s.out.Middleware)
		r.AddMiddleware(outer...)
		r.AddMiddleware(ib.Middleware)
		r.AddConsumerHandler("billing", "orders", s.in, func(msg *message.Message) error {
			if s.pool.Load() {
				s.entered.Add(1)
				// In flight together: the pool write starts once all 4
				// connections are taken by the deliveries (their
				// transactions, or on SQLite BEGIN waiting for the lock).
				for db.Stats().InUse < poolWritesInFlight {
					select {
					case <-msg.Context().Done():
						return msg.Context().Err()
					case <-time.After(time.Millisecond):
					}
				}
				if _, err := db.ExecContext(msg.Context(), db.Rebind("INSERT INTO "+s.f.business+" (id, consumer) VALUES (?, ?)"),
					msg.UUID+":pool", "billing"); err != nil {
					return err
				}
			}
			return s.f.insertRow(msg, msg.UUID+":tx")
		})
	})
	return s
}

// sendAtOnce delivers msgs at once and returns whether each was acked.
func sendAtOnce(t *testing.T, ctx context.Context, in *feed, msgs []*message.Message) []bool {
	acked := make([]bool, len(msgs))
	var wg sync.WaitGroup
	for i, m := range msgs {
		wg.Go(func() {
			var err error
			if acked[i], err = in.send(ctx, m); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	return acked
}

// newPoolWriteMessages returns poolWritesInFlight new messages.
func newPoolWriteMessages() []*message.Message {
	msgs := make([]*message.Message, poolWritesInFlight)
	for i := range msgs {
		msgs[i] = message.NewMessage(watermill.NewUUID(), nil)
	}
	return msgs
}
