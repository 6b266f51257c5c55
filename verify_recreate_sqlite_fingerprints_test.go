package inbox_test

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// The script Verify prints to recreate a hand-made SQLite inbox table in
// the canonical shape keeps what its rows say, the fingerprints of
// Config.ReusedIDs included: after it, a message whose id was processed
// before with other content is still refused as a reused id (nacked, the
// handler not called), not acked as a duplicate, which loses its event.
func TestVerifyRecreateScriptOfASQLiteTableKeepsTheReusedIDFingerprints(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.OpenSQLite(t, filepath.Join(t.TempDir(), "inbox.db"))
	table := "inbox_" + randomSuffix()
	exec(t, db, "CREATE TABLE "+table+" (consumer TEXT NOT NULL, message_id TEXT NOT NULL,"+
		" processed_at DATETIME NOT NULL DEFAULT CURRENT_TIMESTAMP, fingerprint BLOB, PRIMARY KEY (consumer, message_id))")
	// order-1, processed an hour ago with content whose fingerprint is not
	// that of the redelivery below.
	exec(t, db, "INSERT INTO "+table+" (consumer, message_id, processed_at, fingerprint) VALUES ('billing', 'order-1', datetime('now', '-1 hour'), randomblob(16))")

	ib := verifyInbox(t, db, inbox.SQLite, table)
	verr := ib.Verify(ctx)
	if !errors.Is(verr, inbox.ErrIncompatibleTable) {
		t.Fatalf("Verify of a DATETIME processed_at: %v, want ErrIncompatibleTable with the recreate script", verr)
	}
	text := verr.Error()
	begin, end := strings.Index(text, "BEGIN IMMEDIATE;"), strings.Index(text, "COMMIT;")
	if begin < 0 || end < begin {
		t.Fatalf("no recreate script in:\n%v", verr)
	}
	script := text[begin : end+len("COMMIT;")]
	exec(t, db, script)
	if err := ib.Verify(ctx); err != nil {
		t.Fatalf("Verify after the script: %v", err)
	}
	if n := count(t, db, table, "fingerprint IS NOT NULL"); n != 1 {
		t.Errorf("rows with a fingerprint after the recreate script: %d, want 1\n%s", n, script)
	}
	var c calls
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(ib.Middleware)
		r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
			c.inc(msg.UUID)
			return nil
		})
	})
	if acked := in.deliver(t, message.NewMessage("order-1", []byte(`{"amount": 99}`))); acked || c.get("order-1") != 0 {
		t.Errorf("order-1 with other content after the recreate script: acked %v, handler calls %d; want it refused as a reused id (nacked, not called)",
			acked, c.get("order-1"))
	}
}
