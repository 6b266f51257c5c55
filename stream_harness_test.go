package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// The fault streams. A fault test drives the middleware through a real
// message.Router with a stream of messages, injects one kind of
// database fault while the stream flows, redelivers every nacked message
// until it is acked (as a broker does), and then checks what a user cares
// about:
//
//   - every message's business row (here: a ledger row, with no unique key,
//     so a second processing would show as a second row) exists exactly once,
//     and the inbox rows are exactly the ledger's messages, joined both ways;
//   - every nack carries an error that inbox.IsTransient accepts, every ack
//     comes from a committed transaction (OnProcessed) or a duplicate
//     (OnDuplicate), and each faulted attempt was nacked;
//   - no connection stays checked out (db.Stats().InUse == 0) and no session
//     of the test's pool is left idle in a transaction on the server.
//
// Faults are made deterministic by observing the server (pg_stat_activity,
// SHOW ENGINE INNODB STATUS) rather than by sleeping; every wait is bounded
// by the test's context.

// faultTimeout bounds one fault test's stream: a fault that makes the
// middleware hang fails the test instead of hanging it.
const faultTimeout = 25 * time.Second

// pair forces two messages to collide: each does its first step, then
// waits until the other has done its own (pair.wait), and every other
// message waits until both have (so no third transaction can take a lock
// between them, which would block one of the pair on the database while the
// other waits for it in the test: a deadlock the database cannot see).
type pair struct {
	a, b  string
	aDone chan struct{}
	bDone chan struct{}
	aOnce sync.Once
	bOnce sync.Once
}

func newPair(a, b *message.Message) *pair {
	return &pair{a: a.UUID, b: b.UUID, aDone: make(chan struct{}), bDone: make(chan struct{})}
}

func (p *pair) member(msg *message.Message) bool { return msg.UUID == p.a || msg.UUID == p.b }

// done marks msg's first step done; it may be called more than once.
func (p *pair) done(msg *message.Message) {
	if msg.UUID == p.a {
		p.aOnce.Do(func() { close(p.aDone) })
	} else {
		p.bOnce.Do(func() { close(p.bDone) })
	}
}

// wait waits until both of the pair have done their first step.
func (p *pair) wait(ctx context.Context, what string) error {
	if err := waitCh(ctx, p.aDone, what); err != nil {
		return err
	}
	return waitCh(ctx, p.bDone, what)
}

// Metadata keys that the stream sets on every delivery.
const (
	attemptKey  = "fault_attempt"  // 1 for the first delivery of a message, 2 for its redelivery, ...
	deliveryKey = "fault_delivery" // unique per delivery
)

func attemptOf(msg *message.Message) int {
	n, _ := strconv.Atoi(msg.Metadata.Get(attemptKey))
	return n
}

// faultDelivery is what happened to one delivery of a message.
type faultDelivery struct {
	id      string // message UUID
	attempt int
	acked   bool
	err     error  // what the middleware returned to the router
	outcome string // the inbox hook called for it: processed, duplicate, failed ("" for none)
}

// faultEnv is one fault test's router, inbox and tables on one database.
type faultEnv struct {
	t        *testing.T
	d        *faultDB
	inbox    string
	ledger   string
	consumer string
	in       *feed

	seq      atomic.Int64
	mu       sync.Mutex
	errs     map[string]error  // by delivery key
	outcomes map[string]string // by delivery key
	log      []faultDelivery
}

// faultHandler is a test's handler: tx is the inbox transaction, attempt
// the delivery's attempt number. It must write the ledger row (e.ledgerRow).
type faultHandler func(msg *message.Message, tx *sqlx.Tx, attempt int) error

// newFaultEnv creates the inbox and ledger tables and starts a router whose
// only handler, "faults", runs h inside the inbox (cfg's hooks are kept and
// the env's recorders added).
func newFaultEnv(t *testing.T, d *faultDB, cfg inbox.Config, h faultHandler) *faultEnv {
	t.Helper()
	sfx := randomSuffix()
	e := &faultEnv{
		t: t, d: d, inbox: "inbox_" + sfx, ledger: "ledger_" + sfx, consumer: "faults", in: newFeed(),
		errs: map[string]error{}, outcomes: map[string]string{},
	}
	ddl := "CREATE TABLE " + e.ledger + " (message_id VARCHAR(255) NOT NULL, attempt INT NOT NULL, block_commit BOOLEAN NOT NULL DEFAULT false)"
	if d.dialect == inbox.MySQL {
		ddl += " ENGINE=InnoDB"
	}
	exec(t, d.ctl, ddl)
	dropLater(t, d.ctl, e.ledger)
	dropLater(t, d.ctl, e.inbox)

	cfg.DB, cfg.Table, cfg.Dialect = d.pool, e.inbox, d.dialect
	cfg.OnProcessed = chainHook(cfg.OnProcessed, e.hook("processed"))
	cfg.OnDuplicate = chainHook(cfg.OnDuplicate, e.hook("duplicate"))
	cfg.OnFailed = chainHook(cfg.OnFailed, e.hook("failed"))
	ib, err := inbox.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(e.record, ib.Middleware)
		r.AddConsumerHandler(e.consumer, "orders", e.in, func(msg *message.Message) error {
			tx, ok := inbox.TxFromContext(msg.Context())
			if !ok {
				return errors.New("no inbox transaction")
			}
			return h(msg, tx, attemptOf(msg))
		})
	})
	return e
}

func chainHook(a, b func(inbox.Event)) func(inbox.Event) {
	if a == nil {
		return b
	}
	return func(ev inbox.Event) { a(ev); b(ev) }
}

func (e *faultEnv) hook(outcome string) func(inbox.Event) {
	return func(ev inbox.Event) {
		key := ev.Message.Metadata.Get(deliveryKey)
		e.mu.Lock()
		defer e.mu.Unlock()
		if prev, ok := e.outcomes[key]; ok {
			e.t.Errorf("delivery %s: hook %s after %s", key, outcome, prev)
		}
		e.outcomes[key] = outcome
	}
}

// record is the outermost middleware: it keeps what the router got for each
// delivery, before the router acks or nacks.
func (e *faultEnv) record(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		msgs, err := h(msg)
		e.mu.Lock()
		e.errs[msg.Metadata.Get(deliveryKey)] = err
		e.mu.Unlock()
		return msgs, err
	}
}

// ledgerRow writes the message's business row through the inbox transaction.
func (e *faultEnv) ledgerRow(msg *message.Message, tx *sqlx.Tx, attempt int, blockCommit bool) error {
	_, err := tx.ExecContext(msg.Context(), tx.Rebind("INSERT INTO "+e.ledger+" (message_id, attempt, block_commit) VALUES (?, ?, ?)"),
		msg.UUID, attempt, blockCommit)
	return err
}

// deliver delivers one attempt of msg and waits for the router's ack or
// nack, or for ctx to end (an error).
func (e *faultEnv) deliver(ctx context.Context, msg *message.Message, attempt int) (faultDelivery, error) {
	key := strconv.FormatInt(e.seq.Add(1), 10)
	m := msg.Copy()
	m.Metadata.Set(attemptKey, strconv.Itoa(attempt))
	m.Metadata.Set(deliveryKey, key)
	acked, err := e.in.send(ctx, m)
	if err != nil {
		return faultDelivery{}, fmt.Errorf("attempt %d: %w", attempt, err)
	}
	d := faultDelivery{id: msg.UUID, attempt: attempt, acked: acked}
	e.mu.Lock()
	defer e.mu.Unlock()
	d.err = e.errs[key]
	d.outcome = e.outcomes[key]
	e.log = append(e.log, d)
	return d, nil
}

// deliverUntilAcked delivers msg, and redelivers it after each nack (with a
// short jittered pause, as a broker's redelivery has), until it is acked.
func (e *faultEnv) deliverUntilAcked(ctx context.Context, msg *message.Message, firstAttempt int) error {
	for attempt := firstAttempt; ; attempt++ {
		d, err := e.deliver(ctx, msg, attempt)
		if err != nil {
			return err
		}
		if d.acked {
			return nil
		}
		pause := time.Duration(rand.IntN(5*min(attempt, 20))+1) * time.Millisecond
		select {
		case <-ctx.Done():
			return fmt.Errorf("message %s: still nacked after %d attempts (last: %v): %w", msg.UUID, attempt, d.err, ctx.Err())
		case <-time.After(pause):
		}
	}
}

// stream delivers msgs in order with `workers` concurrent deliverers, each
// message redelivered until acked. A message is taken by the next free
// worker, so a message whose handler waits does not hold back the next one.
func (e *faultEnv) stream(ctx context.Context, msgs []*message.Message, workers int) {
	e.t.Helper()
	queue := make(chan *message.Message)
	errc := make(chan error, workers)
	var wg sync.WaitGroup
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for msg := range queue {
				if err := e.deliverUntilAcked(ctx, msg, 1); err != nil {
					errc <- err
					return
				}
			}
		}()
	}
	var failed error
feed:
	for _, msg := range msgs {
		select {
		case queue <- msg:
		case failed = <-errc:
			break feed
		}
	}
	close(queue)
	wg.Wait()
	close(errc)
	if failed == nil {
		failed = <-errc
	}
	if failed != nil {
		e.t.Fatalf("stream did not complete: %v", failed)
	}
}

func newMessages(n int) []*message.Message {
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(watermill.NewUUID(), []byte(strconv.Itoa(i)))
		msgs[i].Metadata.Set("n", strconv.Itoa(i))
	}
	return msgs
}

func ids(msgs []*message.Message) []string {
	out := make([]string, len(msgs))
	for i, m := range msgs {
		out[i] = m.UUID
	}
	return out
}

// deliveries returns the log of one message's deliveries, in order.
func (e *faultEnv) deliveries(id string) []faultDelivery {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []faultDelivery
	for _, d := range e.log {
		if d.id == id {
			out = append(out, d)
		}
	}
	return out
}

// nacks returns every nacked delivery.
func (e *faultEnv) nacks() []faultDelivery {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []faultDelivery
	for _, d := range e.log {
		if !d.acked {
			out = append(out, d)
		}
	}
	return out
}

// nackSummary counts the nacks by error code, with one example of each.
func (e *faultEnv) nackSummary() string {
	counts, example := map[string]int{}, map[string]string{}
	var order []string
	for _, n := range e.nacks() {
		d := describeErr(n.err)
		code, _, _ := strings.Cut(d, "]")
		code += "]"
		if counts[code] == 0 {
			order = append(order, code)
			example[code] = d
		}
		counts[code]++
	}
	var b strings.Builder
	for _, code := range order {
		fmt.Fprintf(&b, "\n\t%dx %s", counts[code], example[code])
	}
	return b.String()
}

// checkDeliveries checks every delivery: an ack is a committed transaction
// or a duplicate and carries no error; a nack carries a transient error and
// went through OnFailed. It returns how many deliveries of each message were
// processed (committed).
func (e *faultEnv) checkDeliveries() map[string]int {
	e.t.Helper()
	e.mu.Lock()
	defer e.mu.Unlock()
	processed := map[string]int{}
	for _, d := range e.log {
		switch {
		case d.acked && d.err != nil:
			e.t.Errorf("message %s attempt %d: acked with error %v", d.id, d.attempt, d.err)
		case d.acked && d.outcome != "processed" && d.outcome != "duplicate":
			e.t.Errorf("message %s attempt %d: acked, but its transaction neither committed nor found a duplicate (hook %q)", d.id, d.attempt, d.outcome)
		case !d.acked && d.err == nil:
			e.t.Errorf("message %s attempt %d: nacked without an error", d.id, d.attempt)
		case !d.acked && d.outcome != "failed":
			e.t.Errorf("message %s attempt %d: nacked, hook %q (want failed)", d.id, d.attempt, d.outcome)
		case !d.acked && !inbox.IsTransient(d.err):
			e.t.Errorf("message %s attempt %d: nacked with an error IsTransient rejects: %s", d.id, d.attempt, describeErr(d.err))
		}
		if d.outcome == "processed" {
			processed[d.id]++
		}
	}
	return processed
}

// checkExactlyOnce checks the database: one ledger row per message, the
// inbox rows of the consumer exactly the ledger's messages (joined both
// ways), every message committed by exactly one delivery, no leaks.
func (e *faultEnv) checkExactlyOnce(want []string) {
	e.t.Helper()
	t := e.t
	processed := e.checkDeliveries()
	for _, id := range want {
		if processed[id] != 1 {
			t.Errorf("message %s: %d deliveries committed, want 1", id, processed[id])
		}
	}
	e.checkRows(want)
	e.d.checkNoLeaks(t)
}

// checkRows checks the ledger and inbox tables hold each message of want
// exactly once and nothing else.
func (e *faultEnv) checkRows(want []string) {
	e.t.Helper()
	t, db := e.t, e.d.ctl
	ctx := context.Background()
	var rows []struct {
		ID string `db:"message_id"`
		N  int    `db:"n"`
	}
	if err := db.SelectContext(ctx, &rows, "SELECT message_id, COUNT(*) AS n FROM "+e.ledger+" GROUP BY message_id"); err != nil {
		t.Fatal(err)
	}
	ledger := map[string]int{}
	for _, r := range rows {
		ledger[r.ID] = r.N
	}
	var inboxIDs []string
	if err := db.SelectContext(ctx, &inboxIDs, db.Rebind("SELECT message_id FROM "+e.inbox+" WHERE consumer = ?"), e.consumer); err != nil {
		t.Fatal(err)
	}
	inInbox := map[string]int{}
	for _, id := range inboxIDs {
		inInbox[id]++
	}
	wanted := map[string]bool{}
	for _, id := range want {
		wanted[id] = true
		if ledger[id] != 1 || inInbox[id] != 1 {
			t.Errorf("message %s: ledger rows %d, inbox rows %d, want 1 and 1", id, ledger[id], inInbox[id])
		}
	}
	for id := range ledger {
		if !wanted[id] {
			t.Errorf("ledger row for unknown message %s", id)
		}
	}
	if len(inboxIDs) != len(want) || len(ledger) != len(want) {
		t.Errorf("inbox rows %d, ledger messages %d, want %d", len(inboxIDs), len(ledger), len(want))
	}
	var orphans struct {
		Inbox  int `db:"inbox_only"`
		Ledger int `db:"ledger_only"`
	}
	q := "SELECT" +
		" (SELECT COUNT(*) FROM " + e.inbox + " i WHERE NOT EXISTS (SELECT 1 FROM " + e.ledger + " l WHERE l.message_id = i.message_id)) AS inbox_only," +
		" (SELECT COUNT(*) FROM " + e.ledger + " l WHERE NOT EXISTS (SELECT 1 FROM " + e.inbox + " i WHERE i.message_id = l.message_id AND i.consumer = ?)) AS ledger_only"
	if err := db.GetContext(ctx, &orphans, db.Rebind(q), e.consumer); err != nil {
		t.Fatal(err)
	}
	if orphans.Inbox != 0 || orphans.Ledger != 0 {
		t.Errorf("inbox rows without a ledger row: %d; ledger rows without an inbox row: %d", orphans.Inbox, orphans.Ledger)
	}
}

// wantFaultNacked checks that msg's attempt was nacked with a transient
// error, and that its last delivery was acked; it returns the error.
func (e *faultEnv) wantFaultNacked(msg *message.Message, attempt int, what string) error {
	e.t.Helper()
	ds := e.deliveries(msg.UUID)
	if len(ds) < attempt {
		e.t.Errorf("%s: message %s has %d deliveries, want attempt %d", what, msg.UUID, len(ds), attempt)
		return nil
	}
	d := ds[attempt-1]
	if d.acked {
		e.t.Errorf("%s: attempt %d of message %s was acked, want a nack", what, attempt, msg.UUID)
	} else if !inbox.IsTransient(d.err) {
		e.t.Errorf("%s: IsTransient(%s) = false", what, describeErr(d.err))
	}
	if !ds[len(ds)-1].acked {
		e.t.Errorf("%s: the last delivery of message %s was nacked", what, msg.UUID)
	}
	e.t.Logf("%s: attempt %d nacked with %s", what, attempt, describeErr(d.err))
	return d.err
}
