package inbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A MySQL/MariaDB pool whose sessions use utf8mb3 (the DSN's charset=utf8,
// common in older configurations: its character_set_client and
// character_set_connection match, so the session check lets it pass) on a
// hand-made table whose key columns are varchar utf8mb4_nopad_bin, which
// compares byte for byte. Verify passed, and every message whose id has a
// 4-byte character (an emoji) then failed its claim (1366) on every
// delivery: it could never be processed, and a poison filter took it.
// Verify refuses the table for such sessions, with the fix; the same table
// serves utf8mb4 sessions, and a utf8mb3 session processes those ids once
// the columns are varbinary (the fix Verify gives).
func TestMySQLUtf8mb3SessionsAreRefusedForCharacterKeyColumns(t *testing.T) {
	t.Parallel()
	db := testdb.OpenMySQL(t, "charset=utf8")
	table := "utf8mb3_inbox_" + randomSuffix()
	dropLater(t, db, table)
	exec(t, db, "CREATE TABLE "+table+" ("+
		"consumer varchar(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin NOT NULL,"+
		" message_id varchar(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin NOT NULL,"+
		" processed_at datetime(6) NOT NULL, fingerprint varbinary(16) NULL,"+
		" PRIMARY KEY (consumer, message_id), KEY "+table+"_processed_at (processed_at))")
	config := inbox.Config{DB: db, Table: table, Consumer: "billing", MessageID: inbox.MessageIDFromMetadata("event-id")}
	ib, err := inbox.New(config)
	if err != nil {
		t.Fatal(err)
	}
	err = ib.Verify(context.Background())
	if !errors.Is(err, inbox.ErrIncompatibleTable) || !strings.Contains(err.Error(), "utf8mb3") {
		t.Fatalf("Verify of utf8mb4 character key columns through utf8mb3 sessions: %v; want ErrIncompatibleTable naming utf8mb3", err)
	}
	utf8mb4 := testdb.OpenMySQL(t, "")
	other, err := inbox.New(inbox.Config{DB: utf8mb4, Table: table, Consumer: "billing"})
	if err != nil {
		t.Fatal(err)
	}
	if err := other.Verify(context.Background()); err != nil {
		t.Errorf("Verify of the same table through utf8mb4 sessions: %v; want nil", err)
	}

	// The fix: varbinary key columns, which take the bytes as they are.
	exec(t, db, "ALTER TABLE "+table+" MODIFY consumer varbinary(255) NOT NULL, MODIFY message_id varbinary(255) NOT NULL")
	if ib, err = inbox.New(config); err != nil {
		t.Fatal(err)
	}
	if err := ib.Verify(context.Background()); err != nil {
		t.Fatalf("Verify after the fix: %v", err)
	}
	var c calls
	rec := &recorder{}
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(rec.Middleware, ib.Middleware)
		r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
			c.inc(msg.Metadata.Get("event-id"))
			return nil
		})
	})
	for _, id := range []string{"order-😀", "order-😁"} {
		for range 2 {
			m := message.NewMessage(id+"-uuid", []byte(id))
			m.Metadata.Set("event-id", id)
			if !in.deliver(t, m) {
				t.Errorf("message %q nacked: %v", id, rec.last())
			}
		}
		if n := c.get(id); n != 1 {
			t.Errorf("message %q delivered twice: %d handler calls, want 1", id, n)
		}
	}
}
