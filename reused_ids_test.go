package inbox_test

import (
	"crypto/sha256"
	"errors"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// reusedIDCounts counts the hooks of a reused-id test.
type reusedIDCounts struct{ processed, duplicates, failed, reused atomic.Int32 }

func (c *reusedIDCounts) config(cfg inbox.Config) inbox.Config {
	cfg.OnProcessed = func(inbox.Event) { c.processed.Add(1) }
	cfg.OnDuplicate = func(inbox.Event) { c.duplicates.Add(1) }
	cfg.OnFailed = func(inbox.Event) { c.failed.Add(1) }
	cfg.OnReusedID = func(inbox.Event) { c.reused.Add(1) }
	return cfg
}

func (c *reusedIDCounts) expect(t *testing.T, processed, duplicates, failed, reused int32) {
	t.Helper()
	if c.processed.Load() != processed || c.duplicates.Load() != duplicates || c.failed.Load() != failed || c.reused.Load() != reused {
		t.Errorf("hooks: processed=%d duplicate=%d failed=%d reused=%d, want %d, %d, %d and %d",
			c.processed.Load(), c.duplicates.Load(), c.failed.Load(), c.reused.Load(), processed, duplicates, failed, reused)
	}
}

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

// storedFingerprint returns the fingerprint column of the key billing/id.
func storedFingerprint(t *testing.T, db *sqlx.DB, table, id string) []byte {
	t.Helper()
	var fp []byte
	if err := db.Get(&fp, db.Rebind("SELECT fingerprint FROM "+table+" WHERE consumer = 'billing' AND message_id = ?"), id); err != nil {
		t.Fatal(err)
	}
	return fp
}

func sha256Prefix(b []byte) []byte {
	sum := sha256.Sum256(b)
	return sum[:16]
}

// A message id processed once comes again: with the same payload it is a
// duplicate (acked, handler not called); with another payload (a producer
// that reused the id for a different event) it is refused: nacked with an
// error wrapping ErrMessageIDReused that IsTransient calls permanent,
// reported to OnReusedID and OnFailed, and nothing is written; every
// redelivery of it is refused again.
func TestReusedIDWithOtherContentIsRefused(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		f := newFixture(t, db)
		var counts reusedIDCounts
		ib := f.newInbox(counts.config(inbox.Config{}))
		in, c, rec := reusedIDRouter(t, f, ib)

		id := watermill.NewUUID()
		first := message.NewMessage(id, []byte(`{"invoice":1,"amount":100}`))
		if !in.deliver(t, first) || !in.deliver(t, first) {
			t.Fatalf("first delivery or its duplicate nacked: %v", rec.last())
		}
		if got := storedFingerprint(t, db, f.inbox, id); string(got) != string(sha256Prefix(first.Payload)) {
			t.Errorf("stored fingerprint %x, want the first 16 bytes of the payload's SHA-256 %x", got, sha256Prefix(first.Payload))
		}
		other := message.NewMessage(id, []byte(`{"invoice":2,"amount":250}`))
		for i := range 2 {
			if in.deliver(t, other) {
				t.Fatalf("delivery %d of another payload under a processed id acked, want refused", i+1)
			}
			err := rec.last()
			if !errors.Is(err, inbox.ErrMessageIDReused) {
				t.Fatalf("error %v, want one wrapping ErrMessageIDReused", err)
			}
			if inbox.IsTransient(err) {
				t.Errorf("IsTransient(%v) = true, want false (a poison queue filter must take it)", err)
			}
		}
		if got := c.get(id); got != 1 {
			t.Errorf("handler calls = %d, want 1", got)
		}
		if got := f.businessRows(); got != 1 {
			t.Errorf("business rows = %d, want 1", got)
		}
		if got := storedFingerprint(t, db, f.inbox, id); string(got) != string(sha256Prefix(first.Payload)) {
			t.Errorf("stored fingerprint changed to %x by a refused delivery", got)
		}
		counts.expect(t, 1, 1, 2, 2)
	})
}

// With ReusedIDsWarn a reused id is logged and reported to OnReusedID, then
// skipped as a duplicate (acked, OnDuplicate); the handler is not called.
func TestReusedIDWarningSkipsTheDelivery(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		f := newFixture(t, db)
		var counts reusedIDCounts
		logger := newCaptureLogger()
		ib := f.newInbox(counts.config(inbox.Config{ReusedIDs: inbox.ReusedIDsWarn, Logger: logger}))
		in, c, rec := reusedIDRouter(t, f, ib)

		id := watermill.NewUUID()
		if !in.deliver(t, message.NewMessage(id, []byte("order 1"))) {
			t.Fatalf("first delivery nacked: %v", rec.last())
		}
		if !in.deliver(t, message.NewMessage(id, []byte("order 2"))) {
			t.Fatalf("reused id nacked under ReusedIDsWarn: %v", rec.last())
		}
		if got := c.get(id); got != 1 {
			t.Errorf("handler calls = %d, want 1", got)
		}
		counts.expect(t, 1, 1, 0, 1)
		var warned []logLine
		for _, l := range *logger.lines {
			if strings.Contains(l.msg, "reused") && l.fields["message_id"] == id {
				warned = append(warned, l)
			}
		}
		if len(warned) != 1 || warned[0].level != "info" || warned[0].fields["stored_fingerprint"] == nil {
			t.Errorf("log lines about the reused id: %+v, want one at info with both fingerprints", warned)
		}
	})
}

// Config.Fingerprint chooses what identifies the event: a producer that
// sends the same event again with a new timestamp in its metadata is not
// refused when the fingerprint leaves the timestamp out, and one that
// reuses the id for another amount is.
func TestReusedIDFingerprintOfYourChoice(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		f := newFixture(t, db)
		var counts reusedIDCounts
		ib := f.newInbox(counts.config(inbox.Config{Fingerprint: func(msg *message.Message) []byte {
			return []byte(msg.Metadata.Get("amount"))
		}}))
		in, _, rec := reusedIDRouter(t, f, ib)

		id := watermill.NewUUID()
		send := func(payload, amount string) bool {
			msg := message.NewMessage(id, []byte(payload))
			msg.Metadata.Set("amount", amount)
			return in.deliver(t, msg)
		}
		if !send(`{"at":"10:00"}`, "100") || !send(`{"at":"10:05"}`, "100") {
			t.Fatalf("the same event sent again with another timestamp nacked: %v", rec.last())
		}
		if send(`{"at":"10:00"}`, "250") {
			t.Fatal("another amount under the same id acked, want refused")
		}
		counts.expect(t, 1, 1, 1, 1)
	})
}

// A table made before the fingerprint column existed keeps working with the
// check off: a reused id is skipped as a duplicate, as before, and the
// inbox logs how to add the column. Once it is added (AddFingerprintColumnSQL)
// and the inbox starts again, the rows written before it (no fingerprint)
// match any content, and new rows are checked.
func TestReusedIDTableWithoutTheColumn(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		f := newFixture(t, db)
		f.newInbox(inbox.Config{}) // creates the table
		exec(t, db, "ALTER TABLE "+f.inbox+" DROP COLUMN fingerprint")

		var counts reusedIDCounts
		logger := newCaptureLogger()
		cfg := counts.config(inbox.Config{Logger: logger, DB: db, Table: f.inbox, Dialect: tdb.Dialect})
		old, err := inbox.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		in, c, rec := reusedIDRouter(t, f, old)
		id := watermill.NewUUID()
		if !in.deliver(t, message.NewMessage(id, []byte("order 1"))) || !in.deliver(t, message.NewMessage(id, []byte("order 2"))) {
			t.Fatalf("a delivery nacked on a table without the column: %v", rec.last())
		}
		counts.expect(t, 1, 1, 0, 0)
		fix := inbox.AddFingerprintColumnSQL(tdb.Dialect, f.inbox)
		hinted := false
		for _, l := range *logger.lines {
			hinted = hinted || (l.level == "info" && strings.Contains(l.msg, fix))
		}
		if !hinted {
			t.Errorf("no Info line names the fix %q; logged %+v", fix, *logger.lines)
		}

		exec(t, db, fix)
		restarted, err := inbox.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		in2, c2, rec2 := reusedIDRouter(t, f, restarted)
		if !in2.deliver(t, message.NewMessage(id, []byte("order 3"))) {
			t.Fatalf("a row written without a fingerprint did not match: %v", rec2.last())
		}
		fresh := watermill.NewUUID()
		if !in2.deliver(t, message.NewMessage(fresh, []byte("order 4"))) {
			t.Fatalf("new message nacked: %v", rec2.last())
		}
		if in2.deliver(t, message.NewMessage(fresh, []byte("order 5"))) {
			t.Error("reused id acked once the column was added, want refused")
		}
		if c.get(id)+c2.get(id) != 1 || c2.get(fresh) != 1 {
			t.Errorf("handler calls: %d for the old id, %d for the new one, want 1 each", c.get(id)+c2.get(id), c2.get(fresh))
		}
	})
}

// With ReusedIDsOff no fingerprint is stored and none is compared: a reused
// id is a duplicate.
func TestReusedIDCheckOff(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		f := newFixture(t, db)
		var counts reusedIDCounts
		ib := f.newInbox(counts.config(inbox.Config{ReusedIDs: inbox.ReusedIDsOff}))
		in, _, rec := reusedIDRouter(t, f, ib)
		id := watermill.NewUUID()
		if !in.deliver(t, message.NewMessage(id, []byte("order 1"))) || !in.deliver(t, message.NewMessage(id, []byte("order 2"))) {
			t.Fatalf("nacked with ReusedIDsOff: %v", rec.last())
		}
		if fp := storedFingerprint(t, db, f.inbox, id); fp != nil {
			t.Errorf("stored fingerprint %x with ReusedIDsOff, want NULL", fp)
		}
		counts.expect(t, 1, 1, 0, 0)
	})
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
		var counts reusedIDCounts
		ib := f.newInbox(counts.config(inbox.Config{Dialect: inbox.PostgreSQL}))
		in, _, rec := reusedIDRouter(t, f, ib)
		id := watermill.NewUUID()
		if !in.deliver(t, message.NewMessage(id, []byte("order 1"))) || !in.deliver(t, message.NewMessage(id, []byte("order 1"))) {
			t.Fatalf("first delivery or its duplicate nacked: %v", rec.last())
		}
		if in.deliver(t, message.NewMessage(id, []byte("order 2"))) || !errors.Is(rec.last(), inbox.ErrMessageIDReused) {
			t.Fatalf("reused id: %v, want refused with ErrMessageIDReused", rec.last())
		}
		counts.expect(t, 1, 1, 1, 1)
	})
}
