// Package kafkaretention tells how long a Kafka cluster can still redeliver
// the messages of some topics, so that an inbox purge never deletes the row
// of a message the broker could send again. It reads the topics'
// configuration through the Kafka admin API of IBM/sarama, the client that
// watermill-kafka uses, and implements inbox.WindowSource:
//
//	src, err := kafkaretention.New(kafkaretention.Config{Brokers: brokers, Topics: []string{"orders.confirmed"}})
//	...
//	deleted, err := inbox.Purge(ctx, inbox.PurgeConfig{DB: db, Window: src}) // OlderThan 0: the safe window
//
// It is a package of its own so that the inbox core package does not import
// a Kafka client; the inbox command uses it for its -brokers flag.
package kafkaretention

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/IBM/sarama"

	"github.com/watermill-inbox/inbox"
)

// Kafka's broker defaults (log.retention.hours=168, log.roll.hours=168),
// used when a topic's description does not carry the entry.
const (
	DefaultRetention = 7 * 24 * time.Hour
	DefaultSegment   = 7 * 24 * time.Hour
)

// DefaultMargin is Config.Margin when it is zero.
const DefaultMargin = 24 * time.Hour

// ErrNoSafeWindow means a topic keeps messages without a time limit:
// retention.ms=-1 (forever), or a cleanup.policy with "compact" (the latest
// record of every key stays forever and can be replayed at any time). No
// inbox row of such a topic's consumers may be purged by age. Match it with
// errors.Is.
var ErrNoSafeWindow = errors.New("kafkaretention: topic has no safe purge window")

// Config configures a Source.
type Config struct {
	// Brokers are the Kafka bootstrap addresses. Required unless Admin is set.
	Brokers []string
	// SaramaConfig is used to create the admin client from Brokers.
	// Default: sarama.NewConfig() with Version V2_8_0_0 (DescribeConfigs
	// needs at least 0.11).
	SaramaConfig *sarama.Config
	// Admin, if set, is used instead of creating a client; Close then does
	// not close it.
	Admin sarama.ClusterAdmin
	// Topics are the topics the consumer reads (all of them: the window is
	// the longest). Required.
	Topics []string
	// Margin is added to the longest topic window, for a consumer that is
	// down, a retention check that runs late (log.retention.check.interval.ms)
	// and clock skew between the broker and the database. Default: 24h
	// (DefaultMargin); a negative value is an error.
	Margin time.Duration
}

// Source reports the safe purge window of a set of topics. It is safe for
// concurrent use; every SafeWindow call asks the cluster again, so changed
// topic configurations are seen at the next purge.
type Source struct {
	admin     sarama.ClusterAdmin
	ownsAdmin bool
	topics    []string
	margin    time.Duration

	closeOnce sync.Once
	closeErr  error
}

var _ inbox.WindowSource = (*Source)(nil)

// New checks cfg and connects the admin client (when Admin is not given).
func New(cfg Config) (*Source, error) {
	if len(cfg.Topics) == 0 {
		return nil, errors.New("kafkaretention: Config.Topics is required")
	}
	if cfg.Margin < 0 {
		return nil, fmt.Errorf("kafkaretention: Config.Margin must not be negative, got %v", cfg.Margin)
	}
	if cfg.Margin == 0 {
		cfg.Margin = DefaultMargin
	}
	s := &Source{admin: cfg.Admin, topics: cfg.Topics, margin: cfg.Margin}
	if s.admin == nil {
		if len(cfg.Brokers) == 0 {
			return nil, errors.New("kafkaretention: Config.Brokers or Config.Admin is required")
		}
		sc := cfg.SaramaConfig
		if sc == nil {
			sc = sarama.NewConfig()
			sc.Version = sarama.V2_8_0_0
		}
		admin, err := sarama.NewClusterAdmin(cfg.Brokers, sc)
		if err != nil {
			return nil, fmt.Errorf("kafkaretention: admin client: %w", err)
		}
		s.admin, s.ownsAdmin = admin, true
	}
	return s, nil
}

// Close closes the admin client New created (not one given in
// Config.Admin, which stays the caller's). It is safe to call more than
// once: later calls return the first call's result. SafeWindow fails after
// Close.
func (s *Source) Close() error {
	s.closeOnce.Do(func() {
		if s.ownsAdmin {
			s.closeErr = s.admin.Close()
		}
	})
	return s.closeErr
}

// TopicWindow is what one topic's configuration allows.
type TopicWindow struct {
	Topic     string
	Retention time.Duration // retention.ms
	Segment   time.Duration // segment.ms
	Policy    string        // cleanup.policy
}

// Window is how long the topic can redeliver a message: a segment is only
// deleted once its newest record is older than retention.ms, and a segment
// may hold records up to segment.ms older than its newest, so a record can
// be readable until retention.ms + segment.ms after its timestamp.
func (w TopicWindow) Window() time.Duration { return w.Retention + w.Segment }

// Describe reads the topics' retention settings. A topic that keeps
// messages forever or compacts them gives an error wrapping ErrNoSafeWindow.
func (s *Source) Describe(ctx context.Context) ([]TopicWindow, error) {
	var out []TopicWindow
	for _, topic := range s.topics {
		entries, err := s.describe(ctx, topic)
		if err != nil {
			return nil, err
		}
		w := TopicWindow{Topic: topic, Retention: DefaultRetention, Segment: DefaultSegment, Policy: "delete"}
		for _, e := range entries {
			switch e.Name {
			case "retention.ms", "segment.ms":
				ms, err := strconv.ParseInt(e.Value, 10, 64)
				if err != nil {
					return nil, fmt.Errorf("kafkaretention: topic %s: %s=%q: %w", topic, e.Name, e.Value, err)
				}
				if e.Name == "segment.ms" {
					w.Segment = time.Duration(ms) * time.Millisecond
					continue
				}
				if ms < 0 {
					return nil, fmt.Errorf("%w: topic %s has retention.ms=%d (kept forever)", ErrNoSafeWindow, topic, ms)
				}
				w.Retention = time.Duration(ms) * time.Millisecond
			case "cleanup.policy":
				w.Policy = e.Value
				if strings.Contains(e.Value, "compact") {
					return nil, fmt.Errorf("%w: topic %s has cleanup.policy=%s (compacted records stay forever)", ErrNoSafeWindow, topic, e.Value)
				}
			}
		}
		out = append(out, w)
	}
	return out, nil
}

// SafeWindow returns the longest topic window plus the margin: the purge
// window under which no row of a message the cluster can still deliver is
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

// describe runs sarama's DescribeConfig, which takes no context, so that a
// cancelled ctx still returns at once.
func (s *Source) describe(ctx context.Context, topic string) ([]sarama.ConfigEntry, error) {
	type result struct {
		entries []sarama.ConfigEntry
		err     error
	}
	done := make(chan result, 1)
	go func() {
		entries, err := s.admin.DescribeConfig(sarama.ConfigResource{Type: sarama.TopicResource, Name: topic})
		done <- result{entries, err}
	}()
	select {
	case r := <-done:
		if r.err != nil {
			return nil, fmt.Errorf("kafkaretention: describe topic %s: %w", topic, r.err)
		}
		return r.entries, nil
	case <-ctx.Done():
		return nil, fmt.Errorf("kafkaretention: describe topic %s: %w", topic, ctx.Err())
	}
}
