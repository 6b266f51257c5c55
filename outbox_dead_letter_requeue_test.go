package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// deadLetterIDs returns the ids in ob's dead-letter table, in order.
func deadLetterIDs(t *testing.T, db *sqlx.DB, ob *inbox.Outbox) []int64 {
	t.Helper()
	var ids []int64
	if err := db.Select(&ids, "SELECT id FROM "+ob.DeadLetterTable()+" ORDER BY id"); err != nil {
		t.Fatal(err)
	}
	return ids
}

// deadLetterAll runs relay rounds until the dead-letter table holds n
// messages.
func deadLetterAll(t *testing.T, db *sqlx.DB, ob *inbox.Outbox, n int) {
	t.Helper()
	for range 50 {
		if len(deadLetterIDs(t, db, ob)) == n {
			return
		}
		ob.RelayOnce(context.Background())
	}
	t.Fatalf("the dead-letter table holds %d messages after 50 rounds, want %d", len(deadLetterIDs(t, db, ob)), n)
}

// rejectingOutbox returns an Outbox on a table of its own whose broker
// refuses every message for what it is (ErrMessageRejected), so that a
// relay round sets each aside at its first refusal (MaxAttempts 1).
func rejectingOutbox(t *testing.T, db *sqlx.DB, d inbox.Dialect) *inbox.Outbox {
	t.Helper()
	broker := newBrokerStub()
	broker.setRefuse(func(string, *message.Message) error {
		return fmt.Errorf("%w: the broker refuses the message", inbox.ErrMessageRejected)
	})
	return newTestOutbox(t, db, d, inbox.OutboxConfig{Publisher: broker, MaxAttempts: 1})
}

// Messages the broker refused until they were set aside go back to the
// outbox once the cause is fixed, chosen by id, by topic, or all, and the
// running relay sends them at once, each once, in their order, with their
// UUID, payload and metadata, so that the next consumer's inbox knows them.
// (Before, moving them back took hand-written SQL per database.)
func TestRequeuedDeadLettersAreSentWithTheirUUIDsAndMetadata(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		broker := newBrokerStub()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, MaxAttempts: 1, PollInterval: time.Hour})
		rejected := fmt.Errorf("%w: the topic does not take messages this size", inbox.ErrMessageRejected)
		broker.setRefuse(func(topic string, _ *message.Message) error {
			if topic == "payments" {
				return rejected
			}
			return nil
		})
		payments := writeOutbox(t, db, ob, "payments", 6)
		shipping := writeOutbox(t, db, ob, "shipping", 2)
		deadLetterAll(t, db, ob, 6)
		dead := deadLetterIDs(t, db, ob)
		if got := broker.uuids("shipping"); !slices.Equal(got, shipping) {
			t.Fatalf("shipping got %v, want %v", got, shipping)
		}
		if got := broker.uuids("payments"); len(got) != 0 {
			t.Fatalf("the broker took %d refused messages", len(got))
		}

		ctx := context.Background()
		for _, sel := range []inbox.DeadLetterSelection{{}, {All: true, Topic: "payments"}, {All: true, IDs: dead[:1]}} {
			if n, err := ob.RequeueDeadLetters(ctx, sel); !errors.Is(err, inbox.ErrInvalidConfig) || n != 0 {
				t.Errorf("RequeueDeadLetters(%+v) = %d, %v; want 0 and ErrInvalidConfig", sel, n, err)
			}
		}

		broker.setRefuse(nil) // the cause is fixed
		runCtx, stop := context.WithCancel(ctx)
		defer stop()
		go func() { _ = ob.Run(runCtx) }()
		requeue := func(sel inbox.DeadLetterSelection, want int) {
			t.Helper()
			n, err := ob.RequeueDeadLetters(ctx, sel)
			if err != nil || n != want {
				t.Fatalf("RequeueDeadLetters(%+v) = %d, %v; want %d and no error", sel, n, err, want)
			}
		}
		requeue(inbox.DeadLetterSelection{IDs: []int64{dead[1], dead[0], 1 << 40, dead[0]}}, 2) // unordered, one missing, one twice
		requeue(inbox.DeadLetterSelection{Topic: "shipping"}, 0)
		requeue(inbox.DeadLetterSelection{Topic: "shipping", IDs: dead[2:3]}, 0)
		requeue(inbox.DeadLetterSelection{Topic: "payments", IDs: dead[2:3]}, 1)
		requeue(inbox.DeadLetterSelection{All: true}, 3)
		requeue(inbox.DeadLetterSelection{All: true}, 0)

		deadline := time.Now().Add(10 * time.Second)
		for time.Now().Before(deadline) {
			if s, err := ob.Stats(ctx); err == nil && s.Pending == 0 && len(broker.uuids("payments")) >= len(payments) {
				break // sent and recorded
			}
			time.Sleep(5 * time.Millisecond)
		}
		if got := broker.uuids("payments"); !slices.Equal(got, payments) {
			t.Fatalf("after the requeues the running relay (PollInterval 1h) sent %v, want each once, in order: %v", got, payments)
		}
		for i, m := range broker.messages("payments") {
			if string(m.Payload) != fmt.Sprintf("payload %d", i) || m.Metadata.Get("n") != fmt.Sprint(i) {
				t.Errorf("requeued message %s arrived with payload %q and metadata %v", m.UUID, m.Payload, m.Metadata)
			}
		}
		if ids := deadLetterIDs(t, db, ob); len(ids) != 0 {
			t.Errorf("the dead-letter table still holds %v", ids)
		}
		stop()
		if err := ob.WaitStopped(ctx); err != nil {
			t.Fatal(err)
		}
		assertOutboxEmpty(t, ob)
	})
}

// Requeues that run at the same time (an operator's commands beside a
// service's), of all, of two topics whose dead letters alternate, and of
// the odd and the even ids, move each dead letter once: the outbox then
// holds each message once, and the dead-letter table none. On MariaDB two
// requeues of other ids deadlocked (each scanned the rows the other had
// locked) and failed; a chunk that loses such a race is tried again. A
// move of more than one transaction's worth (500) goes in several.
func TestConcurrentRequeuesMoveEachDeadLetterOnce(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		ob := rejectingOutbox(t, db, tdb.Dialect)
		var written []string
		for range 22 {
			written = append(written, writeOutbox(t, db, ob, "payments", 25)...)
			written = append(written, writeOutbox(t, db, ob, "refunds", 25)...)
		}
		n := len(written)
		deadLetterAll(t, db, ob, n)
		dead := deadLetterIDs(t, db, ob)
		var odd, even []int64
		for i, id := range dead {
			if i%2 == 0 {
				even = append(even, id)
			} else {
				odd = append(odd, id)
			}
		}
		sels := []inbox.DeadLetterSelection{{All: true}, {IDs: even}, {IDs: odd}, {Topic: "payments"}, {Topic: "refunds"}}
		names := []string{"all", "the even ids", "the odd ids", "payments", "refunds"}

		var wg sync.WaitGroup
		moved := make([]int, len(sels))
		errs := make([]error, len(sels))
		for i, sel := range sels {
			wg.Go(func() { moved[i], errs[i] = ob.RequeueDeadLetters(context.Background(), sel) })
		}
		wg.Wait()
		total := 0
		for i := range moved {
			if errs[i] != nil {
				t.Errorf("requeue of %s: %v (after moving %d)", names[i], errs[i], moved[i])
			}
			total += moved[i]
		}
		if total != n {
			t.Errorf("the requeues moved %v, %d in all, want %d", moved, total, n)
		}
		var uuids []string
		if err := db.Select(&uuids, "SELECT uuid FROM "+ob.Table()+" ORDER BY id"); err != nil {
			t.Fatal(err)
		}
		slices.Sort(uuids)
		want := slices.Clone(written)
		slices.Sort(want)
		if distinct := slices.Compact(slices.Clone(uuids)); len(uuids) != n || !slices.Equal(distinct, want) {
			t.Errorf("the outbox holds %d messages (%d distinct) after the requeues, want each of the %d once", len(uuids), len(distinct), n)
		}
		if ids := deadLetterIDs(t, db, ob); len(ids) != 0 {
			t.Errorf("the dead-letter table still holds %d", len(ids))
		}
	})
}

// On SQLite opened with deferred transactions (no _txlock=immediate),
// requeues from two processes at once (two pools on one file, as the inbox
// command beside a service) each move their dead letters without "database
// is locked": a transaction that read the dead letters first could not
// take the write lock once the other had written (SQLITE_BUSY_SNAPSHOT,
// which no busy timeout waits out).
func TestSQLiteRequeuesFromTwoProcessesWithDeferredTransactions(t *testing.T) {
	path := filepath.Join(t.TempDir(), "inbox.db")
	open := func() *sqlx.DB {
		db, err := sqlx.Open("sqlite", "file:"+path+"?_journal_mode=WAL&_busy_timeout=10000")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { db.Close() })
		return db
	}
	db, other := open(), open()
	ob := rejectingOutbox(t, db, inbox.SQLite)
	const n = 2000
	writeOutbox(t, db, ob, "payments", n)
	deadLetterAll(t, db, ob, n)

	var wg sync.WaitGroup
	moved := make([]int, 2)
	errs := make([]error, 2)
	for i, pool := range []*sqlx.DB{db, other} {
		wg.Go(func() {
			moved[i], errs[i] = inbox.RequeueDeadLetters(context.Background(), pool, inbox.SQLite, ob.Table(), inbox.DeadLetterSelection{All: true})
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("requeue from process %d: %v (after moving %d)", i, err, moved[i])
		}
	}
	if moved[0]+moved[1] != n || count(t, db, ob.Table(), "") != n || len(deadLetterIDs(t, db, ob)) != 0 {
		t.Errorf("moved %v, the outbox holds %d, the dead-letter table %d; want %d moved once", moved, count(t, db, ob.Table(), ""), len(deadLetterIDs(t, db, ob)), n)
	}
}

// Dead letters too large to move 500 in one statement before the
// statement timeout (they are often the messages the broker refused for
// their size) are moved in smaller chunks: the chunk halves after each
// timeout, as the relay's reads do. A move by topic or of all failed at
// the same 500 every time.
func TestRequeueOfDeadLettersThatOutlastTheStatementTimeoutMovesSmallerChunks(t *testing.T) {
	t.Parallel()
	db := testdb.OpenPostgres(t, "statement_timeout=600")
	ob := rejectingOutbox(t, db, inbox.PostgreSQL)
	const n = 60
	writeOutbox(t, db, ob, "payments", n)
	deadLetterAll(t, db, ob, n)
	// Each row copied back takes 30 ms: 60 in one statement outlast the
	// 600 ms statement timeout; 15 do not.
	fn := ob.Table() + "_slow"
	exec(t, db, "CREATE FUNCTION "+fn+"() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(0.03); RETURN NEW; END $$")
	t.Cleanup(func() { _, _ = db.Exec("DROP FUNCTION IF EXISTS " + fn + "() CASCADE") })
	exec(t, db, "CREATE TRIGGER slow BEFORE INSERT ON "+ob.Table()+" FOR EACH ROW EXECUTE FUNCTION "+fn+"()")

	for _, byID := range []bool{false, true} {
		sel := inbox.DeadLetterSelection{Topic: "payments"}
		if byID {
			sel = inbox.DeadLetterSelection{IDs: deadLetterIDs(t, db, ob)}
		}
		moved, err := ob.RequeueDeadLetters(context.Background(), sel)
		if err != nil || moved != n {
			t.Fatalf("RequeueDeadLetters(topic %q, %d ids) = %d, %v; want %d moved", sel.Topic, len(sel.IDs), moved, err, n)
		}
		if c := count(t, db, ob.Table(), ""); c != n {
			t.Fatalf("the outbox holds %d, want %d", c, n)
		}
		if !byID { // back to the dead-letter table for the next selection
			exec(t, db, "ALTER TABLE "+ob.Table()+" DISABLE TRIGGER slow")
			deadLetterAll(t, db, ob, n)
			exec(t, db, "ALTER TABLE "+ob.Table()+" ENABLE TRIGGER slow")
		}
	}
}
