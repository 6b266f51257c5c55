package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/go-sql-driver/mysql"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// A handler whose statement is a deadlock victim ignores the error and then
// emits its outputs, through OutboxFromContext or by returning them. On
// MySQL/MariaDB the database has rolled the transaction back and the
// connection still says it is open: an outbox INSERT would run in
// autocommit and send the outputs although the message is not processed,
// and the redelivery would send them again under the handler's new UUIDs.
// Nothing is written: the message is nacked, and after the redelivery each
// output has left exactly once. (PostgreSQL fails every statement of the
// aborted transaction; SQLite has no deadlocks.) In "another delivery
// committed", a concurrent delivery of the message commits its claim right
// after the rollback: the key's row is there again, and on MariaDB the
// INSERT still writes nothing, outside any transaction.
func TestOutboxWritesNothingAfterADeadlockTheHandlerIgnored(t *testing.T) {
	for _, emit := range []string{"published", "returned", "returned, three", "returned, another delivery committed"} {
		t.Run(emit, func(t *testing.T) {
			forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
				if tdb.Dialect == inbox.SQLite {
					t.Skip("one writer at a time: no deadlock")
				}
				raced := emit == "returned, another delivery committed"
				if raced && tdb.Dialect != inbox.MySQL {
					t.Skip("PostgreSQL fails every statement of the aborted transaction")
				}
				broker := newBrokerStub()
				ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, PollInterval: time.Hour})
				f := newFixture(t, db)
				ib := f.newInbox(inbox.Config{Outbox: ob.Publisher})
				victim := deadlockVictim(t, tdb.Dialect, db)
				var deadlocked atomic.Bool
				deadlocked.Store(true)
				var ignored, publishErr error
				out := &outcomes{}
				in := newFeed()
				outputs := 1
				if emit == "returned, three" {
					outputs = 3
				}
				runRouter(t, func(r *message.Router) {
					r.AddMiddleware(out.Middleware, ib.Middleware)
					r.AddHandler("billing", "orders", in, "invoices", &recordingPublisher{fail: true}, func(msg *message.Message) ([]*message.Message, error) {
						if err := f.writeBusinessRow(msg); err != nil {
							return nil, err
						}
						if deadlocked.Load() {
							tx, _ := inbox.TxFromContext(msg.Context())
							ignored = victim(msg, tx) // a sloppy handler: the error is ignored
							if raced {
								_, err := db.ExecContext(msg.Context(), "INSERT INTO "+f.inbox+
									" (consumer, message_id, processed_at) VALUES (?, ?, UTC_TIMESTAMP(6))", "billing", msg.UUID)
								if err != nil {
									return nil, err
								}
							}
						}
						var msgs []*message.Message
						for i := range outputs {
							msgs = append(msgs, message.NewMessage(fmt.Sprintf("%s-invoice-%d", msg.UUID, i), nil))
						}
						if emit == "published" {
							pub, _ := inbox.OutboxFromContext(msg.Context())
							publishErr = pub.Publish("invoices", msgs...)
							return nil, nil // and ignores this error too
						}
						return msgs, nil
					})
				})
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				msg := message.NewMessage(watermill.NewUUID(), nil)
				if acked, err := in.send(ctx, delivery(msg, "first")); err != nil || acked {
					t.Fatalf("delivery after the ignored deadlock: acked %v (%v), want a nack", acked, err)
				}
				var myErr *mysql.MySQLError
				if sqlState(ignored) != "40P01" && (!errors.As(ignored, &myErr) || myErr.Number != 1213) {
					t.Fatalf("the handler's statement failed with %v, want a deadlock", ignored)
				}
				if tdb.Dialect == inbox.MySQL {
					failure := publishErr
					if emit != "published" {
						failure = out.last("first")
					}
					if !errors.Is(failure, inbox.ErrTxRolledBack) || !errors.Is(out.last("first"), inbox.ErrTxRolledBack) {
						t.Errorf("publish: %v; delivery nacked with %v; want ErrTxRolledBack for both", publishErr, out.last("first"))
					}
				}
				if n := count(t, db, relayTable(t, ob), ""); n != 0 {
					t.Fatalf("%d outbox rows written for a message that was rolled back, want 0", n)
				}
				deadlocked.Store(false)
				if raced {
					relayUntilEmpty(t, ob)
					if got := broker.uuids("invoices"); len(got) != 0 {
						t.Errorf("sent %v, want nothing: the other delivery's outputs are its own", got)
					}
					return
				}
				if acked, err := in.send(ctx, delivery(msg, "redelivery")); err != nil || !acked {
					t.Fatalf("redelivery: acked %v (%v), last error %v", acked, err, out.last("redelivery"))
				}
				relayUntilEmpty(t, ob)
				var want []string
				for i := range outputs {
					want = append(want, fmt.Sprintf("%s-invoice-%d", msg.UUID, i))
				}
				if got := broker.uuids("invoices"); !slices.Equal(got, want) {
					t.Errorf("sent %v, want %v, each once and in order", got, want)
				}
			})
		})
	}
}

// The messages a handler returns leave with their exact UUIDs, payloads (any
// bytes, up to a mebibyte here) and metadata, in the order returned: one
// message alone and several in one statement (on MySQL/MariaDB the claimed
// INSERT's numbered derived table).
func TestOutboxKeepsTheBytesAndOrderOfReturnedMessages(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		broker := newBrokerStub()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker, PollInterval: time.Hour})
		f := newFixture(t, db)
		ib := f.newInbox(inbox.Config{Outbox: ob.Publisher})
		every, big := binaryPayload(256), binaryPayload(1<<20)
		payloads := [][]byte{every, big, {}, []byte("{\"not\": \"json\""), every[:1]}
		var want []*message.Message
		in := newFeed()
		runRouter(t, func(r *message.Router) {
			r.AddMiddleware(ib.Middleware)
			r.AddHandler("billing", "orders", in, "invoices", &recordingPublisher{fail: true}, func(msg *message.Message) ([]*message.Message, error) {
				first, n := 0, len(payloads) // "many"
				if k := msg.Metadata.Get("payload"); k != "" {
					first, _ = strconv.Atoi(k)
					n = first + 1
				}
				var out []*message.Message
				for i := first; i < n; i++ {
					m := message.NewMessage(fmt.Sprintf("%s-%d", msg.UUID, i), payloads[i])
					m.Metadata.Set("index", fmt.Sprint(i))
					m.Metadata.Set("quote\"and\\slash", "ü\x00")
					out = append(out, m)
				}
				want = append(want, out...)
				return out, nil
			})
		})
		var msgs []*message.Message
		for i := range payloads {
			m := message.NewMessage(watermill.NewUUID(), nil)
			m.Metadata.Set("payload", strconv.Itoa(i))
			msgs = append(msgs, m)
		}
		msgs = append(msgs, message.NewMessage(watermill.NewUUID(), nil)) // all of them at once
		for _, m := range msgs {
			if !in.deliver(t, m) {
				t.Fatalf("message %s nacked", m.UUID)
			}
		}
		relayUntilEmpty(t, ob)
		got := broker.messages("invoices")
		if len(got) != len(want) {
			t.Fatalf("sent %d messages, want %d", len(got), len(want))
		}
		for i, w := range want {
			if !got[i].Equals(w) {
				t.Errorf("message %d: sent %s (%d bytes, %v), want %s (%d bytes, %v)",
					i, got[i].UUID, len(got[i].Payload), got[i].Metadata, w.UUID, len(w.Payload), w.Metadata)
			}
		}
	})
}

// binaryPayload returns n bytes that are not UTF-8: every byte value in
// turn for n up to 256, then a pattern that does not repeat at 256.
func binaryPayload(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i)
		if n > 256 {
			b[i] = byte(i*7 + i>>8)
		}
	}
	return b
}
