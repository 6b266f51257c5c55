package inbox_test

import (
	"errors"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/watermill-inbox/inbox"
)

// One "inbox" span per delivery, child of the span already in the message
// context, parent of the handler's spans, with claim/duplicate/commit events
// and an error status on failure or panic.
func TestTracing(t *testing.T) {
	db := sqliteDB(t)
	f := newFixture(t, db)
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	tracer := tp.Tracer("test")
	ib := f.newInbox(inbox.Config{TracerProvider: tp})
	var mode atomic.Value
	mode.Store("ok")
	outerSpan := func(h message.HandlerFunc) message.HandlerFunc { // what Watermill's OpenTelemetry middleware does
		return func(msg *message.Message) ([]*message.Message, error) {
			ctx, span := tracer.Start(msg.Context(), "watermill handler")
			defer span.End()
			msg.SetContext(ctx)
			return h(msg)
		}
	}
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(middleware.Recoverer, outerSpan, ib.Middleware)
		r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
			_, span := tracer.Start(msg.Context(), "handler write")
			defer span.End()
			switch mode.Load() {
			case "fail":
				return errors.New("declined")
			case "panic":
				panic("bug")
			}
			return f.writeBusinessRow(msg)
		})
	})
	msg := message.NewMessage(watermill.NewUUID(), nil)
	in.deliver(t, msg) // processed
	in.deliver(t, msg) // duplicate
	mode.Store("fail")
	in.deliver(t, message.NewMessage(watermill.NewUUID(), nil))
	mode.Store("panic")
	in.deliver(t, message.NewMessage(watermill.NewUUID(), nil))

	var inboxSpans []sdktrace.ReadOnlySpan
	byID := map[string]sdktrace.ReadOnlySpan{}
	for _, s := range rec.Ended() {
		byID[s.SpanContext().SpanID().String()] = s
		if s.Name() == "inbox" {
			inboxSpans = append(inboxSpans, s)
		}
	}
	if len(inboxSpans) != 4 {
		t.Fatalf("inbox spans = %d, want 4", len(inboxSpans))
	}
	events := func(s sdktrace.ReadOnlySpan) (names []string) {
		for _, e := range s.Events() {
			if e.Name != "exception" {
				names = append(names, e.Name)
			}
		}
		return names
	}
	want := []struct {
		events string
		status codes.Code
	}{
		{"[inbox.claimed inbox.committed]", codes.Unset},
		{"[inbox.duplicate]", codes.Unset},
		{"[inbox.claimed]", codes.Error},
		{"[inbox.claimed]", codes.Error},
	}
	for i, s := range inboxSpans {
		if got := fmtSlice(events(s)); got != want[i].events || s.Status().Code != want[i].status {
			t.Errorf("inbox span %d: events %s status %v, want %s %v", i, got, s.Status(), want[i].events, want[i].status)
		}
		if parent, ok := byID[s.Parent().SpanID().String()]; !ok || parent.Name() != "watermill handler" {
			t.Errorf("inbox span %d: parent is not the message's span", i)
		}
	}
	for _, s := range rec.Ended() {
		if s.Name() == "handler write" {
			if parent := byID[s.Parent().SpanID().String()]; parent == nil || parent.Name() != "inbox" {
				t.Errorf("handler span's parent = %v, want the inbox span", parent)
			}
		}
	}
}

func fmtSlice(s []string) string {
	out := "["
	for i, x := range s {
		if i > 0 {
			out += " "
		}
		out += x
	}
	return out + "]"
}
