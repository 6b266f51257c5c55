// Package workerproc is the harness of the tests that run their workers as
// processes of their own, so that they can SIGKILL one between a commit and
// its ack (the soak and the broker tests): the test's side starts a worker
// (the test binary running one test), reads the events it reports and keeps
// the tail of its output; the worker's side reads its configuration,
// reports its events and exits when its test is gone.
//
// A worker reports events as lines "<kind> <detail>" on file descriptor 3,
// each written with one write(2), unbuffered, so that a SIGKILL loses
// nothing it wrote before.
package workerproc

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"runtime/pprof"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// The events this package handles itself; the others are the caller's.
const (
	EvReady = "R" // the worker handles SIGTERM from now on: "R -"
	EvInUse = "U" // connections in use after a graceful stop: "U <n>"
)

// Process is one worker process.
type Process struct {
	Name  string
	Cmd   *exec.Cmd
	Out   *Tail         // the last 32 KiB of its output
	Ready chan struct{} // closed on EvReady: SIGTERM then stops it gracefully
	Done  chan struct{} // closed once it exited and its events were read

	// Set before Done is closed.
	InUse int // EvInUse's count; -1 when it reported none
	State *os.ProcessState
}

// Start runs test (a test of the running test binary) as worker name, with
// cfg as JSON in the environment variable env and a test timeout of
// timeout. onEvent gets every event but EvReady and EvInUse, in order, from
// the goroutine that reads them.
func Start(tb testing.TB, name, test, env string, cfg any, timeout time.Duration, onEvent func(kind, detail string)) *Process {
	tb.Helper()
	raw, err := json.Marshal(cfg)
	if err != nil {
		tb.Fatal(err)
	}
	rd, wr, err := os.Pipe()
	if err != nil {
		tb.Fatal(err)
	}
	p := &Process{Name: name, Out: &Tail{}, Ready: make(chan struct{}), Done: make(chan struct{}), InUse: -1}
	p.Cmd = exec.Command(os.Args[0], "-test.run=^"+test+"$", "-test.count=1", "-test.timeout="+timeout.String())
	p.Cmd.Env = append(os.Environ(), env+"="+string(raw))
	p.Cmd.Stdout, p.Cmd.Stderr = p.Out, p.Out
	p.Cmd.ExtraFiles = []*os.File{wr} // file descriptor 3: events
	if err := p.Cmd.Start(); err != nil {
		tb.Fatal(err)
	}
	wr.Close()
	var ready sync.Once
	go func() {
		sc := bufio.NewScanner(rd)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			kind, detail, _ := strings.Cut(sc.Text(), " ")
			switch kind {
			case EvReady:
				ready.Do(func() { close(p.Ready) })
			case EvInUse:
				fmt.Sscan(detail, &p.InUse)
			default:
				onEvent(kind, detail)
			}
		}
		rd.Close()
		_ = p.Cmd.Wait()
		p.State = p.Cmd.ProcessState
		close(p.Done)
	}()
	return p
}

// Kill SIGKILLs the worker if it still runs and waits until it exited.
func (p *Process) Kill() {
	select {
	case <-p.Done:
		return
	default:
	}
	_ = p.Cmd.Process.Kill()
	<-p.Done
}

// Terminate sends SIGTERM once the worker handles it (EvReady), or does
// nothing if it has exited; an error, with its output, when it did neither
// within bound.
func (p *Process) Terminate(bound time.Duration) error {
	select {
	case <-p.Ready:
	case <-p.Done:
		return nil
	case <-time.After(bound):
		return fmt.Errorf("%s did not start within %v:\n%s", p.Name, bound, p.Out)
	}
	_ = p.Cmd.Process.Signal(syscall.SIGTERM)
	return nil
}

// Await waits up to bound for the worker to exit; an error, with its
// output, when it still runs.
func (p *Process) Await(bound time.Duration) error {
	select {
	case <-p.Done:
		return nil
	case <-time.After(bound):
		return fmt.Errorf("%s did not stop within %v of SIGTERM:\n%s", p.Name, bound, p.Out)
	}
}

// CleanExit returns an error unless the exited worker's status is 0 and it
// reported no database connection in use (EvInUse).
func (p *Process) CleanExit() error {
	switch {
	case !p.State.Success():
		return fmt.Errorf("%s stopped with %v, want a clean exit:\n%s", p.Name, p.State, p.Out)
	case p.InUse != 0:
		return fmt.Errorf("%s: %d database connections in use after its router stopped, want 0", p.Name, p.InUse)
	}
	return nil
}

// Config reads the worker's configuration from the environment variable
// env into cfg; false when env is not set (the test binary is not a
// worker: the worker test skips).
func Config(tb testing.TB, env string, cfg any) bool {
	raw := os.Getenv(env)
	if raw == "" {
		return false
	}
	if err := json.Unmarshal([]byte(raw), cfg); err != nil {
		tb.Fatal(err)
	}
	return true
}

// Events is the worker's side of the event lines.
type Events struct {
	mu sync.Mutex
	f  *os.File
}

// OpenEvents returns the worker's events, on file descriptor 3.
func OpenEvents() *Events { return &Events{f: os.NewFile(3, "events")} }

// Send reports one event; a worker whose test is gone exits (status 3):
// there is nothing left to report to.
func (e *Events) Send(kind, detail string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if _, err := e.f.WriteString(kind + " " + detail + "\n"); err != nil {
		os.Exit(3)
	}
}

// ExitWhenOrphaned exits the worker (status 2) once its parent, the test
// that started it, is gone: an orphan stops by itself. logf, when not nil,
// says so first. The returned function stops the watch (defer it: a worker
// that ends its test leaves no goroutine behind for goleak).
func ExitWhenOrphaned(parentPID int, logf func(format string, args ...any)) (stop func()) {
	done := make(chan struct{})
	go func() {
		tick := time.NewTicker(200 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-tick.C:
				if os.Getppid() != parentPID {
					if logf != nil {
						logf("parent gone, exiting")
					}
					os.Exit(2)
				}
			}
		}
	}()
	return func() { close(done) }
}

// Ready reports EvReady and returns a context that ends at SIGTERM: the
// test sends SIGTERM only after EvReady, so that the signal's default
// action (exit) never cuts a graceful stop short.
func (e *Events) Ready() (context.Context, context.CancelFunc) {
	sig, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	e.Send(EvReady, "-")
	return sig, stop
}

// SelfKill makes a worker SIGKILL itself right after its n-th commit,
// before the ack: the redelivery a crash between COMMIT and ack causes.
// It is safe for concurrent use.
type SelfKill struct {
	after   int64
	commits atomic.Int64
}

// NewSelfKill returns the SelfKill of a worker that dies after its n-th
// commit; 0: never.
func NewSelfKill(n int) *SelfKill { return &SelfKill{after: int64(n)} }

// AfterCommit registers, in the handler of a message with context ctx,
// the count of its commit: at the n-th, report is called (it sends the
// event that says so) and the process SIGKILLs itself, never returning to
// ack.
func (k *SelfKill) AfterCommit(ctx context.Context, report func()) {
	if k.after <= 0 {
		return
	}
	inbox.AfterCommit(ctx, func() {
		if k.commits.Add(1) == k.after {
			report()
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			time.Sleep(time.Hour) // never return: no ack
		}
	})
}

// RunRouter runs router until sig ends (SIGTERM: see Ready), then closes
// it; a close that fails prints every goroutine's stack, for the failure
// report, and fails tb.
func RunRouter(tb testing.TB, router *message.Router, sig context.Context) {
	closed := make(chan error, 1)
	go func() {
		<-sig.Done()
		<-router.Running() // a SIGTERM during setup: close once it runs
		closed <- router.Close()
	}()
	if err := router.Run(context.Background()); err != nil {
		tb.Fatalf("router: %v", err)
	}
	if err := <-closed; err != nil {
		_ = pprof.Lookup("goroutine").WriteTo(os.Stderr, 1)
		tb.Errorf("router close: %v", err)
	}
}

// ReportInUse reports (EvInUse) how many of db's connections are still in
// use once the router stopped, and returns it. A transaction whose
// context ended is rolled back, and its connection returned, by
// database/sql's own goroutine a moment after Commit or Rollback returned
// the context's error: it waits up to 2 s for that.
func (e *Events) ReportInUse(db *sqlx.DB) int {
	inUse := db.Stats().InUse
	for deadline := time.Now().Add(2 * time.Second); inUse != 0 && time.Now().Before(deadline); inUse = db.Stats().InUse {
		time.Sleep(10 * time.Millisecond)
	}
	e.Send(EvInUse, fmt.Sprint(inUse))
	return inUse
}

// Tail keeps the last 32 KiB written to it: a worker's output. It is safe
// for concurrent use.
type Tail struct {
	mu  sync.Mutex
	buf []byte
}

func (t *Tail) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.buf = append(t.buf, p...)
	if over := len(t.buf) - 32<<10; over > 0 {
		t.buf = append(t.buf[:0], t.buf[over:]...)
	}
	return len(p), nil
}

func (t *Tail) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(t.buf)
}
