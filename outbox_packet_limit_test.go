package inbox_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// packetLimitRouter runs a router on MariaDB (DSN parameters params) whose
// handler returns outputs(msg), the inbox outermost but for a recorder and
// a poison filter that takes what is not transient.
func packetLimitRouter(t *testing.T, params string, outputs func(msg *message.Message) []*message.Message) (*feed, *outcomes, *poisonSink, *inbox.Outbox, *brokerStub) {
	t.Helper()
	db := testdb.OpenMySQL(t, params)
	broker := newBrokerStub()
	ob := newTestOutbox(t, db, inbox.MySQL, inbox.OutboxConfig{Publisher: broker, PollInterval: time.Hour})
	ib := newFixture(t, db).newInbox(inbox.Config{CommitTimeout: largeWriteCommitTimeout, Outbox: ob.Publisher})
	poison, sink := poisonUnlessTransient(t)
	in, out := newFeed(), &outcomes{}
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(out.Middleware, poison, ib.Middleware)
		r.AddHandler("billing", "orders", in, "documents", nil, func(msg *message.Message) ([]*message.Message, error) {
			return outputs(msg), nil
		})
	})
	return in, out, sink, ob, broker
}

// An output whose payload and metadata are over the server's
// max_allowed_packet (16 MiB here) together is not stored: the server answered 1153 and dropped the
// connection, the failed rollback made the error transient, and the
// message was redelivered for ever. It fails with ErrOutboxMessage, not
// transient, before anything is sent. One whose escaped form alone passes
// the limit (9 MiB of NUL bytes under interpolateParams: 18 MiB) is
// written as a prepared statement, whose values go one by one: it failed
// its first delivery, and succeeded only once the Outbox's own prepared
// statement existed.
func TestOutputOverMaxAllowedPacketIsRefusedAndOneThatFitsIsWritten(t *testing.T) {
	for _, c := range []struct {
		name, params string
		size, meta   int
		fill         byte
		fits         bool
	}{
		{"prepared-17MiB", "", 17 << 20, 0, 'a', false},
		{"interpolated-17MiB", "interpolateParams=true", 17 << 20, 0, 'a', false},
		{"interpolated-9MiB-of-NUL", "interpolateParams=true", 9 << 20, 0, 0, true},
		{"prepared-15MiB", "", 15 << 20, 0, '\\', true},
		// Each value under the limit, together over it: the driver sends
		// values under its own maxAllowedPacket/7 in one packet.
		{"prepared-8.5MiB-and-8MiB-of-metadata", "", 8<<20 + 512<<10, 8 << 20, 'a', false},
		{"interpolated-8.5MiB-and-8MiB-of-metadata", "interpolateParams=true", 8<<20 + 512<<10, 8 << 20, 'a', false},
		{"driver-limit-128MiB-16MiB-and-40KiB-of-metadata", "maxAllowedPacket=134217728", 16<<20 - 32<<10, 40 << 10, 'a', false},
		// Just under the packet: written, as before the bound (a margin of
		// 64 KiB refused it).
		{"prepared-16MiB-less-48KiB", "", 16<<20 - 48<<10, 0, 'a', true},
		{"interpolated-16MiB-less-48KiB", "interpolateParams=true", 16<<20 - 48<<10, 0, 'a', true},
	} {
		t.Run(c.name, func(t *testing.T) {
			payload := bytes.Repeat([]byte{c.fill}, c.size)
			in, out, sink, ob, broker := packetLimitRouter(t, c.params, func(msg *message.Message) []*message.Message {
				m := message.NewMessage(msg.UUID+"-out", payload)
				if c.meta > 0 {
					m.Metadata.Set("doc", strings.Repeat("m", c.meta))
				}
				return []*message.Message{m}
			})
			msg := message.NewMessage(watermill.NewUUID(), []byte("order"))
			acked := in.deliver(t, delivery(msg, "1"))
			relayUntilEmpty(t, ob)
			broker.mu.Lock()
			got := broker.accepted["documents"]
			broker.mu.Unlock()
			if c.fits {
				if !acked || len(got) != 1 || !bytes.Equal(got[0].Payload, payload) {
					t.Fatalf("first delivery acked %v (%v), relayed %d; want it acked and the output relayed unchanged", acked, out.last("1"), len(got))
				}
				return
			}
			if len(sink.poisoned()) != 1 || len(got) != 0 {
				t.Fatalf("poisoned %d, relayed %d (router got %v); want the message poisoned and nothing relayed",
					len(sink.poisoned()), len(got), out.last("1"))
			}
		})
	}
}

// Outputs that each fit go in as few INSERTs as the packet limit allows,
// counted by what the INSERT sends (metadata as stored: JSON, where a
// control character or <, > and & take 6 bytes, escaped again by
// interpolateParams) rather than by the raw metadata: 8 outputs of 600 KiB
// metadata each made 6 of them one INSERT of about 25 MiB, and every
// delivery failed with 1153.
func TestOutputsWhoseStoredMetadataPassesAPacketTogetherGoInSeveralInserts(t *testing.T) {
	for _, c := range []struct {
		name string
		fill byte
	}{{"control-characters", 0x01}, {"angle-brackets", '<'}} {
		t.Run(c.name, func(t *testing.T) {
			value := string(bytes.Repeat([]byte{c.fill}, 600<<10))
			in, out, _, ob, broker := packetLimitRouter(t, "interpolateParams=true", func(msg *message.Message) []*message.Message {
				var res []*message.Message
				for i := range 8 {
					m := message.NewMessage(fmt.Sprintf("%s-%d", msg.UUID, i), []byte("p"))
					m.Metadata.Set("doc", value)
					res = append(res, m)
				}
				return res
			})
			msg := message.NewMessage(watermill.NewUUID(), []byte("order"))
			if !in.deliver(t, delivery(msg, "1")) {
				err := out.last("1")
				t.Fatalf("nacked: %.300v (transient %v, ErrOutboxMessage %v)", err, inbox.IsTransient(err), errors.Is(err, inbox.ErrOutboxMessage))
			}
			relayUntilEmpty(t, ob)
			broker.mu.Lock()
			defer broker.mu.Unlock()
			if got := broker.accepted["documents"]; len(got) != 8 || got[7].Metadata.Get("doc") != value {
				t.Errorf("relayed %d outputs, want 8 with their metadata unchanged", len(got))
			}
		})
	}
}

// A writer of Outbox.PublisherOn (an exec of the caller's, no *sqlx.Tx to
// read in) on MariaDB bounds its outputs too: it sent a 17 MiB output, the
// server dropped the connection, and the message was redelivered for ever.
func TestOutputOverMaxAllowedPacketThroughPublisherOnIsRefused(t *testing.T) {
	for _, c := range []struct {
		name, params string
		payload      []byte
	}{
		{"17MiB", "", bytes.Repeat([]byte{'a'}, 17<<20)},
		// Through PublisherOn a row goes in the caller's statement, which
		// interpolateParams escapes: 9 MiB of NUL bytes are 18 MiB there.
		{"interpolated-9MiB-of-NUL", "interpolateParams=true", make([]byte, 9<<20)},
	} {
		t.Run(c.name, func(t *testing.T) { publisherOnOverThePacket(t, c.params, c.payload) })
	}
}

// Ordinary text through PublisherOn that fits the packet is written, with
// or without interpolateParams (which escapes none of it): a bound that
// charged every row twice its size refused it, and the message was
// poisoned.
func TestOutputUnderMaxAllowedPacketThroughPublisherOnIsWritten(t *testing.T) {
	for _, c := range []struct {
		name, params string
		size         int
	}{
		{"prepared-12MiB", "", 12 << 20},
		{"prepared-8MiB", "", 8<<20 - 16<<10},
		{"interpolated-8MiB", "interpolateParams=true", 8<<20 - 16<<10},
		{"interpolated-15MiB", "interpolateParams=true", 15 << 20},
	} {
		t.Run(c.name, func(t *testing.T) {
			db := testdb.OpenMySQL(t, c.params)
			broker := newBrokerStub()
			ob := newTestOutbox(t, db, inbox.MySQL, inbox.OutboxConfig{Publisher: broker, PollInterval: time.Hour})
			// A minute for the outbox INSERT and COMMIT: 15 MiB sent
			// interpolated took over the default 10 s on a CI machine
			// running the other packages' tests, and the delivery failed
			// its commit deadline instead.
			ib := newFixture(t, db).newInbox(inbox.Config{CommitTimeout: largeWriteCommitTimeout, Outbox: func(tx *sqlx.Tx) (message.Publisher, error) {
				return ob.PublisherOn(func(ctx context.Context, q string, args ...any) error {
					_, err := tx.ExecContext(ctx, q, args...)
					return err
				}), nil
			}})
			payload := bytes.Repeat([]byte{'a'}, c.size)
			in, out := newFeed(), &outcomes{}
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(out.Middleware, ib.Middleware)
				r.AddHandler("billing", "orders", in, "documents", nil, func(msg *message.Message) ([]*message.Message, error) {
					return []*message.Message{message.NewMessage(msg.UUID+"-out", payload)}, nil
				})
			})
			ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second) // past the commit's minute
			defer cancel()
			if acked, err := in.send(ctx, delivery(message.NewMessage(watermill.NewUUID(), []byte("order")), "1")); err != nil || !acked {
				t.Fatalf("nacked (%v): %.300v", err, out.last("1"))
			}
			relayUntilEmpty(t, ob)
			if got := broker.uuids("documents"); len(got) != 1 {
				t.Errorf("relayed %v, want the output", got)
			}
		})
	}
}

func publisherOnOverThePacket(t *testing.T, params string, payload []byte) {
	db := testdb.OpenMySQL(t, params)
	ob := newTestOutbox(t, db, inbox.MySQL, inbox.OutboxConfig{Publisher: newBrokerStub(), PollInterval: time.Hour})
	ib := newFixture(t, db).newInbox(inbox.Config{CommitTimeout: largeWriteCommitTimeout, Outbox: func(tx *sqlx.Tx) (message.Publisher, error) {
		return ob.PublisherOn(func(ctx context.Context, q string, args ...any) error {
			_, err := tx.ExecContext(ctx, q, args...)
			return err
		}), nil
	}})
	in, out := newFeed(), &outcomes{}
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(out.Middleware, ib.Middleware)
		r.AddHandler("billing", "orders", in, "documents", nil, func(msg *message.Message) ([]*message.Message, error) {
			return []*message.Message{message.NewMessage(msg.UUID+"-out", payload)}, nil
		})
	})
	if in.deliver(t, delivery(message.NewMessage(watermill.NewUUID(), []byte("order")), "1")) {
		t.Fatal("acked")
	}
	if err := out.last("1"); !errors.Is(err, inbox.ErrOutboxMessage) || inbox.IsTransient(err) {
		t.Errorf("router got %.300v (transient %v); want ErrOutboxMessage, not transient", err, inbox.IsTransient(err))
	}
}

// A writer of PublisherOn reads max_allowed_packet on another connection;
// with every connection of the pool held by the handlers' transactions (a
// pool of one here), it waits at most a second for one and then writes
// unbounded: it waited for ever.
func TestLargeOutputThroughPublisherOnWithEveryConnectionHeldIsWritten(t *testing.T) {
	db := testdb.OpenMySQL(t, "")
	broker := newBrokerStub()
	ob := newTestOutbox(t, db, inbox.MySQL, inbox.OutboxConfig{Publisher: broker, PollInterval: time.Hour})
	db.SetMaxOpenConns(1)
	ib := newFixture(t, db).newInbox(inbox.Config{CommitTimeout: largeWriteCommitTimeout, Outbox: func(tx *sqlx.Tx) (message.Publisher, error) {
		return ob.PublisherOn(func(ctx context.Context, q string, args ...any) error {
			_, err := tx.ExecContext(ctx, q, args...)
			return err
		}), nil
	}})
	payload := bytes.Repeat([]byte{'a'}, 2<<20)
	in, out := newFeed(), &outcomes{}
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(out.Middleware, ib.Middleware)
		r.AddHandler("billing", "orders", in, "documents", nil, func(msg *message.Message) ([]*message.Message, error) {
			return []*message.Message{message.NewMessage(msg.UUID+"-out", payload)}, nil
		})
	})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	acked, err := in.send(ctx, delivery(message.NewMessage(watermill.NewUUID(), []byte("order")), "1"))
	if err != nil || !acked {
		t.Fatalf("delivery: acked %v, %v (router got %v); want it acked", acked, err, out.last("1"))
	}
	relayUntilEmpty(t, ob)
	if got := broker.uuids("documents"); len(got) != 1 {
		t.Errorf("relayed %v, want the output", got)
	}
}
