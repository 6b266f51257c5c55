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
)

// DefaultMargin is Config.Margin when it is zero.
const DefaultMargin = 24 * time.Hour

// ErrNoSafeWindow means a stream can keep messages without a time limit:
// MaxAge 0 (unlimited), or per-message TTLs allowed (AllowMsgTTL), which
// override MaxAge. A consumer of such a stream can have a stored message
// replayed at any time, so no inbox row of its consumers may be purged by
// age. Match it with errors.Is.
var ErrNoSafeWindow = errors.New("jetstreamretention: stream has no safe purge window")

// Config configures a Source.
type Config struct {
	// URL is the NATS server URL (nats://host:4222, or several,
	// comma-separated). Required unless JetStream is set.
	URL string
	// Options are passed to nats.Connect with URL (credentials, TLS,
	// timeouts). Default: none (nats.go's defaults).
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
	// a negative value is an error.
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
	if cfg.Margin < 0 {
		return nil, fmt.Errorf("jetstreamretention: Config.Margin must not be negative, got %v", cfg.Margin)
	}
	if cfg.Margin == 0 {
		cfg.Margin = DefaultMargin
	}
	s := &Source{js: cfg.JetStream, streams: cfg.Streams, margin: cfg.Margin}
	if s.js == nil {
		if cfg.URL == "" {
			return nil, errors.New("jetstreamretention: Config.URL or Config.JetStream is required")
		}
		nc, err := nats.Connect(cfg.URL, cfg.Options...)
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
	window := w.MaxAge
	for _, c := range w.Consumers {
		if span, bounded := c.Redelivery(); bounded {
			window = max(window, span)
		}
	}
	return window
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
// one repeating), summed. bounded is false when MaxDeliver is unlimited:
// then only the stream's MaxAge ends the redeliveries.
func (c ConsumerWindow) Redelivery() (span time.Duration, bounded bool) {
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

// Describe reads the streams' and their consumers' settings. A stream that
// does not exist gives an error wrapping jetstream.ErrStreamNotFound; one
// without a time limit (MaxAge 0, or AllowMsgTTL) an error wrapping
// ErrNoSafeWindow. Every request uses ctx (nats.go's default timeout of 5s
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
		out = append(out, w)
	}
	return out, nil
}

// SafeWindow returns the longest stream window plus the margin: the purge
// window under which no row of a message the server can still deliver is
// deleted. It implements inbox.WindowSource.
func (s *Source) SafeWindow(ctx context.Context) (time.Duration, error) {
	windows, err := s.Describe(ctx)
	if err != nil {
		return 0, err
	}
	var longest time.Duration
	for _, w := range windows {
		longest = max(longest, w.Window())
	}
	return longest + s.margin, nil
}
