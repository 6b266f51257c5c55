package inbox_test

import (
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// The claim on a partitioned table: with the table's claim function, the key
// lock and the claim are one statement; without it, or with a function of
// that name that the inbox did not write, two. Either way each key is
// processed once.

// recordedPartitionedTable returns a pool that logs its statements to log
// and a new weekly-partitioned table made through it as an application makes
// one (InitializePartitions, InitializeSchema), with its claim function.
func recordedPartitionedTable(t *testing.T, log *statementLog) (plain, recorded *sqlx.DB, table string) {
	t.Helper()
	plain = testdb.OpenPostgres(t, "")
	recorded = openRecording(t, plain.Driver(), testdb.PostgresDSN(), "pgx", log)
	table = "inbox_" + randomSuffix()
	t.Cleanup(func() {
		plain.Exec("DROP TABLE IF EXISTS " + table + " CASCADE")
		plain.Exec("DROP FUNCTION IF EXISTS " + claimFunction(table) + "(text, text, bigint)")
		plain.Exec("DROP FUNCTION IF EXISTS " + claimFunction(table) + claimFunctionArgs)
	})
	newPartitionedInboxEvery(t, recorded, table, nil, inbox.PartitionWeek)
	return plain, recorded, table
}

// claimFunction is the name of table's claim function (for names short
// enough not to be shortened).
func claimFunction(table string) string { return table + "_claim" }

// claimFunctionArgs are the argument types of the claim function an inbox
// with the default Config.ReusedIDs calls: the overload that stores the
// content's fingerprint.
const claimFunctionArgs = "(text, text, bigint, bytea)"

// countingHandler returns a middleware-wrapped handler of ib that counts
// its calls.
func countingHandler(ib *inbox.Inbox, calls *atomic.Int32) message.HandlerFunc {
	return ib.Middleware(func(*message.Message) ([]*message.Message, error) {
		calls.Add(1)
		return nil, nil
	})
}

// newPartitioned returns a new Inbox on the partitioned table.
func newPartitioned(t *testing.T, db *sqlx.DB, table string) *inbox.Inbox {
	t.Helper()
	ib, err := inbox.New(inbox.Config{DB: db, Dialect: inbox.PostgreSQLPartitioned, Table: table, Consumer: "billing"})
	if err != nil {
		t.Fatal(err)
	}
	return ib
}

// claimStatements returns the statements of log that lock a key or claim:
// those that name the key lock or the table.
func claimStatements(log []string, table string) []string {
	var out []string
	for _, q := range log {
		if strings.Contains(q, "pg_advisory_xact_lock") || strings.Contains(q, `"`+table) {
			out = append(out, q)
		}
	}
	return out
}

func TestPartitioned_LocksTheKeyAndClaimsInOneStatement(t *testing.T) {
	t.Parallel()
	var log statementLog
	plain, db, table := recordedPartitionedTable(t, &log)
	var calls atomic.Int32
	h := countingHandler(newPartitioned(t, db, table), &calls)
	first := message.NewMessage(watermill.NewUUID(), nil)
	if _, err := h(first); err != nil { // resolves the table and its function
		t.Fatal(err)
	}
	log.take()
	second := message.NewMessage(watermill.NewUUID(), nil)
	for _, msg := range []*message.Message{second, second, first} {
		if _, err := h(msg); err != nil {
			t.Fatal(err)
		}
	}
	// The two duplicates are of keys this inbox committed: their
	// fingerprints match from memory (Config.ReusedIDs).
	statements := func() (stmts []string, reads int) {
		for _, q := range log.take() {
			if strings.HasPrefix(q, "SELECT fingerprint FROM") {
				reads++
				continue
			}
			stmts = append(stmts, q)
		}
		return stmts, reads
	}
	stmts, reads := statements()
	if len(stmts) != 3 || !strings.Contains(stmts[0], `"`+claimFunction(table)+`"($1, $2, $3, $4)`) || stmts[1] != stmts[0] || stmts[2] != stmts[0] || reads != 0 {
		t.Errorf("three deliveries sent %q and %d fingerprint reads; want one call of the claim function each (BEGIN and COMMIT aside) and no read", stmts, reads)
	}
	// Another process's inbox, which did not commit the key, reads the
	// stored fingerprint of a duplicate.
	other := countingHandler(newPartitioned(t, db, table), &calls)
	if _, err := other(second); err != nil { // resolves the table and its function
		t.Fatal(err)
	}
	log.take()
	if _, err := other(first); err != nil {
		t.Fatal(err)
	}
	if stmts, reads := statements(); len(stmts) != 1 || !strings.Contains(stmts[0], `"`+claimFunction(table)+`"(`) || reads != 1 {
		t.Errorf("a duplicate in another process sent %q and %d fingerprint reads; want the claim function and one read", stmts, reads)
	}
	if n := calls.Load(); n != 2 {
		t.Errorf("handler ran %d times for 2 messages delivered 6 times", n)
	}
	if n := count(t, plain, table, ""); n != 2 {
		t.Errorf("%d inbox rows, want 2", n)
	}
}

// A table made before the claim function existed (or by a migration
// without it): two statements, and still one handler call for two
// concurrent deliveries. Once the function is added, an Inbox uses it
// without a restart: at once after its own InitializeSchema, and at its next
// look for the function when a migration added it.
func TestPartitioned_ClaimsWithoutTheClaimFunction(t *testing.T) {
	t.Parallel()
	var log statementLog
	plain, db, table := recordedPartitionedTable(t, &log)
	exec(t, plain, "DROP FUNCTION "+claimFunction(table)+claimFunctionArgs)
	log.take()
	initializer, migrated := newPartitioned(t, db, table), newPartitioned(t, db, table)
	inbox.SetClaimFunctionRecheck(migrated, time.Millisecond)
	if n := concurrentTwice(t, initializer, migrated); n != 1 {
		t.Errorf("handler ran %d times for one message delivered twice at once", n)
	}
	stmts := claimStatements(log.take(), table)
	if !slices.Contains(stmts, "SELECT pg_advisory_xact_lock($1)") || slices.ContainsFunc(stmts, func(q string) bool { return strings.Contains(q, claimFunction(table)) }) {
		t.Errorf("without the claim function the deliveries sent %q; want the key lock and the claim as two statements", stmts)
	}

	if err := initializer.InitializeSchema(t.Context()); err != nil { // adds the function
		t.Fatal(err)
	}
	time.Sleep(10 * time.Millisecond) // past migrated's next look for the function
	for name, ib := range map[string]*inbox.Inbox{"the Inbox that ran InitializeSchema": initializer, "another Inbox": migrated} {
		log.take()
		var calls atomic.Int32
		if _, err := countingHandler(ib, &calls)(message.NewMessage(watermill.NewUUID(), nil)); err != nil {
			t.Fatal(err)
		}
		if stmts := claimStatements(log.take(), table); len(stmts) != 1 || !strings.Contains(stmts[0], claimFunction(table)) {
			t.Errorf("after the claim function was added, a delivery through %s sent %q; want one call of the claim function", name, stmts)
		}
		if n := calls.Load(); n != 1 {
			t.Errorf("handler of %s ran %d times for one message", name, n)
		}
	}
}

// A function of the claim function's name that is not the inbox's (here
// one that claims nothing and says it did) is never called.
func TestPartitioned_IgnoresAClaimFunctionItDidNotWrite(t *testing.T) {
	t.Parallel()
	var log statementLog
	plain, db, table := recordedPartitionedTable(t, &log)
	exec(t, plain, "CREATE OR REPLACE FUNCTION "+claimFunction(table)+
		claimFunctionArgs+" RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$BEGIN RETURN true; END$$")
	var calls atomic.Int32
	h := countingHandler(newPartitioned(t, db, table), &calls)
	msg := message.NewMessage(watermill.NewUUID(), nil)
	for range 2 {
		if _, err := h(msg); err != nil {
			t.Fatal(err)
		}
	}
	if n := calls.Load(); n != 1 {
		t.Errorf("handler ran %d times for one message delivered twice", n)
	}
	if n := count(t, plain, table, ""); n != 1 {
		t.Errorf("%d inbox rows, want 1", n)
	}
}

// The claim function dropped while an Inbox uses it: the delivery that
// meets it missing fails (nack, no handler call, nothing written) and the
// next one claims in two statements.
func TestPartitioned_ClaimFunctionDroppedWhileInUse(t *testing.T) {
	t.Parallel()
	var log statementLog
	plain, db, table := recordedPartitionedTable(t, &log)
	var calls atomic.Int32
	h := countingHandler(newPartitioned(t, db, table), &calls)
	if _, err := h(message.NewMessage(watermill.NewUUID(), nil)); err != nil {
		t.Fatal(err)
	}
	exec(t, plain, "DROP FUNCTION "+claimFunction(table)+claimFunctionArgs)
	msg := message.NewMessage(watermill.NewUUID(), nil)
	if _, err := h(msg); err == nil {
		t.Fatal("a delivery whose claim function was dropped returned no error")
	}
	if n := calls.Load(); n != 1 {
		t.Fatalf("handler ran %d times, want 1 (the first message only)", n)
	}
	for range 2 {
		if _, err := h(msg); err != nil {
			t.Fatal(err)
		}
	}
	if n := calls.Load(); n != 2 {
		t.Errorf("handler ran %d times, want 2: the redelivered message once", n)
	}
	if n := count(t, plain, table, ""); n != 2 {
		t.Errorf("%d inbox rows, want 2", n)
	}
}
