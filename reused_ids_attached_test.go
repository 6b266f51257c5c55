package inbox_test

import (
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
)

// SQLite resolves an unqualified table name in temp, main, then the
// attached databases, and Verify checks the table the name resolves to.
// The reused-id check looked for the fingerprint column in "main" only: for
// a table in an attached database it found none, turned itself off for
// good, and a reused id was acked as a duplicate in silence.
func TestReusedIDIsRefusedInATableOfAnAttachedSQLiteDatabase(t *testing.T) {
	db := sqliteDB(t)
	db.SetMaxOpenConns(1) // ATTACH holds for one connection
	db.SetMaxIdleConns(1)
	exec(t, db, "ATTACH DATABASE ? AS aux", t.TempDir()+"/aux.db")
	table := "inbox_attached_" + randomSuffix()
	made, err := inbox.New(inbox.Config{DB: db, Table: "aux." + table})
	if err != nil {
		t.Fatal(err)
	}
	if err := made.InitializeSchema(t.Context()); err != nil {
		t.Fatal(err)
	}
	ib, err := inbox.New(inbox.Config{DB: db, Table: table}) // unqualified: resolves to aux
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.Verify(t.Context()); err != nil {
		t.Fatalf("Verify: %v", err)
	}
	var calls int
	rec := &recorder{}
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(rec.Middleware, ib.Middleware)
		r.AddConsumerHandler("billing", "orders", in, func(*message.Message) error { calls++; return nil })
	})
	id := watermill.NewUUID()
	if !in.deliver(t, message.NewMessage(id, []byte("order 1"))) {
		t.Fatalf("first delivery nacked: %v", rec.last())
	}
	if n := count(t, db, "aux."+table, "fingerprint IS NOT NULL"); !ib.ReusedIDsDetected() || n != 1 {
		t.Errorf("ReusedIDsDetected %v, rows with a fingerprint %d: the table has the fingerprint column, want the check on", ib.ReusedIDsDetected(), n)
	}
	if acked := in.deliver(t, message.NewMessage(id, []byte("order 2, another event"))); acked || !errors.Is(rec.last(), inbox.ErrMessageIDReused) {
		t.Errorf("reused id: acked %v, error %v, handler calls %d; want it refused with ErrMessageIDReused", acked, rec.last(), calls)
	}
}
