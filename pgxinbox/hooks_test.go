package pgxinbox_test

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// The outcome hooks get one event per delivery, with the key and, for a
// failure, the error the router gets.
func TestHooks_ReportEachOutcome(t *testing.T) {
	forEachDialect(t, func(t *testing.T, d inbox.Dialect) {
		pool := testdb.OpenPgxPool(t, "")
		f := newFixture(t, pool)
		var hooks hookCounts
		ib := f.newInbox(hooks.config(pgxinbox.Config{Dialect: d}))
		errDeclined := errors.New("declined")
		in := consume(t, ib, func(msg *message.Message) error {
			if msg.Metadata.Get("delivery") == "fail" {
				return errDeclined
			}
			return f.writeEffect(msg)
		})
		msg := message.NewMessage(watermill.NewUUID(), nil)
		in.deliver(t, labelled(msg, "fail"))
		in.deliver(t, msg)
		in.deliver(t, msg)
		if got := hooks.get(); got != [3]int32{1, 1, 1} {
			t.Fatalf("hooks processed/duplicate/failed %v, want [1 1 1]", got)
		}
		for i, e := range hooks.events {
			if e.Consumer != "billing" || e.MessageID != msg.UUID || e.Message.UUID != msg.UUID {
				t.Errorf("event %d: consumer %q, id %q, message %q", i, e.Consumer, e.MessageID, e.Message.UUID)
			}
			if wantErr := i == 0; wantErr != errors.Is(e.Err, errDeclined) || (!wantErr && e.Err != nil) {
				t.Errorf("event %d: error %v", i, e.Err)
			}
		}
	})
}

// One "inbox" span per delivery, child of the span in the message context
// and parent of the handler's, with the events inbox.claimed and
// inbox.committed, inbox.duplicate, and an error status on failure.
func TestTracing_SpanPerDelivery(t *testing.T) {
	t.Parallel()
	pool := testdb.OpenPgxPool(t, "")
	f := newFixture(t, pool)
	exporter := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exporter))
	t.Cleanup(func() { tp.Shutdown(context.Background()) })
	tracer := tp.Tracer("test")
	ib := f.newInbox(pgxinbox.Config{TracerProvider: tp})
	outerSpan := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			ctx, span := tracer.Start(msg.Context(), "watermill handler")
			defer span.End()
			msg.SetContext(ctx)
			return h(msg)
		}
	}
	in := consume(t, ib, func(msg *message.Message) error {
		_, span := tracer.Start(msg.Context(), "handler write")
		defer span.End()
		if msg.Metadata.Get("delivery") == "fail" {
			return errors.New("declined")
		}
		return f.writeEffect(msg)
	}, outerSpan)
	msg := message.NewMessage(watermill.NewUUID(), nil)
	in.deliver(t, msg)                                                            // processed
	in.deliver(t, msg)                                                            // duplicate
	in.deliver(t, labelled(message.NewMessage(watermill.NewUUID(), nil), "fail")) // failed

	byName := map[string][]tracetest.SpanStub{}
	for _, s := range exporter.GetSpans() {
		byName[s.Name] = append(byName[s.Name], s)
	}
	spans, outers, handlers := byName["inbox"], byName["watermill handler"], byName["handler write"]
	if len(spans) != 3 || len(outers) != 3 || len(handlers) != 2 {
		t.Fatalf("spans: %d inbox, %d outer, %d handler; want 3, 3, 2", len(spans), len(outers), len(handlers))
	}
	events := func(s tracetest.SpanStub) []string {
		var names []string
		for _, e := range s.Events {
			if e.Name != "exception" {
				names = append(names, e.Name)
			}
		}
		return names
	}
	want := [][]string{{"inbox.claimed", "inbox.committed"}, {"inbox.duplicate"}, {"inbox.claimed"}}
	for i, s := range spans {
		if got := events(s); !equal(got, want[i]) {
			t.Errorf("span %d events %v, want %v", i, got, want[i])
		}
		if s.Parent.SpanID() != outers[i].SpanContext.SpanID() {
			t.Errorf("span %d is not a child of the message context's span", i)
		}
		if wantErr := i == 2; (s.Status.Code == codes.Error) != wantErr {
			t.Errorf("span %d status %v", i, s.Status)
		}
	}
	for i, h := range handlers {
		if h.Parent.SpanID() != spans[[]int{0, 2}[i]].SpanContext.SpanID() {
			t.Errorf("handler span %d is not a child of its inbox span", i)
		}
	}
}

func equal(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// AfterCommit functions run once the transaction committed (its effect is
// visible to another connection then), never after a rollback, a failed
// COMMIT or a panic, and not for a duplicate; a panicking one does not stop
// the ack.
func TestAfterCommit_RunsOnlyAfterCommit(t *testing.T) {
	forEachDialect(t, func(t *testing.T, d inbox.Dialect) {
		pool := testdb.OpenPgxPool(t, "")
		f := newFixtureWith(t, pool, "(message_id text NOT NULL UNIQUE DEFERRABLE INITIALLY DEFERRED)")
		ib := f.newInbox(pgxinbox.Config{Dialect: d})
		var mu sync.Mutex
		ran := map[string]int{}
		visible := map[string]bool{}
		in := consume(t, ib, func(msg *message.Message) error {
			label := msg.Metadata.Get("delivery")
			registered := inbox.AfterCommit(msg.Context(), func() {
				var n int
				err := pool.QueryRow(context.Background(), "SELECT count(*) FROM "+f.effect+" WHERE message_id = $1", msg.UUID).Scan(&n)
				mu.Lock()
				ran[label]++
				visible[label] = err == nil && n == 1
				mu.Unlock()
			})
			if !registered {
				t.Errorf("%s: AfterCommit refused in the handler", label)
			}
			inbox.AfterCommit(msg.Context(), func() { panic("after-commit bug") })
			if err := f.writeEffect(msg); err != nil {
				return err
			}
			switch label {
			case "fail":
				return errors.New("declined")
			case "commit-fails":
				return f.writeEffect(msg) // the deferred unique constraint fails at COMMIT
			case "panic":
				panic("handler bug")
			}
			return nil
		}, middleware.Recoverer)
		msg := message.NewMessage(watermill.NewUUID(), nil)
		for _, label := range []string{"fail", "commit-fails", "panic"} {
			if in.deliver(t, labelled(msg, label)) {
				t.Errorf("%s: acked", label)
			}
		}
		if !in.deliver(t, labelled(msg, "ok")) {
			t.Error("ok: nacked although only an after-commit function panicked")
		}
		in.deliver(t, labelled(msg, "duplicate"))
		mu.Lock()
		defer mu.Unlock()
		if len(ran) != 1 || ran["ok"] != 1 || !visible["ok"] {
			t.Errorf("after-commit functions ran %v (effect visible %v), want once, for ok, after its commit", ran, visible)
		}
		f.expectRows(1, 1)
		expectNoConnHeld(t, pool)
	})
}
