package inbox_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	osexec "os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// forwarderProcessEnv carries a forwarderProcess, as JSON, to the test
// binary started as a forwarder process.
const forwarderProcessEnv = "INBOX_TEST_FORWARDER_PROCESS"

// forwarderProcess is what the forwarder process relays.
type forwarderProcess struct {
	Server string // outboxServers entry
	Topic  string // the outbox's SQL topic
	Events string // file the destination publisher appends "published <uuid>" lines to
}

// With watermill-sql v4's queue schema and delete-on-ack as the inbox's
// outbox, a row leaves the outbox table only once the forwarder has
// published it, and the table is empty once everything is forwarded: it is
// bounded by what is not yet forwarded. A forwarder process SIGKILLed right
// after its destination publish, before its ack (the DELETE) commits, leaves
// the row in the table; a new forwarder publishes it again and then deletes
// it. What a forwarder restart sends twice: the messages it published but
// whose DELETE had not committed, at most SubscribeBatchSize of them (1
// here); the downstream inbox absorbs them as duplicates. On PostgreSQL and
// MariaDB.
func TestBoundedOutboxKeepsRowUntilForwarded(t *testing.T) {
	for _, server := range outboxServers {
		t.Run(server, func(t *testing.T) {
			t.Parallel()
			odb := openOutboxDB(t, server)
			o := newSQLOutbox(t, outboxV4Queue, odb.db, odb.pg)
			f := newFixture(t, odb.db)
			ib := f.newInbox(inbox.Config{Outbox: o.factory})
			in := newFeed()
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(ib.Middleware)
				r.AddHandler("billing", "orders", in, "invoices", &recordingPublisher{fail: true}, func(msg *message.Message) ([]*message.Message, error) {
					if err := f.writeBusinessRow(msg); err != nil {
						return nil, err
					}
					return []*message.Message{ofMessage(msg.UUID)}, nil
				})
			})
			var orders []string
			for range 5 {
				m := message.NewMessage(watermill.NewUUID(), nil)
				if !in.deliver(t, m) {
					t.Fatal("nacked")
				}
				orders = append(orders, m.UUID)
			}
			if n := o.rows(t); n != 5 {
				t.Fatalf("outbox rows = %d, want 5", n)
			}

			events := t.TempDir() + "/events"
			spec, err := json.Marshal(forwarderProcess{Server: server, Topic: o.topic, Events: events})
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), caseTimeout)
			defer cancel()
			cmd := osexec.CommandContext(ctx, os.Args[0], "-test.run=^TestBoundedOutboxForwarderProcess$", "-test.count=1")
			cmd.Env = append(os.Environ(), forwarderProcessEnv+"="+string(spec))
			var stderr bytes.Buffer
			cmd.Stdout, cmd.Stderr = &stderr, &stderr
			err = cmd.Run()
			var exit *osexec.ExitError
			if !errors.As(err, &exit) || exit.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
				t.Fatalf("forwarder process: %v, want killed by SIGKILL; output:\n%s", err, stderr.String())
			}
			raw, err := os.ReadFile(events)
			if err != nil {
				t.Fatal(err)
			}
			sent := strings.Fields(strings.ReplaceAll(string(raw), "published", ""))
			if len(sent) != 1 || sent[0] != orders[0] {
				t.Fatalf("the killed forwarder published %v, want exactly the first order's invoice (%s)", sent, orders[0])
			}
			if n := o.rows(t); n != 5 {
				t.Fatalf("after the forwarder was killed between publish and ack, outbox rows = %d, want 5: a row was deleted before its ack", n)
			}

			sink := newForwardedSink()
			o.runForwarder(t, sink)
			waitFor(t, func() bool { return o.rows(t) == 0 })
			for _, id := range orders {
				if got := sink.get("invoices", id); got != 1 {
					t.Errorf("order %s: the new forwarder published its invoice %d times, want 1", id, got)
				}
			}
			if got := sink.sum(); got != 5 {
				t.Errorf("the new forwarder published %d messages, want 5 (the killed one's again, and the 4 others)", got)
			}
		})
	}
}

// TestBoundedOutboxForwarderProcess is the forwarder process of
// TestBoundedOutboxKeepsRowUntilForwarded: it relays the outbox with the
// queue schema and delete-on-ack, and its destination publisher appends the
// message's "of" to the events file, then SIGKILLs the process before the
// forwarder can ack. Run on its own it skips.
func TestBoundedOutboxForwarderProcess(t *testing.T) {
	raw := os.Getenv(forwarderProcessEnv)
	if raw == "" {
		t.Skip("helper process of TestBoundedOutboxKeepsRowUntilForwarded; runs only when it starts it")
	}
	var spec forwarderProcess
	if err := json.Unmarshal([]byte(raw), &spec); err != nil {
		t.Fatal(err)
	}
	var db = testdb.OpenMySQL
	if spec.Server == "postgres" {
		db = testdb.OpenPostgres
	}
	_, newSub := outboxV4Queue.adapters(db(t, ""), spec.Server == "postgres")
	sub, _, err := newSub()
	if err != nil {
		t.Fatal(err)
	}
	events, err := os.OpenFile(spec.Events, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	fwd, err := forwarder.NewForwarder(sub, killingPublisher{events}, watermill.NopLogger{}, forwarder.Config{ForwarderTopic: spec.Topic})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), caseTimeout)
	defer cancel()
	err = fwd.Run(ctx)
	t.Fatalf("the forwarder process was not killed: Run returned %v", err)
}

// killingPublisher records each message's "of" in its file, synced, and
// then SIGKILLs its own process: the destination publish happened, the ack
// never does.
type killingPublisher struct{ f *os.File }

func (p killingPublisher) Publish(_ string, msgs ...*message.Message) error {
	for _, m := range msgs {
		if _, err := p.f.WriteString("published " + m.Metadata.Get("of") + "\n"); err != nil {
			return err
		}
	}
	if err := p.f.Sync(); err != nil {
		return err
	}
	if err := syscall.Kill(os.Getpid(), syscall.SIGKILL); err != nil {
		return err
	}
	time.Sleep(time.Minute) // the signal is on its way
	return errors.New("not killed")
}

func (killingPublisher) Close() error { return nil }

// The bounded outbox forwards if and only if the inbox transaction commits,
// as the default schemas do (see TestOutboxV4PublishesIffCommitted), and
// its table is empty once everything is forwarded.
func TestBoundedOutboxPublishesIffCommitted(t *testing.T) {
	testOutboxPublishesIffCommitted(t, outboxV4Queue)
}

// watermill-sql v4.1.2's subscriber, once it stops in the middle of a batch
// (Close while a message waits for its ack), still acks every row of the
// batch it read: with the queue schema and delete-on-ack, the rows it never
// delivered are deleted. With SubscribeBatchSize 1, which the docs
// recommend for the bounded outbox, a batch is the one row in flight, and a
// Close before its ack deletes nothing. This documents why.
func TestQueueSchemaCloseMidBatchDeletesUndeliveredRows(t *testing.T) {
	for _, server := range outboxServers {
		t.Run(server, func(t *testing.T) {
			t.Parallel()
			odb := openOutboxDB(t, server)
			for _, batch := range []int{100, 1} {
				kind := outboxV4Queue
				kind.adapters = func(db *sqlx.DB, pg bool) (func(*sqlx.Tx) (message.Publisher, error), func() (message.Subscriber, func(string) error, error)) {
					var schema wsql.SchemaAdapter = wsql.MySQLQueueSchema{SubscribeBatchSize: batch}
					var offsets wsql.OffsetsAdapter = wsql.MySQLQueueOffsetsAdapter{DeleteOnAck: true}
					if pg {
						schema, offsets = wsql.PostgreSQLQueueSchema{SubscribeBatchSize: batch}, wsql.PostgreSQLQueueOffsetsAdapter{DeleteOnAck: true}
					}
					return v4Adapters(db, schema, offsets)
				}
				o := newSQLOutbox(t, kind, odb.db, odb.pg)
				tx, err := odb.db.Beginx()
				if err != nil {
					t.Fatal(err)
				}
				pub, err := o.factory(tx)
				if err != nil {
					t.Fatal(err)
				}
				for range 5 {
					if err := pub.Publish("invoices", ofMessage(watermill.NewUUID())); err != nil {
						t.Fatal(err)
					}
				}
				if err := tx.Commit(); err != nil {
					t.Fatal(err)
				}
				sub, _, err := o.newSub()
				if err != nil {
					t.Fatal(err)
				}
				ctx, cancel := context.WithCancel(context.Background())
				msgs, err := sub.Subscribe(ctx, o.topic)
				if err != nil {
					t.Fatal(err)
				}
				(<-msgs).Ack()
				<-msgs // delivered, never acked
				if err := sub.Close(); err != nil {
					t.Fatal(err)
				}
				cancel()
				want := 4 // batch 1: only the acked row is gone
				if batch > 1 {
					want = 0 // the whole batch is gone, 3 rows never delivered
				}
				if n := o.rows(t); n != want {
					t.Errorf("SubscribeBatchSize %d: %d rows left after Close, want %d", batch, n, want)
				}
			}
		})
	}
}
