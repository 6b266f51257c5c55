//go:build unix

package inbox_test

// A relay process the crash tests SIGKILL, and the broker it publishes to.
//
// The broker is a file: fileBroker.Publish appends each message as one JSON
// line (one write(2) per message, O_APPEND) and fsyncs before it returns.
// That is a broker ack exactly: what Publish returned nil for is durable and
// outlives the process, and a process killed inside Publish leaves the lines
// already written (a broker that took part of a batch) without the relay
// hearing of them. Unlike kfake or NATS, it needs no second process that
// must survive the kill, keeps every copy (a broker that deduplicates would
// hide the duplicates the test counts), and costs nothing on a busy machine.
// A SIGKILL can tear a write(2) at a page boundary (Linux checks for a
// fatal signal between the pages it copies), leaving part of a line the
// relay was never told of; the next broker opened on the file cuts that
// tail off, as a broker drops a torn record it never acked.
//
// The relay process is this test binary run again with
// -test.run=^TestOutboxRelayProcess$ and its configuration in the
// environment (as brokers/ and soak/ start their workers). It relays until
// it SIGKILLs itself at the point it was told, is killed by the test, or,
// in drain mode, until the outbox is empty.

import (
	"bufio"
	"bytes"
	"context"
	"database/sql"
	"database/sql/driver"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/workerproc"
)

// relayProcessEnv holds a relay process's JSON relayProcessConfig; set, the
// test binary runs TestOutboxRelayProcess as a relay process.
const relayProcessEnv = "INBOX_OUTBOX_RELAY_PROCESS"

// Where a relay process SIGKILLs itself.
const (
	killBeforePublish = "before-publish" // in the At-th Publish call, before the broker got anything
	killMidBatch      = "mid-batch"      // in the At-th Publish call of 2 or more messages, after the broker took some of them
	killAfterPublish  = "after-publish"  // the broker took the whole At-th call; before the relay deleted the rows
	killBeforeCommit  = "before-commit"  // the At-th relay transaction deleted its rows; before its COMMIT
	killByTest        = "by-the-test"    // the test kills it at a random moment
	killNever         = "never (drains)" // relays until the outbox is empty, then exits
)

// relayProcessConfig is what a test tells a relay process.
type relayProcessConfig struct {
	Driver    string // database/sql driver name: pgx, mysql, sqlite
	DSN       string
	Table     string // outbox table
	Broker    string // the broker's file
	BatchSize int
	Kill      string // one of the kill points
	At        int    // which occurrence of the kill point kills
	ParentPID int
}

// Events a relay process reports, one line each on file descriptor 3.
const (
	evRelayReady = workerproc.EvReady // the database is open; the relay starts
	evRelayKill  = "K"                // "K <point>": it SIGKILLs itself now
	evRelayErr   = "E"                // "E <error>": a relay round failed
)

// TestOutboxRelayProcess is the relay process of the crash tests. Run on its
// own it skips.
func TestOutboxRelayProcess(t *testing.T) {
	var cfg relayProcessConfig
	if !workerproc.Config(t, relayProcessEnv, &cfg) {
		t.Skip("helper process of the outbox crash tests; runs only when they start it")
	}
	events := workerproc.OpenEvents()
	defer workerproc.ExitWhenOrphaned(cfg.ParentPID, nil)()
	k := &killSwitch{point: cfg.Kill, at: cfg.At, events: events}

	probe, err := sql.Open(cfg.Driver, cfg.DSN)
	if err != nil {
		t.Fatal(err)
	}
	drv := probe.Driver()
	probe.Close()
	db := sqlx.NewDb(sql.OpenDB(commitHookConnector{drv: drv, dsn: cfg.DSN, beforeCommit: func() { k.hit(killBeforeCommit, 0) }}), cfg.Driver)
	defer db.Close()
	db.SetMaxOpenConns(4)

	broker, err := openFileBroker(cfg.Broker, k)
	if err != nil {
		t.Fatal(err)
	}
	defer broker.Close()
	ob, err := inbox.NewOutbox(inbox.OutboxConfig{
		DB: db, Table: cfg.Table, Publisher: broker, BatchSize: cfg.BatchSize,
		PollInterval: 10 * time.Millisecond, MaxBackoff: 100 * time.Millisecond,
		OnRound: func(r inbox.OutboxRound) {
			if r.Err != nil {
				events.Send(evRelayErr, strings.ReplaceAll(r.Err.Error(), "\n", " "))
			}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := db.Ping(); err != nil {
		t.Fatal(err)
	}
	events.Send(evRelayReady, "-")
	if cfg.Kill != killNever {
		_ = ob.Run(context.Background()) // until it is killed
		return
	}
	// Until the table is empty: rows a killed relay's session still locks
	// (the server has not yet seen it gone) are skipped by a round, not gone.
	for {
		round := ob.RelayOnce(context.Background())
		if round.Err != nil || round.Relayed+round.DeadLettered > 0 {
			continue
		}
		stats, err := ob.Stats(context.Background())
		if err == nil && stats.Pending == 0 {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// killSwitch SIGKILLs the process at the at-th occurrence of its point.
type killSwitch struct {
	mu     sync.Mutex
	point  string
	at     int
	seen   int
	events *workerproc.Events
}

// hit counts an occurrence of point (of a publish of n messages, 0 for a
// commit) and kills the process if it is the one.
func (k *killSwitch) hit(point string, n int) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if point != k.point || (point == killMidBatch && n < 2) {
		return
	}
	k.seen++
	if k.seen == k.at {
		k.events.Send(evRelayKill, point)
		syscall.Kill(os.Getpid(), syscall.SIGKILL)
		time.Sleep(time.Hour) // never return
	}
}

// brokerLine is one message the file broker accepted.
type brokerLine struct {
	Topic    string            `json:"topic"`
	UUID     string            `json:"uuid"`
	Payload  []byte            `json:"payload"`
	Metadata map[string]string `json:"metadata"`
}

// fileBroker is a message.Publisher whose Publish returns once every message
// is in its file and the file is fsynced.
type fileBroker struct {
	mu   sync.Mutex
	f    *os.File
	kill *killSwitch
}

func openFileBroker(path string, kill *killSwitch) (*fileBroker, error) {
	if err := cutTornTail(path); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	if err != nil {
		return nil, err
	}
	return &fileBroker{f: f, kill: kill}, nil
}

// cutTornTail truncates the file at path after its last newline: what
// follows is part of a line whose writer was killed inside Publish, before
// the fsync that acks it. A file that does not exist is left alone.
func cutTornTail(path string) error {
	data, err := os.ReadFile(path)
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		return err
	}
	keep := bytes.LastIndexByte(data, '\n') + 1
	if keep == len(data) {
		return nil
	}
	return os.Truncate(path, int64(keep))
}

func (b *fileBroker) Publish(topic string, msgs ...*message.Message) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.kill.hit(killBeforePublish, len(msgs))
	for i, m := range msgs {
		line, err := json.Marshal(brokerLine{Topic: topic, UUID: m.UUID, Payload: m.Payload, Metadata: m.Metadata})
		if err != nil {
			return err
		}
		if _, err := b.f.Write(append(line, '\n')); err != nil {
			return err
		}
		if i == len(msgs)/2 {
			b.kill.hit(killMidBatch, len(msgs)) // the broker took msgs[:i+1]
		}
	}
	if err := b.f.Sync(); err != nil {
		return err
	}
	b.kill.hit(killAfterPublish, len(msgs))
	return nil
}

func (b *fileBroker) Close() error { return b.f.Close() }

// readBrokerFile returns every line of the broker's file, in order.
func readBrokerFile(t *testing.T, path string) []brokerLine {
	t.Helper()
	f, err := os.Open(path)
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var lines []brokerLine
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	for sc.Scan() {
		var l brokerLine
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			t.Fatalf("broker file line %d: %v: %q", len(lines)+1, err, sc.Text())
		}
		lines = append(lines, l)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return lines
}

// commitHookConnector opens connections of drv whose transactions call
// beforeCommit right before they send COMMIT.
type commitHookConnector struct {
	drv          driver.Driver
	dsn          string
	beforeCommit func()
}

func (c commitHookConnector) Connect(context.Context) (driver.Conn, error) {
	conn, err := c.drv.Open(c.dsn)
	if err != nil {
		return nil, err
	}
	return commitHookConn{Conn: conn, beforeCommit: c.beforeCommit}, nil
}

func (c commitHookConnector) Driver() driver.Driver { return c.drv }

type commitHookConn struct {
	driver.Conn
	beforeCommit func()
}

func (c commitHookConn) QueryContext(ctx context.Context, q string, args []driver.NamedValue) (driver.Rows, error) {
	return c.Conn.(driver.QueryerContext).QueryContext(ctx, q, args)
}

func (c commitHookConn) ExecContext(ctx context.Context, q string, args []driver.NamedValue) (driver.Result, error) {
	return c.Conn.(driver.ExecerContext).ExecContext(ctx, q, args)
}

func (c commitHookConn) CheckNamedValue(nv *driver.NamedValue) error {
	if ch, ok := c.Conn.(driver.NamedValueChecker); ok {
		return ch.CheckNamedValue(nv)
	}
	return driver.ErrSkip
}

func (c commitHookConn) BeginTx(ctx context.Context, o driver.TxOptions) (driver.Tx, error) {
	tx, err := c.Conn.(driver.ConnBeginTx).BeginTx(ctx, o)
	if err != nil {
		return nil, err
	}
	return commitHookTx{Tx: tx, beforeCommit: c.beforeCommit}, nil
}

func (c commitHookConn) ResetSession(ctx context.Context) error {
	if r, ok := c.Conn.(driver.SessionResetter); ok {
		return r.ResetSession(ctx)
	}
	return nil
}

func (c commitHookConn) IsValid() bool {
	if v, ok := c.Conn.(driver.Validator); ok {
		return v.IsValid()
	}
	return true
}

type commitHookTx struct {
	driver.Tx
	beforeCommit func()
}

func (tx commitHookTx) Commit() error {
	tx.beforeCommit()
	return tx.Tx.Commit()
}

// relayProcess is a relay process the test started.
type relayProcess struct {
	*workerproc.Process
	killed string   // the point it reported killing itself at (evRelayKill); set before Done is closed
	errs   []string // failed relay rounds (evRelayErr); set before Done is closed
}

func (p *relayProcess) output() string { return p.Out.String() }

// startRelayProcess starts a relay process with cfg; it is killed when t
// ends, if it still runs (a test that failed half-way leaves no process
// behind).
func startRelayProcess(t *testing.T, cfg relayProcessConfig) *relayProcess {
	t.Helper()
	cfg.ParentPID = os.Getpid()
	p := &relayProcess{}
	p.Process = workerproc.Start(t, "relay", "TestOutboxRelayProcess", relayProcessEnv, cfg, 3*time.Minute, func(kind, detail string) {
		switch kind {
		case evRelayKill:
			p.killed = detail
		case evRelayErr:
			p.errs = append(p.errs, detail)
		}
	})
	t.Cleanup(p.Kill)
	return p
}

// wait waits up to bound for the process to exit and returns its state.
func (p *relayProcess) wait(t *testing.T, bound time.Duration) *os.ProcessState {
	t.Helper()
	select {
	case <-p.Done:
		return p.State
	case <-time.After(bound):
		p.Kill()
		t.Fatalf("relay process (kill point %q) still running after %v; its output:\n%s", p.killed, bound, p.output())
		return nil
	}
}

// killedBySIGKILL reports whether state is that of a process SIGKILL ended.
func killedBySIGKILL(state *os.ProcessState) bool {
	ws, ok := state.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL
}

// outboxMessage is what a test committed to the outbox, to compare with
// what the broker got.
type outboxMessage struct {
	topic    string
	payload  []byte
	metadata map[string]string
}

func (m outboxMessage) String() string {
	return fmt.Sprintf("topic %q payload %q metadata %v", m.topic, m.payload, m.metadata)
}
