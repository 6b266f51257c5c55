package inbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

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

// asReadsNil: a publisher's error whose As method reads a nil detail.
type asReadsNil struct{ resp *struct{ err error } }

func (e asReadsNil) Error() string      { return "request refused" }
func (e asReadsNil) As(target any) bool { return e.resp.err != nil }

// isReadsNilForOneTarget: an Is method that reads its nil detail only when
// asked about the one kind it maps.
type isReadsNilForOneTarget struct{ resp *struct{ code int } }

func (e isReadsNilForOneTarget) Error() string { return "request refused" }
func (e isReadsNilForOneTarget) Is(target error) bool {
	if target == inbox.ErrBrokerUnavailable {
		return e.resp.code == 3
	}
	return false
}

// The relay asks a refusal errors.As (*PublishError) and errors.Is
// (ErrBrokerUnavailable, ErrMessageRejected): an As method, or an Is method
// for one of those targets only, that panics refuses the message as any
// refusal does, where it ended the round (and the process).
func TestOutboxRelaySurvivesAPublishersErrorWhoseAsOrTargetedIsPanics(t *testing.T) {
	for name, bad := range map[string]error{"As": asReadsNil{}, "IsForOneTarget": isReadsNilForOneTarget{}} {
		t.Run(name, func(t *testing.T) {
			db := sqliteDB(t)
			broker := newBrokerStub()
			broker.setRefuse(func(string, *message.Message) error { return bad })
			ob := newTestOutbox(t, db, inbox.SQLite, inbox.OutboxConfig{Publisher: broker, PollInterval: time.Hour})
			tx, w := beginOutbox(t, db, ob)
			if err := w.Publish("orders", message.NewMessage("a", []byte("a"))); err != nil {
				t.Fatal(err)
			}
			if err := tx.Commit(); err != nil {
				t.Fatal(err)
			}
			defer func() {
				if p := recover(); p != nil {
					t.Fatalf("the relay round panicked on a publisher's error whose %s method panics: %v", name, p)
				}
			}()
			r := ob.RelayOnce(context.Background())
			if r.Err == nil {
				t.Errorf("round %+v: want the refusal reported", r)
			}
		})
	}
}
