package main

import (
	"context"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// "inbox requeue" moves an outbox's dead letter back to the outbox table,
// where the relay sends it; it refuses a selection of nothing or of
// everything beside ids (exit 2, nothing moved), and names a missing
// outbox table (exit 1).
func TestRequeueMovesDeadLettersBackToTheOutbox(t *testing.T) {
	for name, c := range dsns(t) {
		t.Run(name, func(t *testing.T) {
			outbox := "cli_outbox_" + testdb.RandomSuffix()
			relayWithADeadLetter(t, c.db, outbox, 3) // one set aside, one sent, one pending
			var dead []int64
			if err := c.db.Select(&dead, "SELECT id FROM "+outbox+"_dead"); err != nil || len(dead) != 1 {
				t.Fatalf("dead letters %v, %v; want one", dead, err)
			}
			for _, args := range [][]string{{}, {"-all", "-topic", "invoices"}, {"-id", "x1"}} {
				if code, out, errOut := cli(t, append([]string{"requeue", "-db", c.dsn, "-outbox-table", outbox}, args...)...); code != 2 || out != "" {
					t.Errorf("requeue %v: exit %d, stdout %q, stderr %q; want 2 and nothing moved", args, code, out, errOut)
				}
			}
			if code, out, errOut := cli(t, "requeue", "-db", c.dsn, "-outbox-table", outbox, "-topic", "payments"); code != 0 || !strings.Contains(out, "moved 0 dead letters back") {
				t.Errorf("requeue of a topic with none: exit %d, stdout %q, stderr %q", code, out, errOut)
			}
			id := strconv.FormatInt(dead[0], 10)
			code, out, errOut := cli(t, "requeue", "-db", c.dsn, "-outbox-table", outbox, "-id", id+",123456789")
			if code != 0 || !strings.Contains(out, "moved 1 dead letter back to "+outbox) {
				t.Errorf("requeue -id %s: exit %d, stdout %q, stderr %q", id, code, out, errOut)
			}
			st, err := inbox.ReadOutboxStats(context.Background(), c.db, nil, outbox)
			if err != nil || st.Pending != 2 || st.DeadLettered != 0 {
				t.Errorf("after the requeue: %+v, %v; want 2 pending and no dead letter", st, err)
			}
			missing := "cli_no_outbox_" + testdb.RandomSuffix()
			if code, out, errOut := cli(t, "requeue", "-db", c.dsn, "-outbox-table", missing, "-all"); code != 1 || out != "" || !strings.Contains(errOut, missing) {
				t.Errorf("requeue of a missing outbox: exit %d, stdout %q, stderr %q; want 1 and the table named", code, out, errOut)
			}
		})
	}
}

// "inbox requeue" on a SQLite file whose service holds the write lock for
// a moment (a message's transaction) waits for it, as the service's own
// connections do: with a DSN that sets no busy timeout it failed at once
// with SQLITE_BUSY ("database is locked").
func TestRequeueOnSQLiteWaitsForTheServicesWriteLock(t *testing.T) {
	path := filepath.Join(t.TempDir(), "requeue.db")
	db := testdb.OpenSQLite(t, path)
	outbox := "cli_outbox_" + testdb.RandomSuffix()
	relayWithADeadLetter(t, db, outbox, 3)
	tx, err := db.Begin() // _txlock=immediate: the write lock, as a message's transaction holds it
	if err != nil {
		t.Fatal(err)
	}
	released := make(chan struct{})
	go func() {
		defer close(released)
		time.Sleep(300 * time.Millisecond)
		_ = tx.Rollback()
	}()
	code, out, errOut := cli(t, "requeue", "-db", "sqlite://"+path, "-outbox-table", outbox, "-all")
	<-released
	if code != 0 || !strings.Contains(out, "moved 1 dead letter back") {
		t.Errorf("requeue while the service held the write lock for 300 ms: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
}
