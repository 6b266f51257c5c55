package jetstreamretention_test

// The NATS server the tests run against, streams made for one test, and a
// Watermill subscriber over a JetStream pull consumer.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/watermill-inbox/inbox/internal/testdb"
)

const (
	natsURLEnv     = "INBOX_TEST_NATS_URL"
	defaultNATSURL = "nats://127.0.0.1:4222"
	startNATS      = "nats-server -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server &"

	// uuidHeader is where Watermill's NATS publisher puts the message UUID.
	uuidHeader = "_watermill_message_uuid"

	// waitTimeout bounds every wait: a hang fails the test instead of
	// stalling the suite. It is a bound, never a measurement.
	waitTimeout = 60 * time.Second
)

// connect returns a JetStream context on the test server, closed when t
// ends. A server that cannot be reached, or runs without JetStream, skips
// the test locally and fails it under CI=true.
func connect(t *testing.T) (jetstream.JetStream, string) {
	t.Helper()
	url := testdb.Env(natsURLEnv, defaultNATSURL)
	how := fmt.Sprintf("start it with `%s`, or point %s at a server", startNATS, natsURLEnv)
	unavailable := func(what string, err error) {
		msg := fmt.Sprintf("%s not reachable at %s (%v): %s", what, url, err, how)
		if os.Getenv("CI") == "true" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	nc, err := nats.Connect(url, nats.Timeout(2*time.Second), nats.NoReconnect())
	if err != nil {
		unavailable("NATS", err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := js.AccountInfo(ctx); err != nil {
		unavailable("NATS JetStream (run nats-server with -js)", err)
	}
	return js, url
}

// createStream creates a memory stream with a name of its own from cfg
// (Name and Subjects are set here: one subject, NAME.orders), deleted when t
// ends.
func createStream(t *testing.T, js jetstream.JetStream, cfg jetstream.StreamConfig) jetstream.Stream {
	t.Helper()
	cfg.Name = "INBOX_JSR_" + strings.ToUpper(testdb.RandomSuffix())
	cfg.Subjects = []string{cfg.Name + ".orders"}
	cfg.Storage = jetstream.MemoryStorage
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := js.CreateStream(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := js.DeleteStream(ctx, cfg.Name); err != nil {
			t.Logf("delete stream %s: %v", cfg.Name, err)
		}
	})
	return s
}

// delivery is what the router did with one message a jsSubscriber handed
// it, and what the server answered to the ack (err).
type delivery struct {
	acked bool
	err   error
}

// jsSubscriber is a message.Subscriber over one JetStream pull consumer, as
// watermill-nats's is over nats.go's older API: each message goes to the
// router with the UUID from its _watermill_message_uuid header, and is acked
// on the server (and the server's confirmation awaited) when the router acks
// it, nakked when the router nacks it. Each outcome is sent on deliveries.
type jsSubscriber struct {
	consumer   jetstream.Consumer
	deliveries chan delivery
}

func newJSSubscriber(c jetstream.Consumer) *jsSubscriber {
	return &jsSubscriber{consumer: c, deliveries: make(chan delivery, 1000)}
}

func (s *jsSubscriber) Subscribe(ctx context.Context, _ string) (<-chan *message.Message, error) {
	out := make(chan *message.Message)
	go func() {
		defer close(out)
		for ctx.Err() == nil {
			batch, err := s.consumer.Fetch(1, jetstream.FetchMaxWait(200*time.Millisecond))
			if err != nil {
				s.deliveries <- delivery{err: fmt.Errorf("fetch: %w", err)}
				return
			}
			for m := range batch.Messages() {
				msg := message.NewMessage(m.Headers().Get(uuidHeader), m.Data())
				select {
				case out <- msg:
				case <-ctx.Done():
					return // unacked: the server redelivers after AckWait
				}
				select {
				case <-msg.Acked():
					ackCtx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
					err := m.DoubleAck(ackCtx)
					cancel()
					s.deliveries <- delivery{acked: true, err: err}
				case <-msg.Nacked():
					s.deliveries <- delivery{err: m.Nak()}
				case <-ctx.Done():
					return
				}
			}
			if err := batch.Error(); err != nil && !errors.Is(err, nats.ErrTimeout) && ctx.Err() == nil {
				s.deliveries <- delivery{err: fmt.Errorf("fetch: %w", err)}
				return
			}
		}
	}()
	return out, nil
}

func (s *jsSubscriber) Close() error { return nil }

// waitAcked waits for n deliveries that the router acked and the server
// confirmed; a nack or an error fails the test.
func (s *jsSubscriber) waitAcked(t *testing.T, n int) {
	t.Helper()
	timeout := time.After(waitTimeout)
	for i := range n {
		select {
		case d := <-s.deliveries:
			if d.err != nil || !d.acked {
				t.Fatalf("delivery %d of %d: acked %v, %v; want acked", i+1, n, d.acked, d.err)
			}
		case <-timeout:
			t.Fatalf("%d of %d deliveries acked within %v", i, n, waitTimeout)
		}
	}
}
