package inbox_test

import (
	"context"
	"database/sql/driver"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// purgeRows is how many expired rows TestPurgeDuringLoad purges on each
// database. The full size is a million; CI runs 100,000 so that the
// suite stays fast under -race. Run the full size with
//
//	go test -race -run TestPurgeDuringLoad -timeout 60m . -purge.rows=1000000
//
// or INBOX_TEST_PURGE_ROWS=1000000.
var purgeRows = flag.Int("purge.rows", envInt("INBOX_TEST_PURGE_ROWS", 100_000),
	"expired inbox rows that TestPurgeDuringLoad purges on each database (the full size: 1000000)")

// purgeRowsSet reports whether the purge's size was given (-purge.rows or
// INBOX_TEST_PURGE_ROWS).
func purgeRowsSet() bool {
	set := os.Getenv("INBOX_TEST_PURGE_ROWS") != ""
	flag.Visit(func(f *flag.Flag) { set = set || f.Name == "purge.rows" })
	return set
}

func envInt(name string, def int) int {
	if n, err := strconv.Atoi(os.Getenv(name)); err == nil && n > 0 {
		return n
	}
	return def
}

const (
	loadRecentRows = 10_000         // rows processed within the window: must all stay
	loadWindow     = 48 * time.Hour // OlderThan
	loadBatch      = 1000           // BatchSize
	// Expired rows are spread from loadWindow+25h to loadWindow+71h ago, so
	// that their whole UTC day is past the window too: the partitioned mode
	// drops a partition once its whole day is (it never drops early; it may
	// keep a row up to a day longer than Purge).
	loadExpiredMin  = loadWindow + 25*time.Hour
	loadExpiredSpan = 46 * time.Hour
	// Recent rows are spread from 1 minute to 10 minutes short of the window.
	loadRecentMin  = time.Minute
	loadRecentSpan = loadWindow - 11*time.Minute
)

// A purge during load deletes exactly the expired rows and disturbs no
// consumer: expired rows plus 10,000 recent ones; two consumers (handlers)
// run through a real router while two purgers run with batch size 1000. On
// every database (MySQL once: clientFoundRows changes only the claim's rows
// affected, which the middleware tests cover), in two modes:
//   - two-purgers: two Purger instances (two application instances, each
//     with its own pool). With the purge lock (PostgreSQL, MySQL/MariaDB) one
//     holds it and the other skips its rounds; on SQLite both purge at once.
//   - two-purge-calls: two plain Purge calls at once, without any lock,
//     competing for the same rows.
//
// The partitioned mode purges by dropping whole partitions, not by DELETE:
// there the purgers are Purger rounds (which drop partitions) and the plain
// calls are DropPartitions. A plain Purge (DELETE) on a partitioned table
// works but scans, for want of a processed_at index; it is not the mode's
// purge.
//
// It checks: exactly the expired rows are gone and each was counted once (the
// deleted counts add up to the expired rows), the recent rows are all there,
// every message was processed exactly once per consumer (redeliveries during
// the purge, and replays of the recent rows' messages, are skipped), every
// batch deleted at most 1000 rows (as the database reported for each
// statement and transaction, recorded between database/sql and the real
// driver), and no purge failed (a deadlock is retried). Consumers are proved
// to run while the purge runs: the first batch (or partition drop) waits
// until the consumers have handled more messages, and, with the lock, until
// the other instance has skipped a round. Latency is not asserted here: see
// BenchmarkPurgeUnderLoad. The purges run flat out (DutyCycle 1), the
// hardest case for the handlers; the paced default only adds pauses.
func TestPurgeDuringLoad(t *testing.T) {
	if testing.Short() {
		t.Skip("-short")
	}
	for _, tdb := range testDBs {
		if tdb.Name == "mysql-clientFoundRows" {
			continue
		}
		t.Run(tdb.Name, func(t *testing.T) {
			t.Parallel()
			rows := *purgeRows
			if tdb.Dialect == inbox.SQLite && raceEnabled && !purgeRowsSet() {
				// SQLite runs in this process, and under the race
				// detector its 100,000 rows took 70 s, most of CI's
				// longest package: a fifth is as many batches as the
				// behaviour needs.
				rows = 20_000
			}
			for _, mode := range []string{"two-purgers", "two-purge-calls"} {
				t.Run(mode, func(t *testing.T) {
					purgeDuringLoad(t, tdb, mode, rows)
				})
			}
		})
	}
}

func purgeDuringLoad(t *testing.T, tdb testDB, mode string, expired int) {
	ctx := context.Background()
	d := tdb.Dialect
	partitioned := d == inbox.PostgreSQLPartitioned

	// The consumers' pool, and one recording pool per purger.
	var db *sqlx.DB
	var dsn string
	switch d {
	case inbox.SQLite:
		path := filepath.Join(t.TempDir(), "inbox.db")
		db, dsn = openSQLite(t, path), "file:"+path+"?"+testdb.SQLiteParams
	case inbox.MySQL:
		db, dsn = tdb.Open(t), testdb.MySQLDSN()
	default:
		db, dsn = tdb.Open(t), testdb.PostgresDSN()
	}
	f := newFixture(t, db)
	if partitioned {
		// Daily partitions: the expired rows, 3 to 5 days old, must sit in
		// partitions that end before the 2-day window, which a week that
		// started 3 days ago does not.
		if err := inbox.InitializePartitions(ctx, db, f.inbox, inbox.PartitionDay); err != nil {
			t.Fatal(err)
		}
	}
	ib := f.newInbox(inbox.Config{Dialect: d})
	if partitioned {
		now := dbNow(t, db)
		if err := inbox.CreatePartitions(ctx, db, f.inbox, now.Add(-loadExpiredMin-loadExpiredSpan-24*time.Hour), 7); err != nil {
			t.Fatal(err)
		}
	}
	start := time.Now()
	fillInbox(t, db, d, f.inbox, "old", expired, loadExpiredMin, loadExpiredSpan)
	fillInbox(t, db, d, f.inbox, "recent", loadRecentRows, loadRecentMin, loadRecentSpan)
	if isPostgres(d) {
		exec(t, db, "ANALYZE "+f.inbox)
	}
	t.Logf("filled %d expired and %d recent rows in %v", expired, loadRecentRows, time.Since(start).Round(time.Millisecond))

	// Consumers: two handlers of one router on a GoChannel topic; each gets
	// every message.
	pubsub := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	t.Cleanup(func() { pubsub.Close() })
	var c calls
	var handled atomic.Int64
	handler := func(msg *message.Message) error {
		c.inc(message.HandlerNameFromCtx(msg.Context()) + "/" + msg.UUID)
		if err := f.writeBusinessRow(msg); err != nil {
			return err
		}
		handled.Add(1)
		return nil
	}
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(ib.Middleware)
		r.AddConsumerHandler("billing", "orders", pubsub, handler)
		r.AddConsumerHandler("shipping", "orders", pubsub, handler)
	})

	// The load: new messages, redeliveries of messages already processed,
	// and replays of the recent rows' messages, until the purge is over.
	stopLoad, loadDone := make(chan struct{}), make(chan struct{})
	var published, replayed []string
	go func() {
		defer close(loadDone)
		publish := func(uuid string) bool {
			if err := pubsub.Publish("orders", message.NewMessage(uuid, nil)); err != nil {
				t.Errorf("publish: %v", err)
				return false
			}
			return true
		}
		for i := 0; ; i++ {
			select {
			case <-stopLoad:
				return
			default:
			}
			uuid := watermill.NewUUID()
			if !publish(uuid) {
				return
			}
			published = append(published, uuid)
			if i%5 == 4 && !publish(published[len(published)/2]) {
				return
			}
			if i%10 == 9 {
				recent := fmt.Sprintf("recent-%d", 1+(i*7919)%loadRecentRows)
				if !publish(recent) {
					return
				}
				replayed = append(replayed, recent)
			}
		}
	}()
	waitFor(t, func() bool { return handled.Load() >= 20 })

	// The purgers, each on a recording pool of its own.
	var skipped atomic.Int64
	recs := []*purgeRecorder{{table: f.inbox}, {table: f.inbox}}
	pools := make([]*sqlx.DB, len(recs))
	for i, rec := range recs {
		pools[i] = openRecording(t, db.Driver(), dsn, db.DriverName(), rec)
		pools[i].SetMaxOpenConns(4)
		other := recs[1-i]
		rec.afterFirst = func() {
			// The purge is under way: let the consumers work in the middle
			// of it, and let the other purger show what it does meanwhile.
			base := handled.Load()
			gate(t, "consumers handle 20 more messages", func() bool { return handled.Load() >= base+20 })
			switch {
			case mode == "two-purgers" && d != inbox.SQLite:
				gate(t, "the other instance skips a round", func() bool { return skipped.Load() > 0 })
			case !partitioned && expired > 2*loadBatch: // two purges at once; each has a batch to run
				gate(t, "the other purge runs a batch", func() bool { return other.events() > 0 })
			}
		}
	}
	start = time.Now()
	var deleted atomic.Int64
	switch mode {
	case "two-purgers":
		runCtx, stop := context.WithCancel(ctx)
		var wg sync.WaitGroup
		var errs sync.Map
		for i := range pools {
			p, err := inbox.NewPurger(inbox.PurgerConfig{
				Purge:    inbox.PurgeConfig{DB: pools[i], Dialect: d, Table: f.inbox, OlderThan: loadWindow, BatchSize: loadBatch, DutyCycle: 1},
				Interval: 20 * time.Millisecond,
				OnRound: func(r inbox.PurgeRound) {
					if r.Err != nil && runCtx.Err() == nil {
						errs.Store(r.Err.Error(), r.Err)
					}
					if r.Skipped {
						skipped.Add(1)
					}
					deleted.Add(r.Deleted)
				},
			})
			if err != nil {
				t.Fatal(err)
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				_ = p.Run(runCtx)
			}()
		}
		failed := false
		gate(t, "the purgers delete every expired row", func() bool {
			errs.Range(func(_, err any) bool { failed = true; t.Errorf("purge round: %v", err); return false })
			return failed || deleted.Load() >= int64(expired)
		})
		stop()
		wg.Wait()
	case "two-purge-calls":
		var wg sync.WaitGroup
		for i := range pools {
			wg.Add(1)
			go func() {
				defer wg.Done()
				var n int64
				var err error
				if partitioned {
					var dropped []inbox.DroppedPartition
					dropped, err = inbox.DropPartitions(ctx, pools[i], f.inbox, loadWindow, nil)
					for _, p := range dropped {
						n += p.Rows
					}
				} else {
					n, err = inbox.Purge(ctx, inbox.PurgeConfig{DB: pools[i], Dialect: d, Table: f.inbox, OlderThan: loadWindow, BatchSize: loadBatch, DutyCycle: 1})
				}
				if err != nil {
					t.Errorf("purge %d: deleted %d, then %v", i, n, err)
				}
				deleted.Add(n)
			}()
		}
		wg.Wait()
	}
	purgeTook := time.Since(start)
	close(stopLoad)
	<-loadDone // every Publish returned: both consumers acked every message

	var batches []int64
	var failures []error
	var drops, deletes int
	for _, rec := range recs {
		batches = append(batches, rec.batches...)
		failures = append(failures, rec.failures...)
		drops += len(rec.drops)
		deletes += rec.deletes
	}
	t.Logf("purged %d rows in %v (%d batches, %d failed and retried, %d partitions dropped, %d rounds skipped) while the consumers handled %d messages",
		deleted.Load(), purgeTook.Round(time.Millisecond), len(batches), len(failures), drops, skipped.Load(), handled.Load())
	for _, err := range failures {
		if !inbox.PurgeRetryable(err) {
			t.Errorf("a batch failed with %v, which is not retried", err)
		}
	}

	if got := deleted.Load(); got != int64(expired) {
		t.Errorf("purges report %d rows deleted, want exactly the %d expired ones", got, expired)
	}
	if n := count(t, db, f.inbox, "message_id LIKE 'old-%'"); n != 0 {
		t.Errorf("%d expired rows left", n)
	}
	// A recent row belongs to one consumer (billing for even numbers): its
	// replay is skipped there, and processed once by the other consumer,
	// for which it is a new message.
	slices.Sort(replayed)
	replayed = slices.Compact(replayed)
	if n := count(t, db, f.inbox, "message_id LIKE 'recent-%'"); n != loadRecentRows+len(replayed) {
		t.Errorf("%d recent rows left, want all %d and the %d replays' rows", n-len(replayed), loadRecentRows, len(replayed))
	}
	if n, want := f.inboxRows(), loadRecentRows+2*len(published)+len(replayed); n != want {
		t.Errorf("inbox rows = %d, want %d (recent ones, 2 consumers × %d new messages, %d replays new to one consumer)",
			n, want, len(published), len(replayed))
	}
	if n, want := f.businessRows(), 2*len(published)+len(replayed); n != want {
		t.Errorf("business rows = %d, want %d", n, want)
	}
	for _, uuid := range published {
		for _, consumer := range []string{"billing", "shipping"} {
			if n := c.get(consumer + "/" + uuid); n != 1 {
				t.Fatalf("%s handled message %s %d times, want once", consumer, uuid, n)
			}
		}
	}
	for _, id := range replayed {
		owner, other := "shipping", "billing"
		if g, _ := strconv.Atoi(strings.TrimPrefix(id, "recent-")); g%2 == 0 {
			owner, other = other, owner
		}
		if n := c.get(owner + "/" + id); n != 0 {
			t.Fatalf("%s handled the replay of %s (processed within the window) %d times, want skipped", owner, id, n)
		}
		if n := c.get(other + "/" + id); n != 1 {
			t.Fatalf("%s handled %s (new to it) %d times, want once", other, id, n)
		}
	}
	if partitioned {
		if deletes != 0 || drops == 0 {
			t.Errorf("partitioned mode ran %d DELETE statements and dropped %d partitions; want drops only", deletes, drops)
		}
	} else {
		var sum int64
		for _, n := range batches {
			sum += n
		}
		if maxBatch := slices.Max(batches); maxBatch > loadBatch {
			t.Errorf("a batch deleted %d rows, want at most %d", maxBatch, loadBatch)
		}
		if sum != int64(expired) {
			t.Errorf("batches deleted %d rows in all, want %d", sum, expired)
		}
	}
	if mode == "two-purgers" && d != inbox.SQLite && skipped.Load() == 0 {
		t.Errorf("no round was skipped: the purge lock did not keep the second instance out")
	}
}

// gate waits until cond holds; after 10 minutes it fails the test.
func gate(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Minute)
	for !cond() {
		if time.Now().After(deadline) {
			t.Errorf("gave up waiting for: %s", what)
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// fillInbox adds n rows named <prefix>-1 .. <prefix>-n, alternately for the
// consumers billing and shipping, processed from minAge to minAge+span ago
// (evenly spread) by the database clock, in bulk statements.
func fillInbox(t *testing.T, db *sqlx.DB, d inbox.Dialect, table, prefix string, n int, minAge, span time.Duration) {
	t.Helper()
	step := span.Microseconds() / int64(n)
	switch d {
	case inbox.PostgreSQL, inbox.PostgreSQLPartitioned:
		exec(t, db, `INSERT INTO `+table+` (consumer, message_id, processed_at)
			SELECT CASE WHEN g % 2 = 0 THEN 'billing' ELSE 'shipping' END, $1 || '-' || g,
			       now() - ($2::bigint + g * $3::bigint) * interval '1 microsecond'
			FROM generate_series(1, $4) g`, prefix, minAge.Microseconds(), step, n)
	case inbox.SQLite:
		exec(t, db, `WITH RECURSIVE s(g) AS (SELECT 1 UNION ALL SELECT g + 1 FROM s WHERE g < ?4)
			INSERT INTO `+table+` (consumer, message_id, processed_at)
			SELECT CASE g % 2 WHEN 0 THEN 'billing' ELSE 'shipping' END, ?1 || '-' || g,
			       CAST(unixepoch('subsec') * 1000000 AS INTEGER) - (?2 + g * ?3)
			FROM s`, prefix, minAge.Microseconds(), step, n)
	default: // MySQL/MariaDB: literal rows (test-made names), 10,000 per statement
		for lo := 1; lo <= n; lo += 10_000 {
			var values []string
			for g := lo; g < min(n+1, lo+10_000); g++ {
				consumer := "shipping"
				if g%2 == 0 {
					consumer = "billing"
				}
				values = append(values, fmt.Sprintf("('%s', '%s-%d', UTC_TIMESTAMP(6) - INTERVAL %d MICROSECOND)",
					consumer, prefix, g, minAge.Microseconds()+int64(g)*step))
			}
			exec(t, db, "INSERT INTO "+table+" (consumer, message_id, processed_at) VALUES "+strings.Join(values, ", "))
		}
	}
}

// purgeRecorder is the sqlObserver of one purger's pool: it records every
// batch (a DELETE on the table outside a transaction, or a committed
// transaction that ran DELETEs on it: MySQL's batches) with the rows it
// deleted, and every partition dropped.
type purgeRecorder struct {
	table string
	// afterFirst, if set, runs once, on the purger's goroutine, after its
	// first batch or partition drop.
	afterFirst func()

	mu       sync.Mutex
	open     map[any]*openBatch // per connection, inside a transaction
	batches  []int64
	drops    []string
	deletes  int     // DELETE statements on the table
	failures []error // failed DELETEs and batch COMMITs: retried by Purge
	first    sync.Once
}

type openBatch struct {
	touched bool
	deleted int64
}

func (r *purgeRecorder) events() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.batches) + len(r.drops)
}

func (r *purgeRecorder) statement(any, string) {}

func (r *purgeRecorder) failed(conn any, query string, err error) {
	if errors.Is(err, context.Canceled) { // the test stopping the purgers
		return
	}
	// A driver returns driver.ErrBadConn only for a statement it did not
	// send (a connection found closed), and database/sql then runs the
	// statement again on another connection: the purge never sees it.
	// Seen once in CI on PostgreSQL (pgx), cause not known.
	if errors.Is(err, driver.ErrBadConn) {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	q := strings.TrimSpace(query)
	if r.isDelete(q) || (q == "COMMIT" && r.open[conn] != nil && r.open[conn].touched) {
		r.failures = append(r.failures, err)
	}
}

func (r *purgeRecorder) executed(conn any, query string, n int64) {
	q := strings.TrimSpace(query)
	isDelete := r.isDelete(q)
	isDrop := strings.HasPrefix(q, "DROP TABLE") && strings.Contains(q, r.table)
	if !isDelete && !isDrop {
		return
	}
	r.mu.Lock()
	event := false
	switch {
	case isDrop:
		r.drops = append(r.drops, q)
		event = true
	case r.open[conn] != nil:
		r.deletes++
		r.open[conn].touched = true
		r.open[conn].deleted += n
	default:
		r.deletes++
		r.batches = append(r.batches, n)
		event = true
	}
	r.mu.Unlock()
	if event {
		r.firstEvent()
	}
}

func (r *purgeRecorder) began(conn any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.open == nil {
		r.open = map[any]*openBatch{}
	}
	r.open[conn] = &openBatch{}
}

func (r *purgeRecorder) ended(conn any, committed bool) {
	r.mu.Lock()
	b := r.open[conn]
	delete(r.open, conn)
	event := committed && b != nil && b.touched
	if event {
		r.batches = append(r.batches, b.deleted)
	}
	r.mu.Unlock()
	if event {
		r.firstEvent()
	}
}

// isDelete reports whether q is a purge batch's DELETE of the table (on
// PostgreSQL in a WITH that returns the batch's count).
func (r *purgeRecorder) isDelete(q string) bool {
	return (strings.HasPrefix(q, "DELETE FROM") || strings.HasPrefix(q, "WITH batch AS (DELETE FROM")) && strings.Contains(q, r.table)
}

func (r *purgeRecorder) firstEvent() {
	r.first.Do(func() {
		if r.afterFirst != nil {
			r.afterFirst()
		}
	})
}
