// Package conformance is the inbox's contract (the design contract's
// Semantics) written once, as test cases that every backend runs: package
// inbox on database/sql for each dialect (PostgreSQL, PostgreSQL
// partitioned, MySQL/MariaDB, SQLite) and package pgxinbox on PostgreSQL and
// PostgreSQL partitioned. Each case runs a real Watermill router
// (internal/testrouter) against the real database and asserts what a user
// cares about: handler calls, business rows, inbox rows, acks, hooks.
//
// A new capability adds its cases here once; a backend opts in by
// describing itself with a Backend and calling Run.
package conformance

import (
	"context"
	"crypto/sha256"
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
	"github.com/watermill-inbox/inbox/internal/testrouter"
)

// Backend is what the suite needs of one backend.
type Backend struct {
	// DB reaches the backend's database, for the suite's own reads and DDL
	// (its Rebind gives the driver's placeholders).
	DB *sqlx.DB
	// Dialect is the inbox's dialect on DB.
	Dialect inbox.Dialect
	// New returns the middleware of a new inbox on table with opts, whose
	// table it creates (InitializeSchema) unless opts.NoSchema, or the
	// constructor's error; it closes the inbox when t ends.
	New func(t *testing.T, table string, opts Options) (message.HandlerMiddleware, error)
	// Write inserts msg.UUID into the one-column (id) table business
	// through the message's inbox transaction, as a handler does.
	Write func(msg *message.Message, business string) error
	// Exec runs query (no bind parameters) through the message's inbox
	// transaction and returns its error.
	Exec func(msg *message.Message, query string) error
	// InTx reports whether ctx carries the backend's inbox transaction
	// (its TxFromContext).
	InTx func(ctx context.Context) bool
	// ConnsInUse, when set, returns how many connections of the backend's
	// pool are checked out; the cases that end a transaction every way
	// check that none stays so.
	ConnsInUse func() int
}

// Options are the inbox settings a case chooses; the backend maps them to
// its own Config.
type Options struct {
	OnProcessed, OnDuplicate, OnFailed, OnReusedID func(inbox.Event)
	ReusedIDs                                      inbox.ReusedIDCheck
	Fingerprint                                    func(*message.Message) []byte
	MessageID                                      func(*message.Message) (string, error)
	// Consumer is Config.Consumer (default: the handler name).
	Consumer string
	Logger   watermill.LoggerAdapter
	// NoSchema leaves the table as it is: the case made it.
	NoSchema bool
	// Outbox, when set, is where the handler's outputs go: the backend
	// plugs it into its Config.Outbox (inbox.Outbox.Publisher, or
	// pgxinbox.OutboxPublisher).
	Outbox *inbox.Outbox
	// OutboxPublisher, when set (and Outbox is not), is the publisher the
	// backend's Config.Outbox returns for every transaction.
	OutboxPublisher message.Publisher
}

// cases are the suite, by name.
var cases = []struct {
	name string
	run  func(t *testing.T, b Backend)
}{
	{"ProcessedOnceAndDuplicatesSkipped", processedOnce},
	{"HandlerErrorRollsBackAndTheRedeliveryProcesses", handlerErrorRollsBack},
	{"HandlerPanicRollsBack", handlerPanic},
	{"EmptyMessageIDRefusedBeforeAnyWrite", emptyMessageID},
	{"InvalidKeysRefusedBeforeAnyWrite", invalidKeys},
	{"LongestMessageIDStoredAsItIs", longestMessageID},
	{"SecondDeliveryWaitsForTheFirstThatCommits", secondWaitsForCommit},
	{"SecondDeliveryClaimsAfterTheFirstRollsBack", secondClaimsAfterRollback},
	{"ReusedIDWithOtherContentIsRefused", reusedIDRefused},
	{"ReusedIDWhileTheFirstIsInFlight", reusedIDInFlight},
	{"ReusedIDWarningSkipsTheDelivery", reusedIDWarning},
	{"ReusedIDFingerprintOfYourChoice", reusedIDFingerprint},
	{"ReusedIDTableWithoutTheColumn", reusedIDWithoutColumn},
	{"ReusedIDCheckOff", reusedIDOff},
	{"TwoConsumersEachProcessOnce", twoConsumers},
	{"ClaimRunsOnTheMessageContext", claimOnMessageContext},
	{"MessageContextRestoredAfterTheMiddleware", contextRestored},
	{"RetryOutsideRunsEachAttemptInItsOwnTransaction", retryOutside},
	{"PoisonedMessageIsNotMarkedProcessed", poisonOutside},
	{"NestedInboxIsRefused", nestedInbox},
	{"HandlerEndingTheTransactionIsNotAcked", handlerEndsTransaction},
	{"IgnoredStatementErrorAckedOnlyIfCommitted", ignoredStatementError},
	{"InvalidTableNameRefused", invalidTableName},
	{"OutputsLeaveIfAndOnlyIfCommitted", outputsIffCommitted},
	{"ContextEndingAfterTheHandlerReturnedStillCommits", contextEndsAfterHandler},
	{"ProcessedAtAndPurgeCutoffAreTheDatabaseClock", databaseClock},
	{"ClaimThatNoPartitionAcceptsIsTransient", claimWithoutPartition},
}

// Run runs every case of the suite on b, one after the other (so that
// Backend.ConnsInUse counts one case's connections); backends run in
// parallel with each other.
func Run(t *testing.T, b Backend) {
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) { c.run(t, b) })
	}
}

// fixture is one case's inbox table, business table and router.
type fixture struct {
	t               *testing.T
	b               Backend
	inbox, business string
	feed            *testrouter.Feed
	outcomes        *testrouter.Outcomes
	calls           sync.Map // message UUID → *atomic.Int32
	hooks           hookCounts
	handlerFails    atomic.Bool
	handlerPanics   atomic.Bool
	// hold, when set, blocks the handler of a message with that payload
	// until it is closed, after sending on entered.
	hold     chan struct{}
	entered  chan struct{}
	heldOnce atomic.Bool // the held copy has run: later copies do not block
	failHeld atomic.Bool // the held copy's handler fails after its write
	// afterCommits counts the inbox.AfterCommit functions that ran; the
	// handler registers one per call.
	afterCommits atomic.Int32
	// ignoredStatement, when set, is run by the handler after its write
	// through Backend.Exec, its error ignored (a handler's mistake).
	ignoredStatement atomic.Pointer[string]
	// emit: the handler publishes one output (topic outputTopic, UUID
	// msg.UUID+"-out", metadata "source") through inbox.OutboxFromContext
	// after its write.
	emit bool
}

// outputTopic is the topic of the handler's outputs.
const outputTopic = "conf_invoices"

// newFixture names the tables (dropped when t ends) and creates the
// business table.
func newFixture(t *testing.T, b Backend) *fixture {
	t.Helper()
	s := testdb.RandomSuffix()
	f := &fixture{t: t, b: b, inbox: "conf_inbox_" + s, business: "conf_effect_" + s}
	testdb.DropLater(t, b.DB, f.inbox)
	testdb.DropLater(t, b.DB, f.business)
	f.exec("CREATE TABLE " + f.business + " (id VARCHAR(255) NOT NULL)")
	return f
}

func (f *fixture) exec(query string) {
	f.t.Helper()
	if _, err := f.b.DB.Exec(query); err != nil {
		f.t.Fatalf("%s: %v", query, err)
	}
}

func (f *fixture) count(table, where string, args ...any) int {
	f.t.Helper()
	q := "SELECT COUNT(*) FROM " + table
	if where != "" {
		q += " WHERE " + where
	}
	var n int
	if err := f.b.DB.Get(&n, f.b.DB.Rebind(q), args...); err != nil {
		f.t.Fatal(err)
	}
	return n
}

// newMiddleware returns the middleware of a new inbox on f.inbox with opts,
// its hooks counted in f.hooks.
func (f *fixture) newMiddleware(opts Options) message.HandlerMiddleware {
	f.t.Helper()
	mw, err := f.b.New(f.t, f.inbox, f.hooks.wrap(opts))
	if err != nil {
		f.t.Fatal(err)
	}
	return mw
}

// start runs the handler "billing" (f.handle) behind a new inbox with opts
// (its hooks counted in f.hooks), and behind outer, outermost first.
func (f *fixture) start(opts Options, outer ...message.HandlerMiddleware) {
	f.t.Helper()
	f.run("billing", f.newMiddleware(opts), outer...)
}

// run runs the handler name (f.handle) behind mw and outer, with
// Recoverer between them, as Inbox.Middlewares puts it: a panic becomes
// the router's error after the inbox rolled back.
func (f *fixture) run(name string, mw message.HandlerMiddleware, outer ...message.HandlerMiddleware) {
	f.t.Helper()
	f.feed, f.outcomes = testrouter.RunHandler(f.t, name, f.handle, append(outer, middleware.Recoverer, mw)...)
}

// handle is the case's handler: it counts its calls, registers an
// AfterCommit function, writes one business row (and emits one output when
// f.emit), and then fails, panics or ends as the fixture says.
func (f *fixture) handle(msg *message.Message) error {
	n, _ := f.calls.LoadOrStore(msg.UUID, new(atomic.Int32))
	n.(*atomic.Int32).Add(1)
	inbox.AfterCommit(msg.Context(), func() { f.afterCommits.Add(1) })
	held := f.hold != nil && string(msg.Payload) == "held" && !f.heldOnce.Load()
	if held {
		f.entered <- struct{}{}
		<-f.hold
	}
	if err := f.b.Write(msg, f.business); err != nil {
		return err
	}
	if f.emit {
		pub, ok := inbox.OutboxFromContext(msg.Context())
		if !ok {
			return errors.New("no outbox publisher in the message context")
		}
		out := message.NewMessage(msg.UUID+"-out", []byte("invoice for "+msg.UUID))
		out.Metadata.Set("source", msg.UUID)
		if err := pub.Publish(outputTopic, out); err != nil {
			return err
		}
	}
	if q := f.ignoredStatement.Load(); q != nil {
		_ = f.b.Exec(msg, *q) // the mistake under test
	}
	if held && f.failHeld.Load() {
		return handlerError()
	}
	if f.handlerFails.Load() {
		return handlerError() // after its write, which must roll back
	}
	if f.handlerPanics.Load() {
		panic("handler bug after its write")
	}
	return nil
}

// declinedError is the handler's error type, so that errors.As is checked
// through the inbox.
type declinedError struct{ order int }

func (e *declinedError) Error() string { return fmt.Sprintf("order %d: card declined", e.order) }

// errDeclined is what a failing handler's error wraps: the router must get
// the handler's error as it is.
var errDeclined = &declinedError{order: 7}

// handlerError is the error a failing handler returns.
func handlerError() error { return fmt.Errorf("charge: %w", errDeclined) }

func (f *fixture) handlerCalls(id string) int32 {
	n, ok := f.calls.Load(id)
	if !ok {
		return 0
	}
	return n.(*atomic.Int32).Load()
}

func (f *fixture) deliver(msg *message.Message) bool { return f.feed.Deliver(f.t, msg) }

// expectNoConnHeld fails the case if a connection of the backend's pool
// stays checked out (a pool may give a broken one back a moment later: it
// waits up to 10 s).
func (f *fixture) expectNoConnHeld() {
	f.t.Helper()
	if f.b.ConnsInUse == nil {
		return
	}
	deadline := time.Now().Add(10 * time.Second)
	for f.b.ConnsInUse() != 0 {
		if time.Now().After(deadline) {
			f.t.Errorf("%d connections still checked out", f.b.ConnsInUse())
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// expect checks the handler calls for id, the business rows and the inbox
// rows.
func (f *fixture) expect(id string, calls int32, effects, inboxRows int) {
	f.t.Helper()
	if c, e, i := f.handlerCalls(id), f.count(f.business, ""), f.count(f.inbox, ""); c != calls || e != effects || i != inboxRows {
		f.t.Errorf("handler calls %d, business rows %d, inbox rows %d; want %d, %d and %d", c, e, i, calls, effects, inboxRows)
	}
}

// hookCounts counts the inbox's hooks.
type hookCounts struct{ processed, duplicates, failed, reused atomic.Int32 }

func (h *hookCounts) wrap(opts Options) Options {
	opts.OnProcessed = count(&h.processed, opts.OnProcessed)
	opts.OnDuplicate = count(&h.duplicates, opts.OnDuplicate)
	opts.OnFailed = count(&h.failed, opts.OnFailed)
	opts.OnReusedID = count(&h.reused, opts.OnReusedID)
	return opts
}

func count(n *atomic.Int32, next func(inbox.Event)) func(inbox.Event) {
	return func(e inbox.Event) {
		n.Add(1)
		if next != nil {
			next(e)
		}
	}
}

func (h *hookCounts) expect(t *testing.T, processed, duplicates, failed, reused int32) {
	t.Helper()
	if h.processed.Load() != processed || h.duplicates.Load() != duplicates || h.failed.Load() != failed || h.reused.Load() != reused {
		t.Errorf("hooks: processed %d, duplicate %d, failed %d, reused id %d; want %d, %d, %d and %d",
			h.processed.Load(), h.duplicates.Load(), h.failed.Load(), h.reused.Load(), processed, duplicates, failed, reused)
	}
}

// Semantics 1 and 2: a message delivered three times is processed once; the
// two duplicates are acked without a handler call.
func processedOnce(t *testing.T, b Backend) {
	f := newFixture(t, b)
	f.start(Options{})
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order":1}`))
	for i := range 3 {
		if !f.deliver(msg) {
			t.Fatalf("delivery %d nacked: %v", i+1, f.outcomes.Last())
		}
	}
	f.expect(msg.UUID, 1, 1, 1)
	f.hooks.expect(t, 1, 2, 0, 0)
	f.expectNoConnHeld()
}

// Semantics 3: a handler error rolls back its writes with the claim and
// reaches the router as it is (errors.Is matches); the redelivery
// processes the message.
func handlerErrorRollsBack(t *testing.T, b Backend) {
	f := newFixture(t, b)
	f.start(Options{})
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order":2}`))
	f.failThenProcess(msg, &f.handlerFails, func(err error) bool {
		var declined *declinedError
		return errors.As(err, &declined) && declined == errDeclined && err.Error() == handlerError().Error()
	})
}

// failThenProcess delivers msg while fail is set (its handler writes, then
// fails), checks that it was nacked with an error that wantErr accepts and
// left nothing, then redelivers it with fail cleared and checks that it
// was processed once; no connection stays checked out either time.
func (f *fixture) failThenProcess(msg *message.Message, fail *atomic.Bool, wantErr func(error) bool) {
	f.t.Helper()
	fail.Store(true)
	if f.deliver(msg) {
		f.t.Fatal("a failing handler's message was acked")
	}
	if err := f.outcomes.Last(); !wantErr(err) {
		f.t.Errorf("router got %v", err)
	}
	f.expect(msg.UUID, 1, 0, 0)
	f.expectNoConnHeld()
	if n := f.afterCommits.Load(); n != 0 {
		f.t.Errorf("%d AfterCommit functions ran for a rolled-back delivery, want 0", n)
	}
	fail.Store(false)
	if !f.deliver(msg) {
		f.t.Fatalf("redelivery nacked: %v", f.outcomes.Last())
	}
	f.expect(msg.UUID, 2, 1, 1)
	f.hooks.expect(f.t, 1, 0, 1, 0)
	f.expectNoConnHeld()
	if n := f.afterCommits.Load(); n != 1 {
		f.t.Errorf("%d AfterCommit functions ran, want 1 (the committed delivery's)", n)
	}
}

// Semantics 4: a handler that panics after its write leaves nothing (the
// write and the claim roll back), the router nacks, OnFailed is called, and
// the redelivery processes the message.
func handlerPanic(t *testing.T, b Backend) {
	f := newFixture(t, b)
	f.start(Options{})
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order":3}`))
	f.failThenProcess(msg, &f.handlerPanics, func(err error) bool {
		var panicErr middleware.RecoveredPanicError
		return errors.As(err, &panicErr) && panicErr.V == "handler bug after its write"
	})
}

// Semantics 7: a message without an id (another producer's message, no
// Watermill UUID) is refused with ErrInvalidMessageID and ErrEmptyMessageID
// before anything is written; the handler is not called.
func emptyMessageID(t *testing.T, b Backend) {
	f := newFixture(t, b)
	f.start(Options{})
	if f.deliver(message.NewMessage("", []byte(`{"order":4}`))) {
		t.Fatal("a message without an id was acked")
	}
	if err := f.outcomes.Last(); !errors.Is(err, inbox.ErrInvalidMessageID) || !errors.Is(err, inbox.ErrEmptyMessageID) || inbox.IsTransient(err) {
		t.Errorf("router got %v, want a permanent error wrapping ErrInvalidMessageID and ErrEmptyMessageID", err)
	}
	f.expect("", 0, 0, 0)
	f.hooks.expect(t, 0, 0, 1, 0)
}

// Semantics 7 and 8: a message id over 255 bytes, one that is not valid
// UTF-8 and one with a NUL byte are refused with the exported sentinels,
// and so is an empty consumer (the middleware called outside a router,
// without Config.Consumer); nothing is written, the handler is not
// called, and IsTransient says no redelivery can succeed.
func invalidKeys(t *testing.T, b Backend) {
	for _, tc := range []struct {
		name   string
		id     string
		router bool
		want   []error
	}{
		{"IDOver255Bytes", strings.Repeat("é", 128), true, []error{inbox.ErrInvalidMessageID, inbox.ErrMessageIDTooLong}},
		{"IDInvalidUTF8", "order-\xff", true, []error{inbox.ErrInvalidMessageID}},
		{"IDWithNUL", "order\x001", true, []error{inbox.ErrInvalidMessageID}},
		{"EmptyConsumer", "order-1", false, []error{inbox.ErrInvalidConsumer, inbox.ErrEmptyConsumer}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, b)
			opts := Options{MessageID: func(*message.Message) (string, error) { return tc.id, nil }}
			msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order":5}`))
			var err error
			if tc.router {
				f.start(opts)
				if f.deliver(msg) {
					t.Fatal("a message with an invalid key was acked")
				}
				err = f.outcomes.Last()
			} else {
				_, err = f.newMiddleware(opts)(func(msg *message.Message) ([]*message.Message, error) {
					t.Error("handler called without a consumer")
					return nil, nil
				})(msg)
			}
			for _, want := range tc.want {
				if !errors.Is(err, want) {
					t.Errorf("error %v does not wrap %v", err, want)
				}
			}
			if inbox.IsTransient(err) {
				t.Errorf("IsTransient(%v) = true: no redelivery can succeed", err)
			}
			f.expect(msg.UUID, 0, 0, 0)
			f.expectNoConnHeld()
		})
	}
}

// Semantics 7: a 255-byte message id (127 two-byte runes and one byte) is
// valid and stored byte for byte.
func longestMessageID(t *testing.T, b Backend) {
	f := newFixture(t, b)
	id := strings.Repeat("é", 127) + "x"
	f.start(Options{MessageID: func(*message.Message) (string, error) { return id, nil }})
	if !f.deliver(message.NewMessage(watermill.NewUUID(), []byte(`{"order":6}`))) {
		t.Fatalf("a 255-byte id was nacked: %v", f.outcomes.Last())
	}
	var got string
	if err := f.b.DB.Get(&got, "SELECT message_id FROM "+f.inbox); err != nil {
		t.Fatal(err)
	}
	if got != id {
		t.Errorf("stored id %q, want %q", got, id)
	}
}

// Semantics 1: a second delivery of a key whose first is in flight does
// not run the handler beside it: when the first commits, the second is a
// duplicate (acked, handler not called). Whether the second's claim waited
// on the first's row or began after its commit, the outcome is the same.
func secondWaitsForCommit(t *testing.T, b Backend) {
	f := newFixture(t, b)
	f.hold, f.entered = make(chan struct{}), make(chan struct{}, 1)
	f.start(Options{})
	id := watermill.NewUUID()
	first, second := f.deliverWhileHeld(id, "held")
	if !first || !second {
		t.Fatalf("first acked %v, second acked %v, want both: %v", first, second, f.outcomes.Last())
	}
	f.expect(id, 1, 1, 1)
	f.hooks.expect(t, 1, 1, 0, 0)
	f.expectNoConnHeld()
}

// Semantics 1: when the in-flight first delivery rolls back (its handler
// fails), the second claims the key and runs the handler.
func secondClaimsAfterRollback(t *testing.T, b Backend) {
	f := newFixture(t, b)
	f.hold, f.entered = make(chan struct{}), make(chan struct{}, 1)
	f.start(Options{})
	f.failHeld.Store(true)
	id := watermill.NewUUID()
	first, second := f.deliverWhileHeld(id, "held")
	if first || !second {
		t.Fatalf("first acked %v, second acked %v, want the first nacked and the second acked: %v", first, second, f.outcomes.Last())
	}
	f.expect(id, 2, 1, 1)
	f.hooks.expect(t, 1, 0, 1, 0)
	f.expectNoConnHeld()
}

// deliverWhileHeld delivers id with payload held (its handler blocks on
// f.hold), then, once that handler runs, a second copy with the same
// payload, and releases the first; it returns whether each was acked.
func (f *fixture) deliverWhileHeld(id, payload string) (first, second bool) {
	firstc, secondc := make(chan bool, 1), make(chan bool, 1)
	go func() { firstc <- f.feed.Deliver(f.t, message.NewMessage(id, []byte(payload))) }()
	<-f.entered
	f.heldOnce.Store(true) // only the first copy blocks
	go func() { secondc <- f.feed.Deliver(f.t, message.NewMessage(id, []byte(payload))) }()
	close(f.hold)
	return <-firstc, <-secondc
}

func sha256Prefix(b []byte) []byte {
	sum := sha256.Sum256(b)
	return sum[:16]
}

// storedFingerprint returns the fingerprint column of the key billing/id.
func (f *fixture) storedFingerprint(id string) []byte {
	f.t.Helper()
	var fp []byte
	if err := f.b.DB.Get(&fp, f.b.DB.Rebind("SELECT fingerprint FROM "+f.inbox+" WHERE consumer = 'billing' AND message_id = ?"), id); err != nil {
		f.t.Fatal(err)
	}
	return fp
}

// Semantics 15: a processed id comes again with the same payload (a
// duplicate) and with another (a producer reused the id): the latter is
// nacked with ErrMessageIDReused, which IsTransient calls permanent,
// reported to OnReusedID and OnFailed, and writes nothing; its redelivery is
// refused again.
func reusedIDRefused(t *testing.T, b Backend) {
	f := newFixture(t, b)
	f.start(Options{})
	id := watermill.NewUUID()
	first := message.NewMessage(id, []byte(`{"invoice":1,"amount":100}`))
	for _, label := range []string{"first delivery", "its duplicate"} {
		if !f.deliver(first) {
			t.Fatalf("%s nacked: %v", label, f.outcomes.Last())
		}
	}
	if got := f.storedFingerprint(id); string(got) != string(sha256Prefix(first.Payload)) {
		t.Errorf("stored fingerprint %x, want the first 16 bytes of the payload's SHA-256 %x", got, sha256Prefix(first.Payload))
	}
	other := message.NewMessage(id, []byte(`{"invoice":2,"amount":250}`))
	for i := range 2 {
		if f.deliver(other) {
			t.Fatalf("delivery %d of another payload under a processed id acked, want refused", i+1)
		}
		err := f.outcomes.Last()
		if !errors.Is(err, inbox.ErrMessageIDReused) || inbox.IsTransient(err) {
			t.Fatalf("error %v (transient %v), want a permanent one wrapping ErrMessageIDReused", err, inbox.IsTransient(err))
		}
	}
	f.expect(id, 1, 1, 1)
	if got := f.storedFingerprint(id); string(got) != string(sha256Prefix(first.Payload)) {
		t.Errorf("stored fingerprint changed to %x by a refused delivery", got)
	}
	f.hooks.expect(t, 1, 1, 2, 2)
}

// A reused id whose first delivery is still in flight: the second waits on
// the key until the first commits, then compares with the committed row's
// fingerprint and is refused; the first is processed.
func reusedIDInFlight(t *testing.T, b Backend) {
	f := newFixture(t, b)
	f.hold, f.entered = make(chan struct{}), make(chan struct{}, 1)
	f.start(Options{})
	id := watermill.NewUUID()
	first := make(chan bool, 1)
	go func() { first <- f.feed.Deliver(t, message.NewMessage(id, []byte("held"))) }()
	<-f.entered
	second := make(chan bool, 1)
	go func() { second <- f.feed.Deliver(t, message.NewMessage(id, []byte("other content"))) }()
	// The second claim now waits for the first transaction (or, on SQLite,
	// for the write lock); either way it runs after the first commits.
	close(f.hold)
	if !<-first {
		t.Fatal("the first delivery was nacked")
	}
	if <-second {
		t.Fatal("the reused id was acked while the first delivery committed it")
	}
	f.expect(id, 1, 1, 1)
	f.hooks.expect(t, 1, 0, 1, 1)
}

// infoLog keeps the Info lines it is given.
type infoLog struct {
	watermill.NopLogger
	mu    sync.Mutex
	lines []string
}

func (l *infoLog) Info(msg string, fields watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, msg+" "+fmt.Sprint(fields))
}

func (l *infoLog) With(watermill.LogFields) watermill.LoggerAdapter { return l }

func (l *infoLog) matching(parts ...string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, line := range l.lines {
		all := true
		for _, p := range parts {
			all = all && strings.Contains(line, p)
		}
		if all {
			n++
		}
	}
	return n
}

// With ReusedIDsWarn a reused id is logged at Info with both fingerprints,
// reported to OnReusedID, and skipped as a duplicate (acked, OnDuplicate).
func reusedIDWarning(t *testing.T, b Backend) {
	f := newFixture(t, b)
	logs := &infoLog{}
	f.start(Options{ReusedIDs: inbox.ReusedIDsWarn, Logger: logs})
	id := watermill.NewUUID()
	if !f.deliver(message.NewMessage(id, []byte("order 1"))) || !f.deliver(message.NewMessage(id, []byte("order 2"))) {
		t.Fatalf("a delivery nacked under ReusedIDsWarn: %v", f.outcomes.Last())
	}
	f.expect(id, 1, 1, 1)
	f.hooks.expect(t, 1, 1, 0, 1)
	if n := logs.matching("message id reused for other content", id, "stored_fingerprint:"); n != 1 {
		t.Errorf("%d Info lines about the reused id with its fingerprints, want 1; logged %q", n, logs.lines)
	}
}

// Config.Fingerprint chooses what identifies the event: the same event sent
// again with a new timestamp is a duplicate when the fingerprint leaves the
// timestamp out; another amount under the same id is refused.
func reusedIDFingerprint(t *testing.T, b Backend) {
	f := newFixture(t, b)
	f.start(Options{Fingerprint: func(msg *message.Message) []byte { return []byte(msg.Metadata.Get("amount")) }})
	id := watermill.NewUUID()
	send := func(payload, amount string) bool {
		msg := message.NewMessage(id, []byte(payload))
		msg.Metadata.Set("amount", amount)
		return f.deliver(msg)
	}
	if !send(`{"at":"10:00"}`, "100") || !send(`{"at":"10:05"}`, "100") {
		t.Fatalf("the same event sent again with another timestamp nacked: %v", f.outcomes.Last())
	}
	if send(`{"at":"10:00"}`, "250") {
		t.Fatal("another amount under the same id acked, want refused")
	}
	f.hooks.expect(t, 1, 1, 1, 1)
}

// A table made before the fingerprint column keeps working with the check
// off (a reused id is a duplicate) and the inbox logs the ALTER TABLE that
// adds it; once added, an inbox started again matches the rows written
// without a fingerprint to any content and refuses reused ids of new rows.
func reusedIDWithoutColumn(t *testing.T, b Backend) {
	f := newFixture(t, b)
	f.newMiddleware(Options{}) // creates the table
	f.exec("ALTER TABLE " + f.inbox + " DROP COLUMN fingerprint")
	logs := &infoLog{}
	f.start(Options{Logger: logs, NoSchema: true})
	id := watermill.NewUUID()
	if !f.deliver(message.NewMessage(id, []byte("order 1"))) || !f.deliver(message.NewMessage(id, []byte("order 2"))) {
		t.Fatalf("a delivery nacked on a table without the column: %v", f.outcomes.Last())
	}
	f.hooks.expect(t, 1, 1, 0, 0)
	fix := inbox.AddFingerprintColumnSQL(b.Dialect, f.inbox)
	if logs.matching(fix) != 1 {
		t.Errorf("no Info line names the fix %q; logged %q", fix, logs.lines)
	}

	f.exec(fix)
	f.start(Options{NoSchema: true}) // the service starts again
	if !f.deliver(message.NewMessage(id, []byte("order 3"))) {
		t.Fatalf("a row written without a fingerprint did not match: %v", f.outcomes.Last())
	}
	fresh := watermill.NewUUID()
	if !f.deliver(message.NewMessage(fresh, []byte("order 4"))) {
		t.Fatalf("new message nacked: %v", f.outcomes.Last())
	}
	if f.deliver(message.NewMessage(fresh, []byte("order 5"))) {
		t.Error("reused id acked once the column was added, want refused")
	}
	if f.handlerCalls(id) != 1 || f.handlerCalls(fresh) != 1 {
		t.Errorf("handler calls: %d for the old id, %d for the new one, want 1 each", f.handlerCalls(id), f.handlerCalls(fresh))
	}
}

// With ReusedIDsOff no fingerprint is stored and none is compared: a reused
// id is a duplicate.
func reusedIDOff(t *testing.T, b Backend) {
	f := newFixture(t, b)
	f.start(Options{ReusedIDs: inbox.ReusedIDsOff})
	id := watermill.NewUUID()
	if !f.deliver(message.NewMessage(id, []byte("order 1"))) || !f.deliver(message.NewMessage(id, []byte("order 2"))) {
		t.Fatalf("nacked with ReusedIDsOff: %v", f.outcomes.Last())
	}
	if fp := f.storedFingerprint(id); fp != nil {
		t.Errorf("stored fingerprint %x with ReusedIDsOff, want NULL", fp)
	}
	f.hooks.expect(t, 1, 1, 0, 0)
}
