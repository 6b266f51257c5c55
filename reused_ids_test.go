package inbox_test

import (
	"errors"
	"fmt"
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
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// reusedIDRouter runs ib in a router whose handler writes the business row
// and counts its calls; rec records what the router got back.
func reusedIDRouter(t *testing.T, f *fixture, ib *inbox.Inbox) (*feed, *calls, *recorder) {
	t.Helper()
	var c calls
	rec := &recorder{}
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(rec.Middleware, ib.Middleware)
		r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
			c.inc(msg.UUID)
			return f.writeBusinessRow(msg)
		})
	})
	return in, &c, rec
}

// An out-of-range ReusedIDs is a configuration error.
func TestReusedIDsOutOfRangeRefused(t *testing.T) {
	_, err := inbox.New(inbox.Config{DB: sqliteDB(t), ReusedIDs: inbox.ReusedIDCheck(7)})
	if !errors.Is(err, inbox.ErrInvalidConfig) || !strings.Contains(err.Error(), "ReusedIDCheck(7)") {
		t.Errorf("New with ReusedIDs 7: %v, want ErrInvalidConfig naming it", err)
	}
}

// Behind PgBouncer in transaction mode, with every driver and query mode
// the pooler supports: the fingerprint is stored and a reused id refused.
func TestReusedIDBehindAPooler(t *testing.T) {
	forEachPooledDriver(t, func(t *testing.T, _ testdb.PgBouncerDriver, db *sqlx.DB) {
		f := newFixture(t, db)
		var counts hookCounts
		ib := f.newInbox(counts.config(inbox.Config{Dialect: inbox.PostgreSQL}))
		in, _, rec := reusedIDRouter(t, f, ib)
		id := watermill.NewUUID()
		for _, label := range []string{"first delivery", "its duplicate"} {
			if !in.deliver(t, message.NewMessage(id, []byte("order 1"))) {
				t.Fatalf("%s nacked: %v", label, rec.last())
			}
		}
		if in.deliver(t, message.NewMessage(id, []byte("order 2"))) || !errors.Is(rec.last(), inbox.ErrMessageIDReused) {
			t.Fatalf("reused id: %v, want refused with ErrMessageIDReused", rec.last())
		}
		counts.expect(t, 1, 1, 1, 1)
	})
}

// A fingerprint column that cannot hold a fingerprint as given (PostgreSQL
// text; MySQL binary(32), which pads it) is refused with
// ErrIncompatibleTable and its fix, by Verify and before any claim (a
// transient nack, nothing written); once fixed, messages are processed.
// SQLite stores a BLOB as it is in a column of any type, but not in a
// STRICT table, which enforces TEXT.
func TestReusedIDWrongFingerprintColumnTypeRefused(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		f := newFixture(t, db)
		f.newInbox(inbox.Config{}) // creates the table
		switch tdb.Dialect {
		case inbox.MySQL:
			exec(t, db, "ALTER TABLE "+f.inbox+" MODIFY fingerprint binary(32) NULL")
		case inbox.SQLite:
			// The same table, STRICT, its column TEXT (SQLite changes
			// neither in place).
			var ddl []string
			if err := db.Select(&ddl, "SELECT sql FROM sqlite_master WHERE tbl_name = ? ORDER BY type DESC", f.inbox); err != nil || len(ddl) != 2 {
				t.Fatalf("the table's DDL: %q, %v", ddl, err)
			}
			exec(t, db, "DROP TABLE "+f.inbox)
			table := strings.Replace(strings.Replace(ddl[0], "fingerprint  BLOB", "fingerprint  TEXT", 1), ") WITHOUT ROWID", ") WITHOUT ROWID, STRICT", 1)
			exec(t, db, table)
			exec(t, db, ddl[1]) // the purge index
		default:
			exec(t, db, "ALTER TABLE "+f.inbox+" ALTER COLUMN fingerprint TYPE text")
		}
		cfg := inbox.Config{DB: db, Table: f.inbox, Dialect: tdb.Dialect}
		ib, err := inbox.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		err = ib.Verify(t.Context())
		if !errors.Is(err, inbox.ErrIncompatibleTable) || !strings.Contains(err.Error(), "fingerprint") {
			t.Fatalf("Verify: %v, want ErrIncompatibleTable naming the fingerprint column", err)
		}
		in, c, rec := reusedIDRouter(t, f, ib)
		msg := message.NewMessage(watermill.NewUUID(), []byte("order 1"))
		if in.deliver(t, msg) {
			t.Fatal("a delivery was acked while the fingerprint column is wrong")
		}
		if err := rec.last(); !errors.Is(err, inbox.ErrIncompatibleTable) || !inbox.IsTransient(err) {
			t.Errorf("delivery error %v, want a transient one wrapping ErrIncompatibleTable", err)
		}
		if c.get(msg.UUID) != 0 || f.inboxRows() != 0 {
			t.Errorf("handler calls %d, inbox rows %d, want none", c.get(msg.UUID), f.inboxRows())
		}
		fix := err.Error()[strings.Index(err.Error(), "fix it with: ")+len("fix it with: "):]
		for stmt := range strings.SplitSeq(fix[:strings.Index(fix, ";")], ", then ") {
			exec(t, db, stmt)
		}
		if !in.deliver(t, msg) {
			t.Fatalf("delivery after the fix nacked: %v", rec.last())
		}
		if !ib.ReusedIDsDetected() {
			t.Error("reused ids not detected once the column was fixed")
		}
	})
}

// Through Inbox.Middlewares with a poison queue: a reused id is poisoned at
// its first attempt (Retry does not run it again in place: it cannot
// succeed), reported once, and acked.
func TestReusedIDPoisonedAtOnceByTheMiddlewareStack(t *testing.T) {
	t.Parallel()
	db := sqliteDB(t)
	f := newFixture(t, db)
	var counts hookCounts
	ib := f.newInbox(counts.config(inbox.Config{}))
	sink := &poisonSink{}
	mws, err := ib.Middlewares(inbox.MiddlewaresConfig{PoisonQueue: sink})
	if err != nil {
		t.Fatal(err)
	}
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(mws...)
		r.AddConsumerHandler("billing", "orders", in, f.writeBusinessRow)
	})
	id := watermill.NewUUID()
	if !in.deliver(t, message.NewMessage(id, []byte("order 1"))) || !in.deliver(t, message.NewMessage(id, []byte("order 2"))) {
		t.Fatal("a delivery was nacked; want the reused id poisoned and acked")
	}
	if got := sink.poisoned(); len(got) != 1 || string(got[0].Payload) != "order 2" {
		t.Errorf("poisoned %d messages, want the reused id's", len(got))
	}
	counts.expect(t, 1, 0, 1, 1)
}

// A Config.Fingerprint that panics (user code) fails the delivery before
// its transaction begins: Recoverer turns the panic into a nack, nothing is
// written, no connection stays in use and no SQLite writer keeps its
// place, and the next messages are processed.
func TestReusedIDFingerprintPanicLeavesNothingHeld(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		db.SetMaxOpenConns(2)
		f := newFixture(t, db)
		ib := f.newInbox(inbox.Config{Fingerprint: func(msg *message.Message) []byte {
			if string(msg.Payload) == "boom" {
				panic("bug in the fingerprint")
			}
			return msg.Payload
		}})
		var c calls
		in := newFeed()
		runRouter(t, func(r *message.Router) {
			r.AddMiddleware(middleware.Recoverer, ib.Middleware)
			r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
				c.inc(msg.UUID)
				return f.writeBusinessRow(msg)
			})
		})
		for i := range 4 { // twice the pool
			if in.deliver(t, message.NewMessage(watermill.NewUUID(), []byte("boom"))) {
				t.Fatalf("delivery %d whose fingerprint panicked was acked", i+1)
			}
		}
		if n := db.Stats().InUse; n != 0 {
			t.Errorf("%d connections in use after the panics, want 0", n)
		}
		if tdb.Dialect == inbox.SQLite {
			if n := inbox.SQLiteWritersQueued(db.DB); n != 0 {
				t.Errorf("%d SQLite writers hold or wait for their place after the panics, want 0", n)
			}
		}
		ok := message.NewMessage(watermill.NewUUID(), []byte("order 1"))
		if !in.deliver(t, ok) || c.get(ok.UUID) != 1 || f.businessRows() != 1 || f.inboxRows() != 1 {
			t.Errorf("after the panics: handler calls %d, business rows %d, inbox rows %d, want 1 each",
				c.get(ok.UUID), f.businessRows(), f.inboxRows())
		}
	})
}

// A hand-made fingerprint column whose default is an empty string, not NULL, is
// read as no fingerprint: rows written with the check off match any
// content once it is on, as NULL ones do.
//
// A default longer than a fingerprint (17 bytes) in a column that fits
// matches too: the column's type is read again to tell it from a column
// changed while the inbox ran.
func TestReusedIDColumnDefaultMatchesAsNoFingerprint(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		columns := []string{"fingerprint bytea NOT NULL DEFAULT ''", `fingerprint bytea NOT NULL DEFAULT '\x000102030405060708090a0b0c0d0e0f10'`}
		switch tdb.Dialect {
		case inbox.MySQL:
			// binary(16) pads the empty default to 16 zero bytes.
			columns = []string{"fingerprint varbinary(16) NOT NULL DEFAULT ''", "fingerprint binary(16) NOT NULL DEFAULT ''",
				"fingerprint varbinary(32) NOT NULL DEFAULT 'a-17-byte-default'"}
		case inbox.SQLite:
			columns = []string{"fingerprint BLOB NOT NULL DEFAULT x''", "fingerprint BLOB NOT NULL DEFAULT x'000102030405060708090a0b0c0d0e0f10'"}
		}
		for i, column := range columns {
			t.Run(fmt.Sprintf("%d-%s", i, strings.Fields(column)[1]), func(t *testing.T) { columnDefaultMatches(t, tdb, db, column) })
		}
	})
}

// A fingerprint column whose type changes while the inbox runs (PostgreSQL
// to text, MySQL/MariaDB to binary(32), which pads) holds the fingerprints
// in another form: a duplicate that has to read it can then not be told
// from a reused id, and is nacked (transient, ErrIncompatibleTable with the
// fix) instead of skipped; new messages are still processed.
func TestReusedIDCheckNacksDuplicatesWhenItsColumnTypeChangesWhileRunning(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		alter := "ALTER TABLE %s ALTER COLUMN fingerprint TYPE text USING encode(fingerprint, 'hex')"
		switch tdb.Dialect {
		case inbox.SQLite:
			t.Skip("SQLite cannot change a column's type in place")
		case inbox.MySQL:
			alter = "ALTER TABLE %s MODIFY fingerprint binary(32) NULL"
		}
		f := newFixture(t, db)
		ib := f.newInbox(inbox.Config{})
		in, c, rec := reusedIDRouter(t, f, ib)
		id := watermill.NewUUID()
		if !in.deliver(t, message.NewMessage(id, []byte("order 1"))) {
			t.Fatalf("first delivery nacked: %v", rec.last())
		}
		exec(t, db, fmt.Sprintf(alter, f.inbox))
		if in.deliver(t, message.NewMessage(id, []byte("order 2"))) {
			t.Error("the processed id with other content was acked while its fingerprint cannot be compared")
		} else if err := rec.last(); !errors.Is(err, inbox.ErrIncompatibleTable) || !inbox.IsTransient(err) {
			t.Errorf("delivery: %v, want a transient error wrapping ErrIncompatibleTable", err)
		}
		// The content this inbox committed the key with is matched from
		// memory (a committed row's fingerprint never changes).
		if !in.deliver(t, message.NewMessage(id, []byte("order 1"))) {
			t.Errorf("the duplicate this inbox committed was nacked: %v", rec.last())
		}
		other := message.NewMessage(watermill.NewUUID(), []byte("order 3"))
		if !in.deliver(t, other) {
			t.Errorf("a new message was nacked: %v", rec.last())
		}
		if c.get(id) != 1 || c.get(other.UUID) != 1 || f.businessRows() != 2 {
			t.Errorf("handler calls %d and %d, business rows %d, want 1, 1 and 2", c.get(id), c.get(other.UUID), f.businessRows())
		}
	})
}

// columnDefaultMatches is TestReusedIDColumnDefaultMatchesAsNoFingerprint
// with the fingerprint column column.
func columnDefaultMatches(t *testing.T, tdb testDB, db *sqlx.DB, column string) {
	{
		f := newFixture(t, db)
		f.newInbox(inbox.Config{}) // creates the table
		exec(t, db, "ALTER TABLE "+f.inbox+" DROP COLUMN fingerprint")
		exec(t, db, "ALTER TABLE "+f.inbox+" ADD COLUMN "+column)
		off, err := inbox.New(inbox.Config{DB: db, Table: f.inbox, Dialect: tdb.Dialect, ReusedIDs: inbox.ReusedIDsOff})
		if err != nil {
			t.Fatal(err)
		}
		in, _, rec := reusedIDRouter(t, f, off)
		id := watermill.NewUUID()
		if !in.deliver(t, message.NewMessage(id, []byte("order 1"))) {
			t.Fatalf("nacked with the check off: %v", rec.last())
		}
		var counts hookCounts
		on, err := inbox.New(counts.config(inbox.Config{DB: db, Table: f.inbox, Dialect: tdb.Dialect}))
		if err != nil {
			t.Fatal(err)
		}
		in2, _, rec2 := reusedIDRouter(t, f, on)
		if !in2.deliver(t, message.NewMessage(id, []byte("order 1"))) {
			t.Fatalf("a row stored with the column's default did not match: %v", rec2.last())
		}
		counts.expect(t, 0, 1, 0, 0)
	}
}

// purgeAfterClaim is an sqlObserver that, once armed, runs purge right
// after the next claim that found its key processed (a statement on table
// that affected no row), as a purge on another connection that commits
// between a duplicate's claim and the read of its stored fingerprint.
type purgeAfterClaim struct {
	statementLog
	table string
	armed atomic.Bool
	purge func()
}

func (p *purgeAfterClaim) executed(_ any, query string, rowsAffected int64) {
	if strings.Contains(query, p.table) && rowsAffected == 0 && p.armed.CompareAndSwap(true, false) {
		p.purge()
	}
}

// A message whose id was processed with other content, delivered while a
// purge deletes that key's row: PostgreSQL's claim finds the row and leaves
// it unlocked, the purge commits, and the read of the stored fingerprint
// finds nothing. The delivery is not acked as a duplicate (its content was
// never compared, and after the purge it is a new event): it is nacked with
// a transient error, and its redelivery is processed.
func TestReusedIDCheckNacksADuplicateWhoseRowIsPurgedMeanwhile(t *testing.T) {
	for _, d := range []inbox.Dialect{inbox.PostgreSQL, inbox.PostgreSQLPartitioned} {
		t.Run(d.String(), func(t *testing.T) {
			plain := testdb.OpenPostgres(t, "")
			hook := &purgeAfterClaim{}
			db := openRecording(t, plain.Driver(), testdb.PostgresDSN(), "pgx", hook)
			dialectOf.Store(db, d)
			f := newFixture(t, db)
			ib := f.newInbox(inbox.Config{Consumer: "billing"})
			hook.table = f.inbox
			in, c, rec := reusedIDRouter(t, f, ib)
			id := watermill.NewUUID()
			if !in.deliver(t, message.NewMessage(id, []byte("order 1"))) {
				t.Fatal(rec.last())
			}
			hook.purge = func() { // on the delivery's goroutine
				if _, err := plain.Exec("DELETE FROM "+f.inbox+" WHERE consumer = 'billing' AND message_id = $1", id); err != nil {
					t.Error(err)
				}
				// The first event's business row, keyed by the message id
				// here, goes too, so that the new event's handler can write
				// its own.
				if _, err := plain.Exec("DELETE FROM "+f.business+" WHERE id = $1", "billing:"+id); err != nil {
					t.Error(err)
				}
			}
			hook.armed.Store(true)
			if in.deliver(t, message.NewMessage(id, []byte("order 2"))) {
				t.Fatalf("acked as a duplicate of a row the purge deleted meanwhile: the event is lost (handler calls: %d)", c.get(id))
			}
			if err := rec.last(); !inbox.IsTransient(err) || errors.Is(err, inbox.ErrMessageIDReused) {
				t.Errorf("nacked with %v, want a transient error, not ErrMessageIDReused", err)
			}
			if !in.deliver(t, message.NewMessage(id, []byte("order 2"))) || c.get(id) != 2 {
				t.Errorf("redelivery after the purge: %v, handler calls %d, want processed (2)", rec.last(), c.get(id))
			}
		})
	}
}

// On SQLite a column's name is compared without case: a table whose column
// is FINGERPRINT has the check on, and a reused id is refused.
func TestReusedIDCheckFindsTheColumnWhateverItsCaseOnSQLite(t *testing.T) {
	db := sqliteDB(t)
	f := newFixture(t, db)
	f.newInbox(inbox.Config{})
	exec(t, db, "ALTER TABLE "+f.inbox+" RENAME COLUMN fingerprint TO FINGERPRINT")
	ib := f.newInbox(inbox.Config{Table: f.inbox})
	in, _, rec := reusedIDRouter(t, f, ib)
	id := watermill.NewUUID()
	if !in.deliver(t, message.NewMessage(id, []byte("order 1"))) {
		t.Fatal(rec.last())
	}
	if in.deliver(t, message.NewMessage(id, []byte("order 2"))) || !errors.Is(rec.last(), inbox.ErrMessageIDReused) {
		t.Errorf("reused id: %v (detected: %v), want refused with ErrMessageIDReused", rec.last(), ib.ReusedIDsDetected())
	}
}

// A fingerprint column dropped while the inbox runs (a rolled-back
// migration): the claim that stores a fingerprint fails on it. The delivery
// is nacked with a transient error wrapping ErrIncompatibleTable, so that a
// poison queue filter keeps it; the check turns off, the redelivery is
// processed, and a duplicate is still skipped.
func TestReusedIDCheckTurnsOffWhenItsColumnIsDroppedWhileRunning(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		f := newFixture(t, db)
		ib := f.newInbox(inbox.Config{})
		in, c, rec := reusedIDRouter(t, f, ib)
		first := message.NewMessage(watermill.NewUUID(), []byte("order 1"))
		if !in.deliver(t, first) {
			t.Fatal(rec.last())
		}
		exec(t, db, "ALTER TABLE "+f.inbox+" DROP COLUMN fingerprint")
		msg := message.NewMessage(watermill.NewUUID(), []byte("order 2"))
		if in.deliver(t, msg) {
			t.Fatal("acked a message whose claim stored a fingerprint in a dropped column")
		}
		if err := rec.last(); !inbox.IsTransient(err) || !errors.Is(err, inbox.ErrIncompatibleTable) {
			t.Errorf("nacked with %v, want a transient error wrapping ErrIncompatibleTable", err)
		}
		if !in.deliver(t, msg) || c.get(msg.UUID) != 1 {
			t.Errorf("redelivery: %v, handler calls %d, want processed once", rec.last(), c.get(msg.UUID))
		}
		if ib.ReusedIDsDetected() {
			t.Error("ReusedIDsDetected still true without the column")
		}
		if !in.deliver(t, first) || c.get(first.UUID) != 1 {
			t.Errorf("duplicate of the first message: %v, handler calls %d, want skipped", rec.last(), c.get(first.UUID))
		}
	})
}

// A table dropped while the inbox runs is not taken for a dropped
// fingerprint column: once it is created again, with the column, reused
// ids are detected.
func TestReusedIDCheckStaysOnWhenItsTableIsDroppedWhileRunning(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		f := newFixture(t, db)
		ib := f.newInbox(inbox.Config{})
		in, _, rec := reusedIDRouter(t, f, ib)
		if !in.deliver(t, message.NewMessage(watermill.NewUUID(), []byte("order 1"))) {
			t.Fatal(rec.last())
		}
		exec(t, db, "DROP TABLE "+f.inbox)
		if in.deliver(t, message.NewMessage(watermill.NewUUID(), []byte("order 2"))) {
			t.Fatal("acked a message without its table")
		}
		if err := ib.InitializeSchema(t.Context()); err != nil {
			t.Fatal(err)
		}
		id := watermill.NewUUID()
		if !in.deliver(t, message.NewMessage(id, []byte("order 3"))) {
			t.Fatalf("after the table was created again: %v", rec.last())
		}
		if in.deliver(t, message.NewMessage(id, []byte("order 4"))) || !errors.Is(rec.last(), inbox.ErrMessageIDReused) {
			t.Errorf("reused id after the table came back: %v (detected: %v), want refused", rec.last(), ib.ReusedIDsDetected())
		}
	})
}

// Claims that fail for a reason of their own (a CHECK constraint the
// messages break), 8 deliveries at once on a pool of 2 connections: each
// failure makes the inbox look for its fingerprint column, and every
// delivery still ends, with the claim's own error (not transient), the
// check left on. The look at the column once waited for a connection while
// holding the lock that deliveries holding the connections were waiting
// for (the partitioned dialect forgets its key lock's claim on a failed
// claim): every delivery hung. Called through the middleware directly, as
// eight router handlers would.
func TestReusedIDCheckEndsEveryDeliveryWhenClaimsFailOnAFullPool(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if tdb.Dialect == inbox.SQLite {
			t.Skip("SQLite adds no CHECK constraint to a table")
		}
		f := newFixture(t, db)
		ib := f.newInbox(inbox.Config{Consumer: "billing"})
		h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) { return nil, f.writeBusinessRow(msg) })
		if _, err := h(message.NewMessage(watermill.NewUUID(), []byte("order 1"))); err != nil {
			t.Fatal(err)
		}
		exec(t, db, "ALTER TABLE "+f.inbox+" ADD CONSTRAINT "+f.inbox+"_no_bad CHECK (message_id NOT LIKE 'bad%')")
		db.SetMaxOpenConns(2)
		errs := make([]error, 8)
		var wg sync.WaitGroup
		for i := range errs {
			wg.Go(func() { _, errs[i] = h(message.NewMessage("bad"+watermill.NewUUID(), []byte("order"))) })
		}
		done := make(chan struct{})
		go func() { wg.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(time.Minute):
			t.Fatal("deliveries whose claims failed did not end in a minute (a pool of 2, 8 in flight)")
		}
		for i, err := range errs {
			if err == nil || inbox.IsTransient(err) || errors.Is(err, inbox.ErrIncompatibleTable) {
				t.Errorf("delivery %d: %v, want the claim's own error, not transient", i, err)
			}
		}
		if !ib.ReusedIDsDetected() {
			t.Error("the check turned off though the column is there")
		}
	})
}

// A handler that replaces msg.Payload (decodes it in place) and fails once,
// under Inbox.Middlewares' Retry (outside the inbox, which runs again with
// the same message): the attempt that commits stores the fingerprint of the
// message as the broker sent it, so the broker's redelivery of it (a lost
// ack) is a duplicate, not a reused id sent to the poison queue.
func TestReusedIDRetryOfAHandlerThatReplacedThePayloadMatchesItsRedelivery(t *testing.T) {
	forEachDB(t, func(t *testing.T, _ testDB, db *sqlx.DB) {
		f := newFixture(t, db)
		var counts hookCounts
		ib := f.newInbox(counts.config(inbox.Config{}))
		sink := &poisonSink{}
		mws, err := ib.Middlewares(inbox.MiddlewaresConfig{PoisonQueue: sink, Retry: middleware.Retry{MaxRetries: 2, InitialInterval: time.Millisecond}})
		if err != nil {
			t.Fatal(err)
		}
		var c calls
		in := newFeed()
		runRouter(t, func(r *message.Router) {
			r.AddMiddleware(mws...)
			r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
				c.inc(msg.UUID)
				msg.Payload = []byte(strings.ToUpper(string(msg.Payload))) // "decoded"
				if c.get(msg.UUID) == 1 {
					return errors.New("downstream unavailable")
				}
				return f.writeBusinessRow(msg)
			})
		})
		msg := message.NewMessage(watermill.NewUUID(), []byte("order 1"))
		for _, label := range []string{"delivery", "the broker's redelivery"} {
			if !in.deliver(t, msg) {
				t.Fatalf("%s nacked", label)
			}
		}
		if got := sink.poisoned(); len(got) != 0 {
			t.Errorf("%d messages poisoned, want none: the redelivery is a duplicate", len(got))
		}
		if c.get(msg.UUID) != 2 || f.businessRows() != 1 {
			t.Errorf("handler calls %d, business rows %d, want 2 and 1", c.get(msg.UUID), f.businessRows())
		}
		counts.expect(t, 1, 1, 1, 0)
	})
}

// The same without Retry, as watermill-kafka's nack does it: the failed
// message is sent again as a copy of itself, the payload as the handler
// left it. The copy is processed with the fingerprint of the message as the
// broker sent it, so the broker's later replay of that message is a
// duplicate; a producer that reused the id for other content is still
// refused.
func TestReusedIDNackedCopyOfAMessageTheHandlerChangedMatchesItsReplay(t *testing.T) {
	forEachDB(t, func(t *testing.T, _ testDB, db *sqlx.DB) {
		f := newFixture(t, db)
		ib := f.newInbox(inbox.Config{})
		rec := &recorder{}
		var failed atomic.Bool
		in := newFeed()
		runRouter(t, func(r *message.Router) {
			r.AddMiddleware(rec.Middleware, ib.Middleware)
			r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
				msg.Payload = []byte(strings.ToUpper(string(msg.Payload))) // "decoded"
				if failed.CompareAndSwap(false, true) {
					return errors.New("downstream unavailable")
				}
				return f.writeBusinessRow(msg)
			})
		})
		sent := message.NewMessage(watermill.NewUUID(), []byte("order 1"))
		first := sent.Copy()
		if acked, err := in.send(t.Context(), first); err != nil || acked {
			t.Fatalf("first delivery: acked %v, %v; want it nacked", acked, err)
		}
		if acked, err := in.send(t.Context(), first.Copy()); err != nil || !acked { // watermill-kafka's resend
			t.Fatalf("the nacked message's copy: acked %v, %v (%v)", acked, err, rec.last())
		}
		if acked, err := in.send(t.Context(), sent.Copy()); err != nil || !acked {
			t.Errorf("the broker's replay of the processed message: nacked with %v, want a duplicate", rec.last())
		}
		if acked, err := in.send(t.Context(), message.NewMessage(sent.UUID, []byte("order 2"))); err != nil || acked ||
			!errors.Is(rec.last(), inbox.ErrMessageIDReused) {
			t.Errorf("the id reused for other content: acked %v, %v; want it refused with ErrMessageIDReused", acked, rec.last())
		}
		if f.businessRows() != 1 {
			t.Errorf("business rows %d, want 1", f.businessRows())
		}
	})
}
