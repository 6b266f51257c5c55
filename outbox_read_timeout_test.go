package inbox_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A statement timeout on the relay's sessions (a role's or database's
// statement_timeout, MariaDB's max_statement_time) shorter than reading one
// batch of large messages stopped every round's read: the relay read
// BatchSize rows again after each failure, and sent nothing while the
// broker worked. It reads fewer rows after such a timeout, and sends them.
func TestOutboxRelayReadsFewerRowsWhenItsReadTimesOut(t *testing.T) {
	const messages, size = 200, 1 << 20
	payload := make([]byte, size)
	for i := range payload {
		payload[i] = byte(i * 7) // not all alike: TOAST would compress them to nothing
	}
	for _, tc := range []struct {
		name    string
		dialect inbox.Dialect
		open    func(t *testing.T) (writer, relay *sqlx.DB)
		perTx   int // messages per writing transaction (MariaDB's max_allowed_packet)
	}{
		{"postgres", inbox.PostgreSQL, func(t *testing.T) (*sqlx.DB, *sqlx.DB) {
			return testdb.OpenPostgres(t, ""), testdb.OpenPostgres(t, "options=-c%20statement_timeout%3D300")
		}, 50},
		{"mysql", inbox.MySQL, func(t *testing.T) (*sqlx.DB, *sqlx.DB) {
			return testdb.OpenMySQL(t, ""), testdb.OpenMySQL(t, "max_statement_time=0.3")
		}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			writer, relayDB := tc.open(t)
			ob := newTestOutbox(t, writer, tc.dialect, inbox.OutboxConfig{Publisher: newBrokerStub()})
			for i := 0; i < messages; i += tc.perTx {
				tx, pub := beginOutbox(t, writer, ob)
				var msgs []*message.Message
				for j := i; j < i+tc.perTx; j++ {
					msgs = append(msgs, message.NewMessage(fmt.Sprintf("m%03d", j), payload))
				}
				if err := pub.Publish("large", msgs...); err != nil {
					t.Fatal(err)
				}
				if err := tx.Commit(); err != nil {
					t.Fatal(err)
				}
			}
			broker := newBrokerStub()
			relay, err := inbox.NewOutbox(inbox.OutboxConfig{DB: relayDB, Dialect: tc.dialect, Table: relayTable(t, ob), Publisher: broker})
			if err != nil {
				t.Fatal(err)
			}
			var timedOut int
			for round := 0; round < 100 && len(broker.messages("large")) < messages; round++ {
				if r := relay.RelayOnce(context.Background()); r.Err != nil {
					timedOut++
					t.Logf("round %d: %v", round, r.Err)
				}
			}
			got := broker.messages("large")
			if len(got) != messages {
				t.Fatalf("sent %d of %d messages in 100 rounds", len(got), messages)
			}
			for i, m := range got {
				if want := fmt.Sprintf("m%03d", i); m.UUID != want || len(m.Payload) != size {
					t.Fatalf("message %d sent is %s (%d bytes), want %s (%d bytes), in order", i, m.UUID, len(m.Payload), want, size)
				}
			}
			if timedOut == 0 {
				t.Logf("no read timed out (a fast machine): the test proved nothing this time")
			}
			if n := count(t, writer, relayTable(t, ob), "1=1"); n != 0 {
				t.Errorf("%d rows left in the outbox, want none", n)
			}
		})
	}
}

// panickingDetail is a refusal detail whose Error reads its receiver.
type panickingDetail struct{ code string }

func (d *panickingDetail) Error() string { return "code " + d.code }

// lazyRefusal wraps ErrBrokerUnavailable and formats its detail when
// asked: with a nil detail its Error panics.
type lazyRefusal struct{ detail *panickingDetail }

func (e lazyRefusal) Error() string { return "partition unavailable: " + e.detail.Error() }
func (e lazyRefusal) Unwrap() error { return inbox.ErrBrokerUnavailable }

// perMessagePublisher refuses every call of several messages with a
// PublishError from refusals (or with whole), and takes every message alone.
type perMessagePublisher struct {
	*brokerStub
	refusals func(n int) []error
	whole    error // when set, the refusal of a call of several, instead of a PublishError
}

func (p perMessagePublisher) Publish(topic string, msgs ...*message.Message) error {
	if len(msgs) > 1 && p.whole != nil {
		return p.whole
	}
	if len(msgs) > 1 {
		return &inbox.PublishError{MessageErrors: p.refusals(len(msgs))}
	}
	return p.brokerStub.Publish(topic, msgs...)
}

// The relay recovers a panic in the publisher, or in its error's Error
// method, as a refusal; an entry of a PublishError after the first (whose
// text the call's error does not read) panicked later, in the round's
// record, and the round panicked: under Run or RouterPlugin the process
// ended, again at every start.
func TestOutboxRelaySurvivesAPerMessageErrorWhoseErrorMethodPanics(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		pub := perMessagePublisher{brokerStub: newBrokerStub(), refusals: func(n int) []error {
			errs := make([]error, n)
			errs[0] = fmt.Errorf("request refused")
			errs[1] = lazyRefusal{} // nil detail
			return errs
		}}
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: pub})
		tx, w := beginOutbox(t, db, ob)
		if err := w.Publish("orders", message.NewMessage("a", []byte("a")), message.NewMessage("b", []byte("b"))); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		var r inbox.OutboxRound
		func() {
			defer func() {
				if p := recover(); p != nil {
					t.Fatalf("the relay round panicked: %v", p)
				}
			}()
			r = ob.RelayOnce(context.Background())
		}()
		if r.Err == nil {
			t.Errorf("round: %+v, want the refusals reported", r)
		}
		relayUntilEmpty(t, ob)
		if got := pub.messages("orders"); len(got) != 2 || got[0].UUID != "a" || got[1].UUID != "b" {
			t.Errorf("sent %v, want a then b (each alone)", got)
		}
	})
}

// unwrapReadsNil is a per-message refusal whose text is fine but whose
// Unwrap reads a nil detail (a broker client's error struct holding a
// response it did not get): its Unwrap panics.
type unwrapReadsNil struct{ resp *struct{ err error } }

func (e unwrapReadsNil) Error() string { return "partition unavailable" }
func (e unwrapReadsNil) Unwrap() error { return e.resp.err }

// isReadsNil: the same, with an Is method that reads the nil detail.
type isReadsNil struct{ resp *struct{ code int } }

func (e isReadsNil) Error() string { return "request refused" }
func (e isReadsNil) Is(target error) bool {
	return e.resp.code == 3 && target == inbox.ErrBrokerUnavailable
}

// An error of the publisher (a PublishError's entry, or the call's own)
// whose Unwrap or Is method panics refuses its message as any refusal: the
// relay classifies refusals with errors.Is (ErrBrokerUnavailable,
// ErrMessageRejected), which ended the round, and under Run or RouterPlugin
// the process, again at every start while the row stayed first in line.
func TestOutboxRelaySurvivesAPublishersErrorWhoseUnwrapOrIsPanics(t *testing.T) {
	for name, bad := range map[string]error{"Unwrap": unwrapReadsNil{}, "Is": isReadsNil{}} {
		for _, whole := range []bool{false, true} {
			name := fmt.Sprintf("%s/entry=%v", name, !whole)
			t.Run(name, func(t *testing.T) {
				forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
					pub := perMessagePublisher{brokerStub: newBrokerStub(), refusals: func(n int) []error {
						errs := make([]error, n)
						errs[0] = fmt.Errorf("request refused")
						errs[1] = bad
						return errs
					}}
					if whole {
						pub.whole = bad
					}
					ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: pub})
					tx, w := beginOutbox(t, db, ob)
					if err := w.Publish("orders", message.NewMessage("a", []byte("a")), message.NewMessage("b", []byte("b"))); err != nil {
						t.Fatal(err)
					}
					if err := tx.Commit(); err != nil {
						t.Fatal(err)
					}
					func() {
						defer func() {
							if p := recover(); p != nil {
								t.Fatalf("the relay round panicked on a per-message error whose %s method panics: %v", name, p)
							}
						}()
						ob.RelayOnce(context.Background())
					}()
					relayUntilEmpty(t, ob)
					if got := pub.messages("orders"); len(got) != 2 || got[0].UUID != "a" || got[1].UUID != "b" {
						t.Errorf("sent %v, want a then b (each alone)", got)
					}
				})
			})
		}
	}
}
