package sqliteoutboxv4_test

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox/internal/testdb"
)

// Environment of the forwarder process that
// TestQueueDeleteOnAck_keeps_rows_of_a_killed_forwarder starts.
const (
	forwarderProcessDBEnv    = "SQLITEOUTBOXV4_FORWARDER_DB"
	forwarderProcessTopicEnv = "SQLITEOUTBOXV4_FORWARDER_TOPIC"
)

// TestForwarderProcess is not a test of its own: it is the forwarder
// process that TestQueueDeleteOnAck_keeps_rows_of_a_killed_forwarder runs
// and kills. It forwards the outbox to a destination that prints
// "published <uuid>" for a message and then never returns.
func TestForwarderProcess(t *testing.T) {
	path := os.Getenv(forwarderProcessDBEnv)
	if path == "" {
		t.Skip("the forwarder process of TestQueueDeleteOnAck_keeps_rows_of_a_killed_forwarder")
	}
	topic := os.Getenv(forwarderProcessTopicEnv)
	db := testdb.OpenSQLite(t, path)
	startForwarder(t, queueSubscriber(t, db, topic, 10), hangingPublisher{}, topic)
	time.Sleep(time.Hour) // until killed
}

// hangingPublisher prints "published <uuid>" for the first message it
// gets, and then never returns: the destination took the message, and the
// process dies before it confirms.
type hangingPublisher struct{}

func (hangingPublisher) Publish(_ string, msgs ...*message.Message) error {
	fmt.Printf("published %s\n", msgs[0].UUID)
	select {}
}

func (hangingPublisher) Close() error { return nil }

// With DeleteOnAck, a forwarder process killed (SIGKILL) after the
// destination took a message and before the ack leaves every row of its
// batch in the outbox; a new forwarder sends them, in order, and then the
// table is empty.
func TestQueueDeleteOnAck_keeps_rows_of_a_killed_forwarder(t *testing.T) {
	t.Parallel()
	path := newDBFile(t)
	db := testdb.OpenSQLite(t, path)
	topic := outboxTopic()
	queueSubscriber(t, db, topic, 10) // creates the table
	sent := publishThree(t, db, topic)

	cmd := exec.Command(os.Args[0], "-test.run=^TestForwarderProcess$", "-test.count=1")
	cmd.Env = append(os.Environ(), forwarderProcessDBEnv+"="+path, forwarderProcessTopicEnv+"="+topic)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	killed := false
	t.Cleanup(func() {
		if !killed {
			cmd.Process.Kill()
			cmd.Wait()
		}
	})
	lines := bufio.NewScanner(out)
	var published string
	for published == "" && lines.Scan() {
		published, _ = strings.CutPrefix(lines.Text(), "published ")
	}
	if published != sent[0] {
		t.Fatalf("the forwarder process published %q first (%v), want %s", published, lines.Err(), sent[0])
	}
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	killed = true
	if err := cmd.Wait(); err == nil {
		t.Fatal("the forwarder process exited cleanly, want killed")
	}

	if left := queuedUUIDs(t, db, topic); !slices.Equal(left, sent) {
		t.Fatalf("after the forwarder process was killed while publishing %s, the outbox holds %v, want %v", sent[0], left, sent)
	}

	dest := newDestination(t)
	next := receive(t, dest, "invoices")
	startForwarder(t, queueSubscriber(t, db, topic, 10), dest, topic)
	var got []string
	for range sent {
		got = append(got, next())
	}
	if !slices.Equal(got, sent) {
		t.Fatalf("the new forwarder sent %v, want %v", got, sent)
	}
	waitEmpty(t, db, topic)
}
