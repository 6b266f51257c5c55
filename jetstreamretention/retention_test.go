package jetstreamretention_test

import (
	"context"
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/jetstreamretention"
)

func addConsumer(t *testing.T, s jetstream.Stream, cfg jetstream.ConsumerConfig) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := s.CreateConsumer(ctx, cfg); err != nil {
		t.Fatal(err)
	}
}

// The safe window is the longest stream window plus the margin; a stream's
// window is its MaxAge, or a consumer's redelivery span (AckWait or BackOff
// over MaxDeliver deliveries) when that is longer; a consumer with
// unlimited deliveries adds nothing (MaxAge ends them); a stream without
// MaxAge has no safe window.
func TestSafeWindow(t *testing.T) {
	t.Parallel()
	js, _ := connect(t)
	hour := createStream(t, js, jetstream.StreamConfig{MaxAge: time.Hour})
	ackWait := createStream(t, js, jetstream.StreamConfig{MaxAge: time.Hour})
	addConsumer(t, ackWait, jetstream.ConsumerConfig{Durable: "slow", AckWait: 30 * time.Minute, MaxDeliver: 5})
	addConsumer(t, ackWait, jetstream.ConsumerConfig{Durable: "fast", AckWait: time.Second, MaxDeliver: 3})
	backOff := createStream(t, js, jetstream.StreamConfig{MaxAge: time.Hour})
	addConsumer(t, backOff, jetstream.ConsumerConfig{Durable: "backoff", MaxDeliver: 5,
		BackOff: []time.Duration{time.Minute, 10 * time.Minute, time.Hour}})
	unlimited := createStream(t, js, jetstream.StreamConfig{MaxAge: time.Hour})
	addConsumer(t, unlimited, jetstream.ConsumerConfig{Durable: "forever", AckWait: 2 * time.Hour, MaxDeliver: -1})
	noMaxAge := createStream(t, js, jetstream.StreamConfig{})

	name := func(s jetstream.Stream) string { return s.CachedInfo().Config.Name }
	cases := []struct {
		desc    string
		streams []jetstream.Stream
		margin  time.Duration
		want    time.Duration
		err     error
	}{
		{desc: "MaxAge", streams: []jetstream.Stream{hour}, margin: 10 * time.Minute, want: time.Hour + 10*time.Minute},
		{desc: "default margin", streams: []jetstream.Stream{hour}, want: time.Hour + jetstreamretention.DefaultMargin},
		{desc: "AckWait x MaxDeliver past MaxAge", streams: []jetstream.Stream{ackWait}, margin: time.Minute, want: 150*time.Minute + time.Minute},
		{desc: "BackOff, the last interval repeating", streams: []jetstream.Stream{backOff}, margin: time.Minute,
			want: time.Minute + 10*time.Minute + 3*time.Hour + time.Minute},
		{desc: "unlimited MaxDeliver", streams: []jetstream.Stream{unlimited}, margin: time.Minute, want: time.Hour + time.Minute},
		{desc: "the longest stream", streams: []jetstream.Stream{hour, backOff, unlimited}, margin: time.Minute,
			want: 3*time.Hour + 11*time.Minute + time.Minute},
		{desc: "no MaxAge", streams: []jetstream.Stream{hour, noMaxAge}, err: jetstreamretention.ErrNoSafeWindow},
	}
	for _, tc := range cases {
		var names []string
		for _, s := range tc.streams {
			names = append(names, name(s))
		}
		src, err := jetstreamretention.New(jetstreamretention.Config{JetStream: js, Streams: names, Margin: tc.margin})
		if err != nil {
			t.Fatal(err)
		}
		got, err := src.SafeWindow(context.Background())
		if tc.err != nil {
			if !errors.Is(err, tc.err) || !strings.Contains(err.Error(), name(noMaxAge)) {
				t.Errorf("%s: err = %v, want %v naming the stream", tc.desc, err, tc.err)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("%s: SafeWindow = %v, %v; want %v", tc.desc, got, err, tc.want)
		}
	}
}

// Describe reports what the window is made of: the stream's MaxAge,
// Duplicates (the server's 2-minute default when unset) and retention, and
// each consumer's redelivery settings as the server filled them in (AckWait
// 30s and unlimited MaxDeliver by default).
func TestDescribe(t *testing.T) {
	t.Parallel()
	js, _ := connect(t)
	s := createStream(t, js, jetstream.StreamConfig{MaxAge: time.Hour, Retention: jetstream.WorkQueuePolicy})
	addConsumer(t, s, jetstream.ConsumerConfig{Durable: "billing"})
	src, err := jetstreamretention.New(jetstreamretention.Config{JetStream: js, Streams: []string{s.CachedInfo().Config.Name}})
	if err != nil {
		t.Fatal(err)
	}
	windows, err := src.Describe(context.Background())
	if err != nil || len(windows) != 1 {
		t.Fatalf("Describe: %v, %v", windows, err)
	}
	w := windows[0]
	if w.MaxAge != time.Hour || w.Duplicates != 2*time.Minute || w.Retention != jetstream.WorkQueuePolicy || len(w.Consumers) != 1 {
		t.Fatalf("stream window: %+v; want MaxAge 1h, Duplicates 2m, work queue, one consumer", w)
	}
	c := w.Consumers[0]
	if span, bounded := c.Redelivery(); c.Consumer != "billing" || c.AckWait != 30*time.Second || bounded || span != 0 {
		t.Errorf("consumer window: %+v, redelivery %v bounded %v; want billing, AckWait 30s, unbounded", c, span, bounded)
	}
	if w.Window() != time.Hour {
		t.Errorf("Window = %v, want the MaxAge 1h", w.Window())
	}
}

// A stream that does not exist is an error that names it and matches
// jetstream.ErrStreamNotFound, not an empty window.
func TestUnknownStream(t *testing.T) {
	t.Parallel()
	js, _ := connect(t)
	src, err := jetstreamretention.New(jetstreamretention.Config{JetStream: js, Streams: []string{"INBOX_JSR_NO_SUCH_STREAM"}})
	if err != nil {
		t.Fatal(err)
	}
	_, err = src.SafeWindow(context.Background())
	if !errors.Is(err, jetstream.ErrStreamNotFound) || !strings.Contains(err.Error(), `"INBOX_JSR_NO_SUCH_STREAM" does not exist`) {
		t.Errorf("err = %v, want jetstream.ErrStreamNotFound naming the stream", err)
	}
}

// A stream that allows per-message TTLs has no safe window: a TTL overrides
// MaxAge. Needs nats-server 2.11 or later (older servers drop the setting).
func TestMsgTTLStreamHasNoSafeWindow(t *testing.T) {
	t.Parallel()
	js, _ := connect(t)
	s := createStream(t, js, jetstream.StreamConfig{MaxAge: time.Hour, AllowMsgTTL: true})
	if !s.CachedInfo().Config.AllowMsgTTL {
		t.Skipf("nats-server %s does not keep AllowMsgTTL (needs 2.11 or later)", js.Conn().ConnectedServerVersion())
	}
	src, err := jetstreamretention.New(jetstreamretention.Config{JetStream: js, Streams: []string{s.CachedInfo().Config.Name}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := src.SafeWindow(context.Background()); !errors.Is(err, jetstreamretention.ErrNoSafeWindow) {
		t.Errorf("err = %v, want ErrNoSafeWindow", err)
	}
}

// New connects to URL and Close closes that connection: SafeWindow then
// fails. A second Close is harmless.
func TestNewConnectsAndCloseDisconnects(t *testing.T) {
	t.Parallel()
	js, url := connect(t)
	s := createStream(t, js, jetstream.StreamConfig{MaxAge: time.Hour})
	src, err := jetstreamretention.New(jetstreamretention.Config{URL: url, Streams: []string{s.CachedInfo().Config.Name}, Margin: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	if got, err := src.SafeWindow(context.Background()); err != nil || got != time.Hour+time.Minute {
		t.Errorf("SafeWindow = %v, %v; want 1h1m", got, err)
	}
	if err := src.Close(); err != nil {
		t.Fatal(err)
	}
	if err := src.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if _, err := src.SafeWindow(context.Background()); !errors.Is(err, nats.ErrConnectionClosed) {
		t.Errorf("SafeWindow after Close: %v, want nats.ErrConnectionClosed", err)
	}
}

func TestConfigErrors(t *testing.T) {
	t.Parallel()
	cases := map[string]jetstreamretention.Config{
		"no streams":         {URL: "nats://127.0.0.1:1"},
		"empty stream name":  {URL: "nats://127.0.0.1:1", Streams: []string{"A", ""}},
		"no URL, no client":  {Streams: []string{"A"}},
		"negative margin":    {URL: "nats://127.0.0.1:1", Streams: []string{"A"}, Margin: -time.Hour},
		"unreachable server": {URL: "nats://127.0.0.1:1", Streams: []string{"A"}, Options: []nats.Option{nats.Timeout(time.Second)}},
	}
	for desc, cfg := range cases {
		if src, err := jetstreamretention.New(cfg); err == nil {
			src.Close()
			t.Errorf("%s: want an error", desc)
		}
	}
}

// loopRedelivery is the redelivery span summed one delivery at a time: the
// reference Redelivery's closed form must equal on every input that does not
// overflow.
func loopRedelivery(c jetstreamretention.ConsumerWindow) (span time.Duration, bounded bool) {
	if c.MaxDeliver <= 0 {
		return 0, false
	}
	for i := range c.MaxDeliver {
		switch {
		case len(c.BackOff) == 0:
			span += c.AckWait
		case i < len(c.BackOff):
			span += c.BackOff[i]
		default:
			span += c.BackOff[len(c.BackOff)-1]
		}
	}
	return span, true
}

// Redelivery's closed form gives what summing delivery by delivery gives,
// on the settings consumers use: AckWait alone, BackOff lists shorter than,
// as long as and longer than MaxDeliver, unlimited MaxDeliver.
func TestRedelivery_ClosedFormEqualsSumPerDelivery(t *testing.T) {
	t.Parallel()
	backOff := []time.Duration{time.Second, 5 * time.Second, 30 * time.Second, 2 * time.Minute}
	var cases []jetstreamretention.ConsumerWindow
	for _, maxDeliver := range []int{-1, 0, 1, 2, 3, 4, 5, 10, 1000, 100_000} {
		for _, ackWait := range []time.Duration{time.Millisecond, 30 * time.Second, 7 * time.Minute, 12 * time.Hour} {
			cases = append(cases, jetstreamretention.ConsumerWindow{AckWait: ackWait, MaxDeliver: maxDeliver})
		}
		for n := 1; n <= len(backOff); n++ {
			cases = append(cases, jetstreamretention.ConsumerWindow{AckWait: 30 * time.Second, MaxDeliver: maxDeliver, BackOff: backOff[:n]})
		}
	}
	for _, c := range cases {
		gotSpan, gotBounded := c.Redelivery()
		wantSpan, wantBounded := loopRedelivery(c)
		if gotSpan != wantSpan || gotBounded != wantBounded {
			t.Errorf("%+v: Redelivery = %v, %v; summed per delivery %v, %v", c, gotSpan, gotBounded, wantSpan, wantBounded)
		}
	}
}

// A MaxAge near the largest duration or beyond inbox.MaxSafeWindow (150
// years), a consumer redelivering for centuries (MaxDeliver 2,147,483,647 ×
// AckWait 30s), or a window that the margin takes past 100 years keeps
// messages forever in practice: ErrNoSafeWindow naming the stream, never a
// short or negative window. A consumer with MaxDeliver 2,147,483,647 and
// short BackOff intervals is a window of its exact span.
func TestSafeWindow_HugeSettingsMeanForever(t *testing.T) {
	t.Parallel()
	js, _ := connect(t)
	const year = 365 * 24 * time.Hour
	nearMax := createStream(t, js, jetstream.StreamConfig{MaxAge: math.MaxInt64 - 1})
	centuries := createStream(t, js, jetstream.StreamConfig{MaxAge: 150 * year})
	ninetyNine := createStream(t, js, jetstream.StreamConfig{MaxAge: 99 * year})
	redelivers := createStream(t, js, jetstream.StreamConfig{MaxAge: time.Hour})
	addConsumer(t, redelivers, jetstream.ConsumerConfig{Durable: "forever_ish", AckWait: 30 * time.Second, MaxDeliver: math.MaxInt32})
	backOff := createStream(t, js, jetstream.StreamConfig{MaxAge: time.Hour})
	addConsumer(t, backOff, jetstream.ConsumerConfig{Durable: "backoff", MaxDeliver: math.MaxInt32,
		BackOff: []time.Duration{time.Millisecond, 2 * time.Millisecond}})

	name := func(s jetstream.Stream) string { return s.CachedInfo().Config.Name }
	cases := []struct {
		desc   string
		stream jetstream.Stream
		margin time.Duration
		want   time.Duration // 0: ErrNoSafeWindow
	}{
		{desc: "MaxAge near the largest duration", stream: nearMax},
		{desc: "MaxAge 150 years", stream: centuries},
		{desc: "MaxAge 99 years + margin 2 years", stream: ninetyNine, margin: 2 * year},
		{desc: "MaxAge 99 years + margin 1h", stream: ninetyNine, margin: time.Hour, want: 99*year + time.Hour},
		{desc: "MaxDeliver 2^31-1 x AckWait 30s", stream: redelivers},
		{desc: "MaxDeliver 2^31-1 x BackOff 1ms, 2ms", stream: backOff, margin: time.Minute,
			want: time.Millisecond + 2*time.Millisecond*(math.MaxInt32-1) + time.Minute},
	}
	for _, tc := range cases {
		if tc.stream.CachedInfo().Config.MaxAge == 0 {
			t.Fatalf("%s: the server dropped the MaxAge", tc.desc)
		}
		src, err := jetstreamretention.New(jetstreamretention.Config{JetStream: js, Streams: []string{name(tc.stream)}, Margin: tc.margin})
		if err != nil {
			t.Fatal(err)
		}
		got, err := src.SafeWindow(context.Background())
		if tc.want != 0 {
			if err != nil || got != tc.want {
				t.Errorf("%s: SafeWindow = %v, %v; want %v", tc.desc, got, err, tc.want)
			}
			continue
		}
		if !errors.Is(err, jetstreamretention.ErrNoSafeWindow) || !strings.Contains(err.Error(), name(tc.stream)) || got != 0 {
			t.Errorf("%s: SafeWindow = %v, %v; want ErrNoSafeWindow naming the stream", tc.desc, got, err)
		}
	}
	if _, err := jetstreamretention.New(jetstreamretention.Config{JetStream: js, Streams: []string{"A"}, Margin: inbox.MaxSafeWindow + 1}); err == nil {
		t.Error("a margin beyond inbox.MaxSafeWindow: want an error")
	}
}
