package jetstreamretention_test

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/jetstreamretention"
)

// runRouter runs a Watermill router with one handler, "billing", behind the
// inbox, reading the JetStream consumer named durable through sub, until
// the returned stop is called (or t ends).
func runRouter(t *testing.T, ib *inbox.Inbox, sub *jsSubscriber, calls *atomic.Int32) (stop func()) {
	t.Helper()
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	router.AddMiddleware(ib.Middleware)
	router.AddConsumerHandler("billing", "orders", sub, func(*message.Message) error {
		calls.Add(1)
		return nil
	})
	done := make(chan error, 1)
	go func() { done <- router.Run(context.Background()) }()
	select {
	case <-router.Running():
	case err := <-done:
		t.Fatalf("router: %v", err)
	}
	var stopped bool
	stop = func() {
		if stopped {
			return
		}
		stopped = true
		if err := router.Close(); err != nil {
			t.Errorf("router close: %v", err)
		}
		if err := <-done; err != nil {
			t.Errorf("router run: %v", err)
		}
	}
	t.Cleanup(stop)
	return stop
}

// replay creates a durable consumer that delivers the whole stream from the
// start (DeliverAll), as a new consumer, a reset or a re-created durable
// does, and returns a Watermill subscriber on it.
func replay(t *testing.T, s jetstream.Stream, durable string) *jsSubscriber {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := s.CreateConsumer(ctx, jetstream.ConsumerConfig{Durable: durable, DeliverPolicy: jetstream.DeliverAllPolicy,
		AckPolicy: jetstream.AckExplicitPolicy, AckWait: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return newJSSubscriber(c)
}

func inboxRows(t *testing.T, db *sqlx.DB) int {
	t.Helper()
	var n int
	if err := db.Get(&n, "SELECT count(*) FROM watermill_inbox"); err != nil {
		t.Fatal(err)
	}
	return n
}

func sqliteInbox(t *testing.T) (*sqlx.DB, *inbox.Inbox) {
	t.Helper()
	db := testdb.OpenSQLite(t, filepath.Join(t.TempDir(), "inbox.db"))
	ib, err := inbox.New(inbox.Config{DB: db})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ib.Close() })
	if err := ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	return db, ib
}

// Messages of a stream with MaxAge 1h, processed through a Watermill
// router, then replayed from the stream by a new DeliverAll consumer. With
// the window from the stream (1h + a 10m margin), a purge asked for 30m is
// refused and deletes nothing, a purge with the safe window deletes only
// rows older than 1h10m, and the replay is acked without calling the
// handler again. A purge that ignores the window deletes the rows, and the
// next replay is processed a second time: the rows the window kept are
// what made the replay a no-op.
func TestPurgeKeepsRowsOfMessagesTheStreamCanReplay(t *testing.T) {
	t.Parallel()
	js, _ := connect(t)
	stream := createStream(t, js, jetstream.StreamConfig{MaxAge: time.Hour})
	subject := stream.CachedInfo().Config.Subjects[0]
	db, ib := sqliteInbox(t)
	for i := range 3 { // processed 2h ago: past the safe window
		if _, err := db.Exec("INSERT INTO watermill_inbox (consumer, message_id, processed_at) VALUES ('billing', ?, CAST(unixepoch('subsec') * 1000000 AS INTEGER) - ?)",
			fmt.Sprint("expired-", i), (2 * time.Hour).Microseconds()); err != nil {
			t.Fatal(err)
		}
	}
	const n = 5
	ctx := context.Background()
	for range n {
		msg := nats.NewMsg(subject)
		msg.Header.Set(uuidHeader, watermill.NewUUID())
		if _, err := js.PublishMsg(ctx, msg); err != nil {
			t.Fatal(err)
		}
	}

	var calls atomic.Int32
	first := replay(t, stream, "first")
	stop := runRouter(t, ib, first, &calls)
	first.waitAcked(t, n)
	stop()
	if got := calls.Load(); got != n {
		t.Fatalf("first delivery: %d handler calls, want %d", got, n)
	}

	src, err := jetstreamretention.New(jetstreamretention.Config{JetStream: js, Streams: []string{stream.CachedInfo().Config.Name}, Margin: 10 * time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	deleted, err := inbox.Purge(ctx, inbox.PurgeConfig{DB: db, OlderThan: 30 * time.Minute, Window: src})
	if !errors.Is(err, inbox.ErrWindowTooShort) || deleted != 0 || inboxRows(t, db) != n+3 {
		t.Fatalf("30m under the 1h10m safe window: deleted %d, %v, %d rows left; want ErrWindowTooShort and all %d rows", deleted, err, inboxRows(t, db), n+3)
	}
	deleted, err = inbox.Purge(ctx, inbox.PurgeConfig{DB: db, Window: src})
	if err != nil || deleted != 3 || inboxRows(t, db) != n {
		t.Fatalf("safe window: deleted %d, %v, %d rows left; want the 3 rows older than 1h10m deleted", deleted, err, inboxRows(t, db))
	}

	again := replay(t, stream, "replay")
	stop = runRouter(t, ib, again, &calls)
	again.waitAcked(t, n)
	stop()
	if got := calls.Load(); got != n {
		t.Errorf("replay within the window: %d handler calls in all, want %d (every replayed message skipped)", got, n)
	}

	// Control: a purge without the window source deletes the rows the
	// window kept, and the stream's next replay is processed again.
	if deleted, err := inbox.Purge(ctx, inbox.PurgeConfig{DB: db, OlderThan: time.Microsecond}); err != nil || deleted != n {
		t.Fatalf("purge without a window: deleted %d, %v; want %d", deleted, err, n)
	}
	third := replay(t, stream, "third")
	stop = runRouter(t, ib, third, &calls)
	third.waitAcked(t, n)
	stop()
	if got := calls.Load(); got != 2*n {
		t.Errorf("replay after the rows were purged: %d handler calls in all, want %d", got, 2*n)
	}
}

// A stream without MaxAge keeps messages for as long as no size limit
// pushes them out: its source stops every purge with ErrNoSafeWindow, even
// one asked for a very long window, and nothing is deleted.
func TestStreamWithoutMaxAgeStopsThePurge(t *testing.T) {
	t.Parallel()
	js, _ := connect(t)
	withAge := createStream(t, js, jetstream.StreamConfig{MaxAge: time.Hour})
	forever := createStream(t, js, jetstream.StreamConfig{MaxMsgs: 1_000_000})
	db, _ := sqliteInbox(t)
	if _, err := db.Exec("INSERT INTO watermill_inbox (consumer, message_id, processed_at) VALUES ('billing', 'old', CAST(unixepoch('subsec') * 1000000 AS INTEGER) - ?)",
		(1000 * 24 * time.Hour).Microseconds()); err != nil {
		t.Fatal(err)
	}
	src, err := jetstreamretention.New(jetstreamretention.Config{JetStream: js,
		Streams: []string{withAge.CachedInfo().Config.Name, forever.CachedInfo().Config.Name}})
	if err != nil {
		t.Fatal(err)
	}
	deleted, err := inbox.Purge(context.Background(), inbox.PurgeConfig{DB: db, OlderThan: 365 * 24 * time.Hour, Window: src})
	if !errors.Is(err, jetstreamretention.ErrNoSafeWindow) || deleted != 0 || inboxRows(t, db) != 1 {
		t.Errorf("purge: deleted %d, %v, %d rows left; want ErrNoSafeWindow and the row kept", deleted, err, inboxRows(t, db))
	}
}
