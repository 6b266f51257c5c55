package conformance

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/internal/testrouter"
)

// The cases on how a delivery's transaction ends when the handler's
// statements end it or break it, and on what leaves through the outbox
// (Semantics 5 and 14).

func (b Backend) isPostgres() bool {
	return b.Dialect == inbox.PostgreSQL || b.Dialect == inbox.PostgreSQLPartitioned
}

// Semantics 5: a handler that ends the inbox transaction itself with a
// statement and returns nil is nacked, never acked: after a ROLLBACK
// nothing is written and the redelivery processes the message; after a
// COMMIT what it committed (its row and the claim) stays, and the
// redelivery is a duplicate. The error wraps ErrTransactionEnded and is
// not transient; on MySQL/MariaDB and SQLite a ROLLBACK cannot be told
// from a rollback the database made itself after an error the handler
// ignored (a deadlock, a full disk), and wraps ErrTxRolledBack.
func handlerEndsTransaction(t *testing.T, b Backend) {
	for _, tc := range []struct {
		statement string
		committed bool
	}{{"ROLLBACK", false}, {"COMMIT", true}} {
		t.Run(tc.statement, func(t *testing.T) {
			f := newFixture(t, b)
			f.start(Options{})
			f.ignoredStatement.Store(&tc.statement)
			msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order":15}`))
			if f.deliver(msg) {
				t.Fatalf("acked a message whose handler ran %s itself", tc.statement)
			}
			err := f.outcomes.Last()
			switch {
			case (b.Dialect == inbox.MySQL || b.Dialect == inbox.SQLite) && !tc.committed:
				if !errors.Is(err, inbox.ErrTxRolledBack) {
					t.Errorf("router got %v, want ErrTxRolledBack", err)
				}
			case !errors.Is(err, inbox.ErrTransactionEnded) || inbox.IsTransient(err):
				t.Errorf("router got %v (transient %v), want ErrTransactionEnded, not transient", err, inbox.IsTransient(err))
			}
			rows := 0
			if tc.committed {
				rows = 1
			}
			f.expect(msg.UUID, 1, rows, rows)
			f.expectNoConnHeld()
			if n := f.afterCommits.Load(); n != 0 {
				t.Errorf("%d AfterCommit functions ran, want 0: the inbox did not commit", n)
			}
			f.ignoredStatement.Store(nil)
			if !f.deliver(msg) {
				t.Fatalf("redelivery nacked: %v", f.outcomes.Last())
			}
			calls := int32(2)
			if tc.committed {
				calls = 1 // a duplicate of what the handler committed
			}
			f.expect(msg.UUID, calls, 1, 1)
			f.expectNoConnHeld()
		})
	}
}

// Semantics 5: a handler that ignores the error of a failed statement and
// returns nil is acked only if its transaction committed. PostgreSQL
// aborts the transaction at the failed statement and turns the COMMIT into
// a ROLLBACK: the delivery is nacked with the driver's error (pgx's
// ErrTxCommitRollback, through database/sql too), nothing is written, and the redelivery processes it. MySQL/MariaDB and SQLite keep
// the transaction after a failed statement: the delivery commits (the
// handler's row and the claim) and is acked.
func ignoredStatementError(t *testing.T, b Backend) {
	f := newFixture(t, b)
	f.start(Options{})
	missing := "INSERT INTO conf_missing_" + testdb.RandomSuffix() + " (id) VALUES (1)"
	f.ignoredStatement.Store(&missing)
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order":16}`))
	acked := f.deliver(msg)
	if !b.isPostgres() {
		if !acked {
			t.Fatalf("nacked although the transaction could commit: %v", f.outcomes.Last())
		}
		f.expect(msg.UUID, 1, 1, 1)
		f.expectNoConnHeld()
		return
	}
	if acked {
		t.Fatal("acked a message whose transaction PostgreSQL rolled back at COMMIT")
	}
	if err := f.outcomes.Last(); !errors.Is(err, pgx.ErrTxCommitRollback) {
		t.Errorf("router got %v, want pgx.ErrTxCommitRollback", err)
	}
	f.expect(msg.UUID, 1, 0, 0)
	f.expectNoConnHeld()
	f.ignoredStatement.Store(nil)
	if !f.deliver(msg) {
		t.Fatalf("redelivery nacked: %v", f.outcomes.Last())
	}
	f.expect(msg.UUID, 2, 1, 1)
}

// recordingBroker is the broker of the outbox relay: it keeps what it is
// given.
type recordingBroker struct {
	mu   sync.Mutex
	msgs []*message.Message
}

func (r *recordingBroker) Publish(topic string, msgs ...*message.Message) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, m := range msgs {
		if topic == outputTopic {
			r.msgs = append(r.msgs, m)
		}
	}
	return nil
}

func (r *recordingBroker) Close() error { return nil }

func (r *recordingBroker) published() []*message.Message {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]*message.Message(nil), r.msgs...)
}

// Semantics 14: a handler's output, written to the outbox in the message's
// transaction, reaches the broker through the relay if and only if that
// transaction commits: nothing for a failed try, one message (UUID,
// payload and metadata as written) for the processed one, nothing more
// for a duplicate, and the outbox holds no row once it left.
func outputsIffCommitted(t *testing.T, b Backend) {
	f := newFixture(t, b)
	broker := &recordingBroker{}
	table := "conf_outbox_" + testdb.RandomSuffix()
	testdb.DropLater(t, b.DB, table)
	testdb.DropLater(t, b.DB, table+"_dead")
	ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: b.DB, Dialect: b.Dialect, Table: table, Publisher: broker})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := ob.InitializeSchema(ctx); err != nil {
		t.Fatal(err)
	}
	relay := func() {
		t.Helper()
		if r := ob.RelayOnce(ctx); r.Err != nil {
			t.Fatal(r.Err)
		}
	}
	f.emit = true
	f.start(Options{Outbox: ob})
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order":17}`))

	f.handlerFails.Store(true)
	if f.deliver(msg) {
		t.Fatal("a failing handler's message was acked")
	}
	relay()
	if n := len(broker.published()); n != 0 {
		t.Fatalf("%d outputs of a rolled-back delivery reached the broker, want 0", n)
	}
	f.handlerFails.Store(false)
	for i := range 2 { // processed, then a duplicate
		if !f.deliver(msg) {
			t.Fatalf("delivery %d nacked: %v", i+1, f.outcomes.Last())
		}
		relay()
	}
	got := broker.published()
	if len(got) != 1 {
		t.Fatalf("%d outputs reached the broker, want 1", len(got))
	}
	if out := got[0]; out.UUID != msg.UUID+"-out" || string(out.Payload) != "invoice for "+msg.UUID || out.Metadata.Get("source") != msg.UUID {
		t.Errorf("output %s %q %v, want the handler's message as written", out.UUID, out.Payload, out.Metadata)
	}
	if n := f.count(table, ""); n != 0 {
		t.Errorf("%d outbox rows after the relay, want 0", n)
	}
	f.expect(msg.UUID, 2, 1, 1)
	f.expectNoConnHeld()
}

// publisherFunc is a message.Publisher that calls itself.
type publisherFunc func(topic string, msgs ...*message.Message) error

func (p publisherFunc) Publish(topic string, msgs ...*message.Message) error {
	return p(topic, msgs...)
}
func (publisherFunc) Close() error { return nil }

// Semantics 12: a message context that ends after the handler returned nil
// (a Timeout middleware's deadline, a router closing), here while the
// messages it returned are written to the outbox before the COMMIT, does
// not roll the transaction back: the COMMIT runs under its own bound, the
// message is acked and its AfterCommit functions run.
func contextEndsAfterHandler(t *testing.T, b Backend) {
	f := newFixture(t, b)
	var cancel atomic.Pointer[context.CancelFunc]
	var written atomic.Int32
	mw := f.newMiddleware(Options{OutboxPublisher: publisherFunc(func(_ string, msgs ...*message.Message) error {
		(*cancel.Load())() // the handler has returned: its context ends now
		written.Add(int32(len(msgs)))
		return nil
	})})
	cancelling := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			ctx, c := context.WithCancel(msg.Context())
			defer c()
			cancel.Store(&c)
			msg.SetContext(ctx)
			return h(msg)
		}
	}
	in := testrouter.NewFeed()
	testrouter.Start(t, func(r *message.Router) {
		r.AddMiddleware(cancelling, middleware.Recoverer, mw)
		r.AddHandler("billing", "orders", in, outputTopic, gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{}),
			func(msg *message.Message) ([]*message.Message, error) {
				inbox.AfterCommit(msg.Context(), func() { f.afterCommits.Add(1) })
				if err := b.Write(msg, f.business); err != nil {
					return nil, err
				}
				return []*message.Message{message.NewMessage(msg.UUID+"-out", nil)}, nil
			})
	})
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order":18}`))
	if !in.Deliver(t, msg) {
		t.Fatal("nacked a message whose context ended after its handler returned nil")
	}
	if n := written.Load(); n != 1 {
		t.Errorf("%d returned messages written to the outbox, want 1", n)
	}
	if e, i := f.count(f.business, ""), f.count(f.inbox, ""); e != 1 || i != 1 {
		t.Errorf("business rows %d, inbox rows %d; want 1 and 1 (committed)", e, i)
	}
	if n := f.afterCommits.Load(); n != 1 {
		t.Errorf("%d AfterCommit functions ran, want 1", n)
	}
	f.expectNoConnHeld()
}

// Semantics 9: processed_at comes from the database's clock in UTC, and so
// does the purge's cutoff, whatever the process's time zone (CI runs the
// suite again under other TZ values): a row just processed reads as now,
// a purge of rows older than an hour leaves it, and (one table: the
// partitioned dialect drops whole partitions instead) a purge of rows older
// than a microsecond takes it.
func databaseClock(t *testing.T, b Backend) {
	f := newFixture(t, b)
	f.start(Options{})
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order":19}`))
	if !f.deliver(msg) {
		t.Fatalf("nacked: %v", f.outcomes.Last())
	}
	ctx := context.Background()
	st, err := inbox.Stats(ctx, b.DB, b.Dialect, f.inbox)
	if err != nil {
		t.Fatal(err)
	}
	if off := time.Since(st.Newest); st.Newest.Location() != time.UTC || off < -time.Minute || off > time.Minute {
		t.Errorf("processed_at reads %v, %v from now; want now, in UTC", st.Newest, off)
	}
	purge := func(olderThan time.Duration) int64 {
		t.Helper()
		n, err := inbox.Purge(ctx, inbox.PurgeConfig{DB: b.DB, Dialect: b.Dialect, Table: f.inbox, OlderThan: olderThan})
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := purge(time.Hour); n != 0 || f.count(f.inbox, "") != 1 {
		t.Errorf("a purge of rows older than an hour deleted %d, left %d; want 0 and 1", n, f.count(f.inbox, ""))
	}
	if b.Dialect == inbox.PostgreSQLPartitioned {
		return
	}
	time.Sleep(10 * time.Millisecond) // the row is now older than 1 µs by any clock
	if n := purge(time.Microsecond); n != 1 || f.count(f.inbox, "") != 0 {
		t.Errorf("a purge of rows older than 1µs deleted %d, left %d; want 1 and 0", n, f.count(f.inbox, ""))
	}
}

// A claim that no partition accepts (PostgreSQLPartitioned, when nothing
// made partitions ahead for a week) is a fault of the table, not of the
// message: it is nacked, transient (a poison queue filter keeps it) and
// wraps ErrIncompatibleTable, the handler not called; once partitions
// exist, the redelivery is processed. It was poisoned, and every message of
// the topic with it.
func claimWithoutPartition(t *testing.T, b Backend) {
	if b.Dialect != inbox.PostgreSQLPartitioned {
		t.Skip("only a partitioned table can lack a partition for the current time")
	}
	f := newFixture(t, b)
	f.start(Options{})
	var parts []string
	if err := b.DB.Select(&parts, "SELECT inhrelid::regclass::text FROM pg_inherits WHERE inhparent = to_regclass($1)", f.inbox); err != nil {
		t.Fatal(err)
	}
	for _, p := range parts {
		f.exec("DROP TABLE " + p)
	}
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order":21}`))
	if f.deliver(msg) {
		t.Fatal("a message whose claim no partition accepts was acked")
	}
	if err := f.outcomes.Last(); !inbox.IsTransient(err) || !errors.Is(err, inbox.ErrIncompatibleTable) {
		t.Errorf("nacked with %v, want a transient error wrapping ErrIncompatibleTable", err)
	}
	f.expect(msg.UUID, 0, 0, 0)
	var now time.Time
	if err := b.DB.Get(&now, "SELECT now()"); err != nil {
		t.Fatal(err)
	}
	if err := inbox.CreatePartitions(context.Background(), b.DB, f.inbox, now.AddDate(0, 0, -1), 3); err != nil {
		t.Fatal(err)
	}
	if !f.deliver(msg) {
		t.Fatalf("the redelivery once partitions exist was nacked: %v", f.outcomes.Last())
	}
	f.expect(msg.UUID, 1, 1, 1)
	f.expectNoConnHeld()
}
