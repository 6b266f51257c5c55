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

// The script "inbox schema -verify -dialect postgres-partitioned" (Verify)
// prints to move a plain PostgreSQL inbox table to a partitioned one keeps
// what its rows say, the fingerprints of Config.ReusedIDs included: after
// the move, a message whose id was processed before with other content is
// still refused as a reused id (ErrMessageIDReused, nacked, the handler not
// called), not acked as a duplicate, which loses its event.
func TestVerifyRecreateScriptToPartitionedKeepsTheReusedIDFingerprints(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.OpenPostgres(t, "")
	table := "inbox_" + randomSuffix()
	t.Cleanup(func() {
		db.Exec("DROP TABLE IF EXISTS " + table + " CASCADE")
		db.Exec("DROP TABLE IF EXISTS " + table + "_old CASCADE")
		db.Exec(`DO $$DECLARE f regprocedure; BEGIN FOR f IN SELECT oid::regprocedure FROM pg_proc WHERE proname = '` + table + `_claim'
			LOOP EXECUTE 'DROP FUNCTION IF EXISTS ' || f::text; END LOOP; END$$`)
	})
	run := func(ib *inbox.Inbox, msg *message.Message) (acked bool, handled int) {
		t.Helper()
		var c calls
		in := newFeed()
		router := runRouter(t, func(r *message.Router) {
			r.AddMiddleware(ib.Middleware)
			r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
				c.inc(msg.UUID)
				return nil
			})
		})
		acked = in.deliver(t, msg)
		router.Close()
		return acked, c.get(msg.UUID)
	}

	plain, err := inbox.New(inbox.Config{DB: db, Dialect: inbox.PostgreSQL, Table: table, Consumer: "billing"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { plain.Close() })
	if err := plain.InitializeSchema(ctx); err != nil {
		t.Fatal(err)
	}
	if acked, n := run(plain, message.NewMessage("order-1", []byte(`{"amount": 10}`))); !acked || n != 1 {
		t.Fatalf("order-1 on the plain table: acked %v, handler calls %d; want processed", acked, n)
	}

	// The move, as the script says: rename, create the partitioned table
	// and its partitions, copy the rows.
	partitioned := verifyInbox(t, db, inbox.PostgreSQLPartitioned, table)
	verr := partitioned.Verify(ctx)
	if !errors.Is(verr, inbox.ErrIncompatibleTable) {
		t.Fatalf("Verify of the plain table as postgres-partitioned: %v, want ErrIncompatibleTable with the script", verr)
	}
	var rename, insert string
	for _, line := range strings.Split(verr.Error(), "\n") {
		line = strings.TrimSpace(line)
		if i := strings.Index(line, "ALTER TABLE "); i >= 0 && strings.Contains(line, " RENAME TO ") {
			rename = line[i:]
		}
		if strings.HasPrefix(line, "INSERT INTO ") {
			insert = line
		}
	}
	if rename == "" || insert == "" {
		t.Fatalf("no RENAME and INSERT in the script:\n%v", verr)
	}
	exec(t, db, rename)
	if err := inbox.InitializePartitions(ctx, db, table, inbox.PartitionWeek); err != nil {
		t.Fatal(err)
	}
	if err := partitioned.InitializeSchema(ctx); err != nil {
		t.Fatal(err)
	}
	exec(t, db, insert)
	if err := partitioned.Verify(ctx); err != nil {
		t.Fatalf("Verify after the script: %v", err)
	}
	if n := count(t, db, table, "fingerprint IS NOT NULL"); n != 1 {
		t.Errorf("rows with a fingerprint after the script: %d, want 1 (the script: %s)", n, insert)
	}
	if acked, n := run(partitioned, message.NewMessage("order-1", []byte(`{"amount": 99}`))); acked || n != 0 {
		t.Errorf("order-1 with other content after the move: acked %v, handler calls %d; want it refused as a reused id (nacked, not called)", acked, n)
	}
}
