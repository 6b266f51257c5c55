package inbox_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A duplicate of a message this inbox committed is skipped without reading
// its stored fingerprint: the inbox remembers the fingerprints of the keys
// it committed last. Only a match is taken from memory. The same id with
// other content reads the stored fingerprint and is refused, and a stale
// memory (the row deleted and the id claimed again by another process with
// other content) never refuses a message: the other process's content is
// read and skipped as a duplicate.
func TestReusedIDs_DuplicateOfARecentCommitReadsNoFingerprint(t *testing.T) {
	t.Parallel()
	log := &statementLog{}
	plain := testdb.OpenPostgres(t, "")
	db := openRecording(t, plain.Driver(), testdb.PostgresDSN(), "pgx", log)
	f := newFixture(t, db)
	ib := f.newInbox(inbox.Config{Consumer: "billing"})
	other := f.newInbox(inbox.Config{Consumer: "billing"}) // another process on the same table
	in, calls, rec := reusedIDRouter(t, f, ib)
	otherIn, _, _ := reusedIDRouter(t, f, other)
	reads := func() (n int) {
		for _, q := range log.take() {
			if strings.Contains(q, "SELECT fingerprint") {
				n++
			}
		}
		return n
	}

	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"amount":100}`))
	if !in.deliver(t, msg) {
		t.Fatalf("first delivery nacked: %v", rec.last())
	}
	log.take()
	if !in.deliver(t, msg) {
		t.Fatalf("redelivery nacked: %v", rec.last())
	}
	if n := reads(); n != 0 || calls.get(msg.UUID) != 1 {
		t.Errorf("redelivery to the inbox that committed it: %d fingerprint reads, handler calls %d; want 0 and 1", n, calls.get(msg.UUID))
	}
	if !otherIn.deliver(t, msg) {
		t.Fatalf("redelivery to the other inbox nacked")
	}
	if n := reads(); n != 1 {
		t.Errorf("redelivery to an inbox that did not commit it: %d fingerprint reads, want 1", n)
	}

	reused := message.NewMessage(msg.UUID, []byte(`{"amount":999}`))
	if in.deliver(t, reused) {
		t.Fatal("a reused id with other content was acked")
	}
	if err := rec.last(); !errors.Is(err, inbox.ErrMessageIDReused) {
		t.Errorf("reused id: %v, want ErrMessageIDReused", err)
	}
	if n := reads(); n != 1 {
		t.Errorf("reused id: %d fingerprint reads, want 1", n)
	}

	// The row goes (a purge) and the other process claims the id again,
	// with other content: this inbox's memory of the key is stale.
	exec(t, plain, "DELETE FROM "+f.inbox+" WHERE message_id = $1", msg.UUID)
	exec(t, plain, "DELETE FROM "+f.business+" WHERE id = $1", "billing:"+msg.UUID)
	if !otherIn.deliver(t, reused) {
		t.Fatal("the id claimed again after its row was purged: nacked")
	}
	if !in.deliver(t, reused) {
		t.Fatalf("a duplicate of what the other process committed was refused: %v", rec.last())
	}
	if n := reads(); n != 1 || calls.get(msg.UUID) != 1 {
		t.Errorf("after the purge: %d fingerprint reads, handler calls here %d; want 1 and 1", n, calls.get(msg.UUID))
	}
}

// The memory of recent fingerprints holds the RecentFingerprintsSize keys
// committed last: one more replaces the oldest, a key committed again
// takes no second place, and a fingerprint matches only its own key.
func TestReusedIDs_RecentFingerprintsKeepTheLatestKeys(t *testing.T) {
	t.Parallel()
	var r inbox.RecentFingerprints
	fp := func(i int) []byte {
		b := make([]byte, 16)
		b[0], b[1] = byte(i), byte(i>>8)
		return b
	}
	id := func(i int) string { return fmt.Sprint("order-", i) }
	n := inbox.RecentFingerprintsSize
	for i := range n + 10 {
		r.Remember("billing", id(i), fp(i))
		r.Remember("billing", id(i), fp(i)) // committed again: no second place
	}
	if r.Len() != n {
		t.Errorf("holds %d keys, want %d", r.Len(), n)
	}
	for i := range 10 {
		if r.Matches("billing", id(i), fp(i)) {
			t.Errorf("key %d of the oldest ten still held", i)
		}
	}
	for _, i := range []int{10, n / 2, n + 9} {
		if !r.Matches("billing", id(i), fp(i)) {
			t.Errorf("key %d, one of the latest, not held", i)
		}
		if r.Matches("billing", id(i), fp(i+1)) || r.Matches("shipping", id(i), fp(i)) {
			t.Errorf("key %d matched another fingerprint or consumer", i)
		}
	}
}
