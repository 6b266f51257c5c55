package inbox

import (
	"context"
	"database/sql"
	"sync"
	"time"
)

// writerQueue hands this process's SQLite write transactions on one
// *sql.DB the database's write lock in the order they asked for it.
//
// SQLite lets one transaction write at a time (BEGIN IMMEDIATE takes the
// write lock for the whole transaction, https://sqlite.org/lang_transaction.html),
// and a transaction that finds it taken polls: the busy handler sleeps 1,
// 2, 5, … up to 100 ms between tries (sqlite3.c, sqliteDefaultBusyCallback).
// With eight handlers and the outbox relay on one database the lock passed
// to whoever polled at the right moment: the relay's DELETE lost for
// hundreds of milliseconds at a time, and the outbox grew to thousands of
// rows. Queued here first, each transaction begins when the one before it
// ends, in order, with no sleep; other processes on the same file still
// meet the busy handler.
type writerQueue chan struct{}

// sqliteWriters holds one writerQueue per *sql.DB that an Inbox or an
// Outbox has begun a SQLite transaction on. A *sql.DB lives as long as the
// process in the common case; its entry stays after it is closed.
var sqliteWriters sync.Map // *sql.DB → writerQueue

// sqliteWriterQueue returns db's writerQueue.
func sqliteWriterQueue(db *sql.DB) writerQueue {
	if q, ok := sqliteWriters.Load(db); ok {
		return q.(writerQueue)
	}
	q, _ := sqliteWriters.LoadOrStore(db, make(writerQueue, 1))
	return q.(writerQueue)
}

// writerQueueMaxWait bounds the wait in a writerQueue. A transaction that
// waited this long begins without its place and meets SQLite's busy handler
// as it would without the queue, so that a write lock held for good (a
// handler that waits for another delivery on the same database) ends in
// the driver's "database is locked" after its busy timeout, as before,
// rather than in a wait as long as the message's context.
const writerQueueMaxWait = 5 * time.Second

// enter waits for the transactions queued before it to end (Go's channel
// senders are served in order) and returns the place to leave when the
// transaction ends; after writerQueueMaxWait it returns no place (nil
// queue). It returns ctx's error if ctx ends first.
func (q writerQueue) enter(ctx context.Context) (queuedWrite, error) {
	select {
	case q <- struct{}{}:
		return queuedWrite{q}, nil
	default:
	}
	t := time.NewTimer(writerQueueMaxWait)
	defer t.Stop()
	select {
	case q <- struct{}{}:
		return queuedWrite{q}, nil
	case <-t.C:
		return queuedWrite{}, nil
	case <-ctx.Done():
		return queuedWrite{}, ctx.Err()
	}
}

// queuedWrite is a place in a writerQueue, left at most once.
type queuedWrite struct {
	q writerQueue // nil: not in a queue, or already left
}

// leave leaves the queue if w is in one.
func (w *queuedWrite) leave() {
	if w.q != nil {
		<-w.q
		w.q = nil
	}
}
