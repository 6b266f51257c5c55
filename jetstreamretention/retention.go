// Package jetstreamretention tells how long NATS JetStream can still
// redeliver the messages of some streams, so that an inbox purge never
// deletes the row of a message the server could send again. It reads the
// streams' and their consumers' configuration through the jetstream API of
// github.com/nats-io/nats.go and implements inbox.WindowSource:
//
//	src, err := jetstreamretention.New(jetstreamretention.Config{URL: nats.DefaultURL, Streams: []string{"ORDERS"}})
//	...
//	deleted, err := inbox.Purge(ctx, inbox.PurgeConfig{DB: db, Window: src}) // OlderThan 0: the safe window
//
// # What bounds a redelivery
//
// A JetStream message can reach the inbox again in three ways:
//
//   - A replay from the stream: a consumer created with DeliverAll (or by
//     start time or sequence), a consumer reset, or an operator re-creating
//     a durable. Anything still stored can come back, whatever was acked.
//     The stream's MaxAge bounds it: the server removes a message MaxAge
//     after it stored it, acked or not, whatever the retention policy
//     (limits, interest, work queue). An inbox row is written after the
//     message was stored, so a row older than MaxAge belongs to a message
//     the stream no longer holds. A stream with MaxAge 0 (unlimited, the
//     default) bounds nothing: MaxMsgs and MaxBytes depend on traffic, not
//     on time. Such a stream has no safe window (ErrNoSafeWindow).
//   - A redelivery of an unacked message: after AckWait (or the consumer's
//     BackOff intervals), up to MaxDeliver times. It too ends when MaxAge
//     removes the message (seen with nats-server 2.9.10 under limits,
//     interest and work-queue retention: a consumer with AckWait 500ms and
//     unlimited MaxDeliver on a stream with MaxAge 2s got an unacked
//     message 4 times, then never again, and the stream was empty). The
//     consumers' spans are still reported and taken as a floor of the
//     window: a stream's window is never shorter than what one of its
//     consumers is configured to redeliver.
//   - A re-publish by a producer (a retry, an outbox relay). JetStream drops
//     a message whose Nats-Msg-Id it stored less than the stream's
//     Duplicates window ago (2 minutes by default; the server keeps it at
//     most MaxAge), so re-publishes within it never reach the inbox. A
//     re-publish after it is stored as a new message, with a new MaxAge:
//     nothing on the server bounds how late a producer retries. Add the
//     longest your producers can re-publish an old message to Margin.
//
// A stream with AllowMsgTTL (nats-server 2.11 and later) lets a publisher set
// a per-message TTL, which the server honours instead of MaxAge (also
// "never"): MaxAge no longer bounds the stream, and it has no safe window. A
// stream that sources or mirrors others holds copies stored when they
// arrived: if it can be re-created and source the origins from the start, add
// the origins' MaxAge to Margin.
//
// # Streams that keep messages forever
//
// A stream with MaxAge 0 or AllowMsgTTL has no safe window (above). Nor has
// one whose window is longer than inbox.MaxSafeWindow (100 years): a MaxAge
// near the largest time.Duration (about 292 years), which some tools write
// for "forever", or a consumer whose redelivery span (AckWait or BackOff
// over MaxDeliver deliveries, MaxDeliver up to 2,147,483,647) is that long;
// nor one whose window plus Margin is. Nothing that old is ever purged, and
// such a setting means "forever" in practice. SafeWindow then returns an
// error wrapping ErrNoSafeWindow that names the stream (and the consumer),
// and a purge using the Source stops before it deletes anything. Every sum
// and product is computed without wrapping: a window never comes out
// shorter, or negative, because its parts were large. A consumer whose
// MaxDeliver is meant as "as often as needed" is better set to -1
// (unlimited), which the stream's MaxAge bounds.
//
// It is a package of its own so that the inbox core package does not import
// a NATS client; the inbox command uses it for its -nats-url flag.
package jetstreamretention

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/duration"
)

// DefaultMargin is Config.Margin when it is zero.
const DefaultMargin = 24 * time.Hour

// ErrNoSafeWindow means a stream can keep messages without a time limit:
// MaxAge 0 (unlimited), per-message TTLs allowed (AllowMsgTTL), which
// override MaxAge, or a window (MaxAge, a consumer's redelivery span, plus
// Margin) longer than inbox.MaxSafeWindow. A consumer of such a stream can have a stored message
// replayed at any time, so no inbox row of its consumers may be purged by
// age. Match it with errors.Is.
var ErrNoSafeWindow = errors.New("jetstreamretention: stream has no safe purge window")

// Config configures a Source.
type Config struct {
	// URL is the NATS server URL (nats://host:4222, or several,
	// comma-separated). Required unless JetStream is set.
	URL string
	// Options are passed to nats.Connect with URL (credentials, TLS,
	// timeouts), after nats.MaxReconnects(-1), which they may override: a
	// Source lives as long as its Purger, and with nats.go's default of 60
	// reconnects 2 s apart an outage of over 2 minutes closed its connection
	// for good, every later purge round failing until a restart. Default:
	// none: nats.go's defaults, but reconnecting for ever.
	Options []nats.Option
	// JetStream, if set, is used instead of connecting to URL; Close then
	// does not close its connection, which stays the caller's.
	JetStream jetstream.JetStream
	// Streams are the streams the consumer reads (all of them: the window
	// is the longest). Required.
	Streams []string
	// Margin is added to the longest stream window, for a consumer that is
	// down, an expiry that runs late, clock skew between the server and the
	// database, and producers that re-publish after the stream's Duplicates
	// window (see the package documentation). Default: 24h (DefaultMargin);
	// a negative value, or one above inbox.MaxSafeWindow, is an error.
	Margin time.Duration
}

// Source reports the safe purge window of a set of streams. It is safe for
// concurrent use; every SafeWindow call asks the server again, so changed
// stream and consumer configurations are seen at the next purge.
type Source struct {
	js      jetstream.JetStream
	conn    *nats.Conn // nil when the JetStream was given
	streams []string
	margin  time.Duration

	closeOnce sync.Once
}

var _ inbox.WindowSource = (*Source)(nil)

// New checks cfg and connects to URL (when JetStream is not given). A
// server that cannot be reached fails here, with nats.go's error wrapped.
func New(cfg Config) (*Source, error) {
	if len(cfg.Streams) == 0 {
		return nil, errors.New("jetstreamretention: Config.Streams is required")
	}
	for _, s := range cfg.Streams {
		if s == "" {
			return nil, errors.New("jetstreamretention: Config.Streams holds an empty stream name")
		}
	}
	if cfg.Margin < 0 || cfg.Margin > inbox.MaxSafeWindow {
		return nil, fmt.Errorf("jetstreamretention: Config.Margin must be between 0 and %v (inbox.MaxSafeWindow), got %v", inbox.MaxSafeWindow, cfg.Margin)
	}
	if cfg.Margin == 0 {
		cfg.Margin = DefaultMargin
	}
	s := &Source{js: cfg.JetStream, streams: cfg.Streams, margin: cfg.Margin}
	if s.js == nil {
		if cfg.URL == "" {
			return nil, errors.New("jetstreamretention: Config.URL or Config.JetStream is required")
		}
		nc, err := nats.Connect(cfg.URL, append([]nats.Option{nats.MaxReconnects(-1)}, cfg.Options...)...)
		if err != nil {
			return nil, fmt.Errorf("jetstreamretention: connect to %s: %w", cfg.URL, err)
		}
		js, err := jetstream.New(nc)
		if err != nil {
			nc.Close()
			return nil, fmt.Errorf("jetstreamretention: %w", err)
		}
		s.js, s.conn = js, nc
	}
	return s, nil
}

// Close closes the connection New opened (not the one of a
// Config.JetStream, which stays the caller's). It is safe to call more than
// once. After Close, SafeWindow fails with nats.go's error for a closed
// connection (on a connection New opened).
func (s *Source) Close() error {
	s.closeOnce.Do(func() {
		if s.conn != nil {
			s.conn.Close()
		}
	})
	return nil
}

// StreamWindow is what one stream's configuration allows.
type StreamWindow struct {
	Stream string
	// MaxAge is the stream's MaxAge: how long the server keeps a message
	// after storing it, acked or not.
	MaxAge time.Duration
	// Duplicates is the stream's publish deduplication window: a message
	// whose Nats-Msg-Id was stored less than this ago is dropped at publish.
	// It does not lengthen the window (re-publishes after it are new
	// messages; see the package documentation).
	Duplicates time.Duration
	// Retention is the stream's retention policy (limits, interest, work
	// queue). MaxAge applies under each.
	Retention jetstream.RetentionPolicy
	// Consumers are the stream's consumers at the time of Describe.
	Consumers []ConsumerWindow
}

// Window is how long after storing a message the stream can still deliver
// it: MaxAge, or the longest redelivery span of its consumers if that is
// longer.
func (w StreamWindow) Window() time.Duration {
	window, _ := w.longest()
	return window
}

// longest returns Window and the consumer whose redelivery span it is ("" if
// it is MaxAge).
func (w StreamWindow) longest() (window time.Duration, consumer string) {
	window = w.MaxAge
	for _, c := range w.Consumers {
		if span, bounded := c.Redelivery(); bounded && span > window {
			window, consumer = span, c.Consumer
		}
	}
	return window, consumer
}

// ConsumerWindow is what one consumer's configuration allows.
type ConsumerWindow struct {
	Consumer   string
	AckWait    time.Duration   // the server's default is 30s
	MaxDeliver int             // -1 or 0: unlimited
	BackOff    []time.Duration // overrides AckWait per delivery when set
}

// Redelivery returns how long after its first delivery the consumer can
// still redeliver an unacked message: the wait after each of its MaxDeliver
// deliveries (AckWait, or the BackOff interval of that delivery, the last
// one repeating), summed. It is computed in closed form (AckWait ×
// MaxDeliver; the BackOff intervals, then the last one × the deliveries
// left), in time proportional to len(BackOff), and saturates at the longest
// time.Duration (about 292 years) instead of wrapping. bounded is false
// when MaxDeliver is unlimited: then only the stream's MaxAge ends the
// redeliveries.
func (c ConsumerWindow) Redelivery() (span time.Duration, bounded bool) {
	if c.MaxDeliver <= 0 {
		return 0, false
	}
	deliveries := int64(c.MaxDeliver)
	if len(c.BackOff) == 0 {
		return duration.Mul(c.AckWait, deliveries), true
	}
	listed := min(deliveries, int64(len(c.BackOff)))
	for _, wait := range c.BackOff[:listed] {
		span = duration.Add(span, wait)
	}
	last := c.BackOff[len(c.BackOff)-1]
	return duration.Add(span, duration.Mul(last, deliveries-listed)), true
}

// Describe reads the streams' and their consumers' settings. A stream that
// does not exist gives an error wrapping jetstream.ErrStreamNotFound; one
// without a time limit (MaxAge 0, or AllowMsgTTL) or whose Window is longer
// than inbox.MaxSafeWindow an error wrapping ErrNoSafeWindow. Every request uses ctx (nats.go's default timeout of 5s
// applies when ctx has no deadline).
func (s *Source) Describe(ctx context.Context) ([]StreamWindow, error) {
	out := make([]StreamWindow, 0, len(s.streams))
	for _, name := range s.streams {
		stream, err := s.js.Stream(ctx, name)
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			return nil, fmt.Errorf("jetstreamretention: stream %q does not exist on the server (check the stream names): %w", name, err)
		}
		if err != nil {
			return nil, fmt.Errorf("jetstreamretention: stream %s: %w", name, err)
		}
		cfg := stream.CachedInfo().Config
		if cfg.MaxAge <= 0 {
			return nil, fmt.Errorf("%w: stream %s has no MaxAge (messages stay until MaxMsgs or MaxBytes push them out, or forever)", ErrNoSafeWindow, name)
		}
		if cfg.AllowMsgTTL {
			return nil, fmt.Errorf("%w: stream %s allows per-message TTLs (AllowMsgTTL), which override its MaxAge %v", ErrNoSafeWindow, name, cfg.MaxAge)
		}
		w := StreamWindow{Stream: name, MaxAge: cfg.MaxAge, Duplicates: cfg.Duplicates, Retention: cfg.Retention}
		consumers := stream.ListConsumers(ctx)
		for info := range consumers.Info() {
			w.Consumers = append(w.Consumers, ConsumerWindow{
				Consumer:   info.Name,
				AckWait:    info.Config.AckWait,
				MaxDeliver: info.Config.MaxDeliver,
				BackOff:    info.Config.BackOff,
			})
		}
		if err := consumers.Err(); err != nil {
			return nil, fmt.Errorf("jetstreamretention: stream %s: list consumers: %w", name, err)
		}
		if err := w.checkBound(0); err != nil {
			return nil, err
		}
		out = append(out, w)
	}
	return out, nil
}

// checkBound returns an error wrapping ErrNoSafeWindow when the stream's
// window plus margin is longer than inbox.MaxSafeWindow, naming the
// setting that makes it so.
func (w StreamWindow) checkBound(margin time.Duration) error {
	window, consumer := w.longest()
	if duration.Add(window, margin) <= inbox.MaxSafeWindow {
		return nil
	}
	what := fmt.Sprintf("MaxAge %v", w.MaxAge)
	if consumer != "" {
		what = fmt.Sprintf("consumer %s redelivering for up to %v (AckWait or BackOff over MaxDeliver deliveries; "+
			"set MaxDeliver to -1, unlimited, to let MaxAge %v bound it)", consumer, window, w.MaxAge)
	}
	withMargin := ""
	if margin > 0 {
		withMargin = fmt.Sprintf(", with the margin %v,", margin)
	}
	return fmt.Errorf("%w: stream %s has %s%s beyond inbox.MaxSafeWindow (%v): messages kept forever in practice",
		ErrNoSafeWindow, w.Stream, what, withMargin, inbox.MaxSafeWindow)
}

// SafeWindow returns the longest stream window plus the margin: the purge
// window under which no row of a message the server can still deliver is
// deleted. A stream without a safe window, or a result longer than
// inbox.MaxSafeWindow, gives an error wrapping ErrNoSafeWindow, never a
// duration. It implements inbox.WindowSource.
func (s *Source) SafeWindow(ctx context.Context) (time.Duration, error) {
	windows, err := s.Describe(ctx)
	if err != nil {
		return 0, err
	}
	var longest StreamWindow
	for _, w := range windows {
		if w.Window() > longest.Window() {
			longest = w
		}
	}
	if err := longest.checkBound(s.margin); err != nil {
		return 0, err
	}
	return duration.Add(longest.Window(), s.margin), nil
}
