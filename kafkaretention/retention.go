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
// # Topics that keep messages forever
//
// A topic that keeps its records without a time limit has no safe window:
// retention.ms=-1, a cleanup.policy with "compact" or without "delete", and a retention.ms or
// segment.ms beyond what a time.Duration holds (about 292 years: Kafka's
// Long.MAX_VALUE, 9223372036854775807, which some tools write for "forever",
// or 300 years). So has a topic whose window, retention.ms + segment.ms, or
// that window plus Margin, is longer than inbox.MaxSafeWindow (100 years):
// nothing that old is ever purged, and such a setting means "forever" in
// practice. SafeWindow then returns an error wrapping ErrNoSafeWindow that
// names the topic and the setting, and a purge using the Source stops before
// it deletes anything. Every sum is computed without wrapping: a window can
// never come out shorter, or negative, because its parts were large.
//
// # Timestamps ahead, and settings lowered
//
// Under CreateTime a record stamped ahead of the broker's clock keeps its
// segment longer: the window adds the topic's bound on that
// (message.timestamp.after.max.ms) or Config.FutureTimestamps where it sets
// none. Settings that change (segment.ms lowered, retention.ms raised) are
// taken with the earlier ones for as long as records stored under those
// can be readable, as far as this process saw (Source.SafeWindow).
// docs/purge.md has the details.
//
// It is a package of its own so that the inbox core package does not import
// a Kafka client; the inbox command uses it for its -brokers flag.
package kafkaretention

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/IBM/sarama"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/duration"
)

// Kafka's broker defaults (log.retention.hours=168, log.roll.hours=168),
// used when a topic's description does not carry the entry.
const (
	DefaultRetention = 7 * 24 * time.Hour
	DefaultSegment   = 7 * 24 * time.Hour
)

// DefaultMargin is Config.Margin when it is zero.
const DefaultMargin = 24 * time.Hour

// DefaultFutureTimestamps is Config.FutureTimestamps when it is zero: the
// bound Kafka 4.0 puts on a record's timestamp by default
// (message.timestamp.after.max.ms, 1 hour; Long.MAX_VALUE before 4.0).
const DefaultFutureTimestamps = time.Hour

// ErrNoSafeWindow means a topic keeps messages without a time limit:
// retention.ms=-1 (forever), a cleanup.policy with "compact" (the latest
// record of every key stays forever and can be replayed at any time) or
// without "delete" (an empty one: nothing is deleted by age), a
// retention.ms or segment.ms beyond what a time.Duration holds (about 292
// years, such as Long.MAX_VALUE), or a window (retention.ms + segment.ms,
// plus Margin) longer than inbox.MaxSafeWindow. No inbox row of such a
// topic's consumers may be purged by age. Match it with errors.Is.
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
	// (DefaultMargin); a negative value, or one above inbox.MaxSafeWindow,
	// is an error.
	Margin time.Duration
	// FutureTimestamps is how far ahead of the brokers' clocks a producer
	// may stamp a record (message.timestamp.type=CreateTime, Kafka's
	// default) of a topic whose configuration does not bound it: without
	// message.timestamp.after.max.ms (message.timestamp.difference.max.ms
	// before Kafka 3.6), or with Long.MAX_VALUE, Kafka's default before
	// 4.0. Kafka deletes a segment once its newest timestamp is older than
	// retention.ms, so a record stamped ahead keeps its segment, and every
	// record in it, readable for as much longer. A topic that bounds it has
	// its own bound added; LogAppendTime adds nothing. A producer whose
	// clock runs further ahead than this makes the purge delete rows of
	// messages Kafka can still replay: bound the topic's timestamps
	// (message.timestamp.after.max.ms) or use LogAppendTime.
	// Default: DefaultFutureTimestamps (1 hour); a negative value, or one
	// above inbox.MaxSafeWindow, is an error.
	FutureTimestamps time.Duration
}

// Source reports the safe purge window of a set of topics. It is safe for
// concurrent use; every SafeWindow call asks the cluster again, so changed
// topic configurations are seen at the next purge: a longer window at once,
// a shorter one only once every record stored under the earlier settings is
// gone (see SafeWindow).
type Source struct {
	admin     sarama.ClusterAdmin
	ownsAdmin bool
	topics    []string
	margin    time.Duration
	future    time.Duration

	// seen holds, by topic, the settings SafeWindow found and since when
	// each is superseded, for as long as a record stored under them can be
	// readable.
	seenMu sync.Mutex
	seen   map[string][]seenSettings
	now    func() time.Time

	closeOnce sync.Once
	closeErr  error
}

var _ inbox.WindowSource = (*Source)(nil)

// New checks cfg and connects the admin client (when Admin is not given).
func New(cfg Config) (*Source, error) {
	if len(cfg.Topics) == 0 {
		return nil, errors.New("kafkaretention: Config.Topics is required")
	}
	if cfg.Margin < 0 || cfg.Margin > inbox.MaxSafeWindow {
		return nil, fmt.Errorf("kafkaretention: Config.Margin must be between 0 and %v (inbox.MaxSafeWindow), got %v", inbox.MaxSafeWindow, cfg.Margin)
	}
	if cfg.Margin == 0 {
		cfg.Margin = DefaultMargin
	}
	if cfg.FutureTimestamps < 0 || cfg.FutureTimestamps > inbox.MaxSafeWindow {
		return nil, fmt.Errorf("kafkaretention: Config.FutureTimestamps must be between 0 and %v (inbox.MaxSafeWindow), got %v",
			inbox.MaxSafeWindow, cfg.FutureTimestamps)
	}
	if cfg.FutureTimestamps == 0 {
		cfg.FutureTimestamps = DefaultFutureTimestamps
	}
	s := &Source{admin: cfg.Admin, topics: cfg.Topics, margin: cfg.Margin, future: cfg.FutureTimestamps,
		seen: map[string][]seenSettings{}, now: time.Now}
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
	// TimestampType is message.timestamp.type: "CreateTime" (the
	// producer's clock; Kafka's default) or "LogAppendTime".
	TimestampType string
	// Future is how far ahead of the broker's clock a record's timestamp
	// may be: 0 with LogAppendTime; with CreateTime the topic's
	// message.timestamp.after.max.ms (message.timestamp.difference.max.ms
	// before Kafka 3.6), or Config.FutureTimestamps where it sets no bound.
	Future time.Duration

	// deletesNothing: the topic deletes no record by age (retention.ms -1
	// or beyond inbox.MaxSafeWindow, or a cleanup.policy without "delete"
	// alone); Retention is 0 then.
	deletesNothing bool
	// segmentUnbounded: segment.ms is beyond inbox.MaxSafeWindow (Long.MAX,
	// "never roll by time"); Segment is 0 then.
	segmentUnbounded bool
}

// Window is how long the topic can redeliver a message: a segment is only
// deleted once its newest record's timestamp is older than retention.ms, a
// segment may hold records up to segment.ms older than its newest, and that
// newest may be stamped up to Future ahead, so a record can be readable
// until retention.ms + segment.ms + Future after it was written. The sum
// saturates at the longest time.Duration instead of wrapping.
func (w TopicWindow) Window() time.Duration {
	return duration.Add(duration.Add(w.Retention, w.Segment), w.Future)
}

// Describe reads the topics' retention settings, all in one request. A topic
// that keeps messages forever or compacts them, or whose Window is longer
// than inbox.MaxSafeWindow, gives an error wrapping ErrNoSafeWindow (see the
// package documentation); a segment.ms that Kafka would refuse (0 or
// negative) or a value that is not a number gives another error, and a topic
// the cluster does not have an error wrapping *sarama.DescribeConfigError.
func (s *Source) Describe(ctx context.Context) ([]TopicWindow, error) {
	windows, err := s.describeEach(ctx)
	if err != nil {
		return nil, err
	}
	return windows, nil
}

// describeEach is Describe that goes on past a topic that fails: it
// returns every topic's window as far as its settings could be read, the
// failing topics' included, with the first topic's error (or the
// request's, with no window at all).
func (s *Source) describeEach(ctx context.Context) ([]TopicWindow, error) {
	described, err := s.describe(ctx)
	if err != nil {
		return nil, err
	}
	var out []TopicWindow
	var firstErr error
	for _, topic := range s.topics {
		w, err := s.topicWindow(described, topic)
		firstErr = cmp.Or(firstErr, err)
		if w.Topic != "" {
			out = append(out, w)
		}
	}
	return out, firstErr
}

// topicWindow reads one topic's window from the cluster's answer. A topic
// whose settings give no safe window, or cannot be used, gives an error
// and the window as far as the rest of its settings go (Topic "" when the
// cluster has no answer for it): a retention.ms of -1 (forever), or one
// beyond inbox.MaxSafeWindow, is 0 there, since Kafka applies the next
// finite one to every segment (the window then still fails), while the
// segment span and timestamp bound the records were written under stay
// (SafeWindow remembers them: records written in 7-day segments while the
// topic kept everything forever stay 7 days past its new retention).
func (s *Source) topicWindow(described map[string]*sarama.ConfigResourceResult, topic string) (TopicWindow, error) {
	entries, err := topicEntries(described, topic)
	if err != nil {
		return TopicWindow{}, err
	}
	var problem error
	fail := func(err error) { problem = cmp.Or(problem, err) }
	w := TopicWindow{Topic: topic, Retention: DefaultRetention, Segment: DefaultSegment, Policy: "delete", TimestampType: "CreateTime"}
	var afterMax, differenceMax string
	for _, e := range entries {
		switch e.Name {
		case "message.timestamp.type":
			w.TimestampType = e.Value
		case "message.timestamp.after.max.ms":
			afterMax = e.Value
		case "message.timestamp.difference.max.ms":
			differenceMax = e.Value
		case "retention.ms", "segment.ms":
			ms, err := strconv.ParseInt(e.Value, 10, 64)
			switch {
			case err != nil:
				fail(fmt.Errorf("kafkaretention: topic %s: %s=%q: %w", topic, e.Name, e.Value, err))
				continue
			case e.Name == "retention.ms" && ms < 0:
				fail(fmt.Errorf("%w: topic %s has retention.ms=%d (kept forever)", ErrNoSafeWindow, topic, ms))
				w.Retention, w.deletesNothing = 0, true
				continue
			case e.Name == "segment.ms" && ms <= 0:
				// Kafka refuses it (at least 1): a window computed from it
				// would be shorter than the retention.
				fail(fmt.Errorf("kafkaretention: topic %s has segment.ms=%d, which Kafka does not accept (at least 1): fix the topic's configuration", topic, ms))
				continue
			}
			d, ok := duration.Millis(ms)
			if !ok {
				fail(fmt.Errorf("%w: topic %s has %s=%d, beyond what a time.Duration holds (about 292 years): records kept forever",
					ErrNoSafeWindow, topic, e.Name, ms))
				if e.Name == "retention.ms" {
					w.Retention, w.deletesNothing = 0, true
				} else {
					w.Segment, w.segmentUnbounded = 0, true
				}
				continue
			}
			if e.Name == "segment.ms" {
				w.Segment = d
				if d > inbox.MaxSafeWindow {
					// Never rolls by time in practice (the window below
					// fails): remembered by how long it was seen.
					w.Segment, w.segmentUnbounded = 0, true
					fail(fmt.Errorf("%w: topic %s has segment.ms = %v, beyond inbox.MaxSafeWindow (%v): its segments roll only by size",
						ErrNoSafeWindow, topic, d, inbox.MaxSafeWindow))
				}
			} else {
				w.Retention = d
				if d > inbox.MaxSafeWindow {
					fail(fmt.Errorf("%w: topic %s keeps records for up to retention.ms = %v, beyond inbox.MaxSafeWindow (%v): records kept forever in practice",
						ErrNoSafeWindow, topic, d, inbox.MaxSafeWindow))
					w.Retention, w.deletesNothing = 0, true // as -1
				}
			}
		case "cleanup.policy":
			w.Policy = e.Value
			if err := checkCleanupPolicy(topic, e.Value); err != nil {
				fail(err)
				w.deletesNothing = true
			}
		}
	}
	future, err := s.futureBound(topic, w.TimestampType, afterMax, differenceMax)
	if err != nil {
		fail(err)
		future = s.future
	}
	w.Future = future
	if w.Window() > inbox.MaxSafeWindow {
		fail(fmt.Errorf("%w: topic %s keeps records for up to retention.ms + segment.ms + timestamps ahead = %v + %v + %v, beyond inbox.MaxSafeWindow (%v): records kept forever in practice",
			ErrNoSafeWindow, topic, w.Retention, w.Segment, w.Future, inbox.MaxSafeWindow))
	}
	return w, problem
}

// futureBound returns how far ahead of the broker's clock a record of topic
// may be stamped: 0 with LogAppendTime (the broker stamps it); with
// CreateTime the bound the broker checks, read as Kafka reads it
// (LogConfig's messageTimestampAfterMaxMs, Kafka 3.6 to 3.9):
// message.timestamp.after.max.ms unless it is absent (before 3.6) or
// Long.MAX_VALUE (its default before 4.0), in which case the deprecated
// message.timestamp.difference.max.ms; Config.FutureTimestamps when
// neither is reported or the one that counts sets no bound (Long.MAX_VALUE,
// or anything beyond inbox.MaxSafeWindow). A topic of a 3.6 to 3.9 broker
// that set only difference.max.ms (2 days) had its after.max.ms reported at
// Long.MAX_VALUE and was given the 1-hour assumption.
func (s *Source) futureBound(topic, timestampType, afterMax, differenceMax string) (time.Duration, error) {
	switch timestampType {
	case "LogAppendTime":
		return 0, nil
	case "CreateTime":
	default:
		return 0, fmt.Errorf("kafkaretention: topic %s has message.timestamp.type=%q, which this package does not know", topic, timestampType)
	}
	name, value := "message.timestamp.after.max.ms", afterMax
	if value == "" || value == strconv.FormatInt(math.MaxInt64, 10) {
		if differenceMax != "" {
			name, value = "message.timestamp.difference.max.ms", differenceMax
		}
	}
	if value == "" {
		return s.future, nil
	}
	ms, err := strconv.ParseInt(value, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("kafkaretention: topic %s: %s=%q: %w", topic, name, value, err)
	}
	if ms < 0 {
		return 0, fmt.Errorf("kafkaretention: topic %s has %s=%d, which Kafka does not accept (at least 0): fix the topic's configuration", topic, name, ms)
	}
	d, ok := duration.Millis(ms)
	if !ok || d > inbox.MaxSafeWindow {
		return s.future, nil // no bound: Config.FutureTimestamps
	}
	return d, nil
}

// checkCleanupPolicy returns an error wrapping ErrNoSafeWindow unless
// policy, a comma-separated list, is "delete" alone: Kafka deletes a
// segment by its age only when the list holds "delete" (an empty list, as
// Kafka 3.x accepts, deletes nothing), and with "compact" too the latest
// record of every key stays forever.
func checkCleanupPolicy(topic, policy string) error {
	var del, other bool
	for _, p := range strings.Split(policy, ",") {
		switch strings.TrimSpace(p) {
		case "delete":
			del = true
		case "":
		default:
			other = true // "compact", or one this package does not know
		}
	}
	switch {
	case other:
		return fmt.Errorf("%w: topic %s has cleanup.policy=%s (compacted records stay forever)", ErrNoSafeWindow, topic, policy)
	case !del:
		return fmt.Errorf("%w: topic %s has cleanup.policy=%q, without \"delete\": Kafka deletes none of its records by age",
			ErrNoSafeWindow, topic, policy)
	}
	return nil
}

// SafeWindow returns the longest topic window plus the margin: the purge
// window under which no row of a message the cluster can still deliver is
// deleted. A topic whose settings changed since an earlier call keeps, for
// as long as records stored under the earlier ones can be readable, the
// longest finite retention.ms, segment.ms and timestamp bound it had, each
// on its own (Source.remembered): Kafka applies a topic's retention.ms to
// the segments already written, which keep the span of the segment.ms they
// were written under, so raising retention.ms while lowering segment.ms
// needs the new retention with the old span, longer than either whole
// window. A topic without a safe window, or a result longer than
// inbox.MaxSafeWindow, gives an error wrapping ErrNoSafeWindow, never a
// duration. It implements inbox.WindowSource.
func (s *Source) SafeWindow(ctx context.Context) (time.Duration, error) {
	windows, err := s.describeEach(ctx)
	var longest time.Duration
	var longestTopic string
	now := s.now()
	for _, w := range windows {
		// Remembered even when another topic fails the call: settings
		// read only while some topic had no safe window (the purge paused)
		// were never remembered, and once it had one again the window was
		// shorter than the records stored under them.
		if window := s.remembered(w, now); window > longest {
			longest, longestTopic = window, w.Topic
		}
	}
	if err != nil {
		return 0, err
	}
	safe := duration.Add(longest, s.margin)
	if safe > inbox.MaxSafeWindow {
		return 0, fmt.Errorf("%w: topic %s keeps records for up to %v, which with the margin %v is beyond inbox.MaxSafeWindow (%v): records kept forever in practice",
			ErrNoSafeWindow, longestTopic, longest, s.margin, inbox.MaxSafeWindow)
	}
	return safe, nil
}

// seenSettings are a topic's settings that SafeWindow found, when it first
// found them, and since when they no longer are the topic's (zero while
// they are). retention is 0 for settings under which the topic deletes
// nothing by age; unbounded marks a segment.ms beyond inbox.MaxSafeWindow,
// whose span is how long the settings were seen (span).
type seenSettings struct {
	retention, segment, future time.Duration
	unbounded                  bool
	firstSeen, superseded      time.Time
}

// span is how long a segment written under e can span, at now: its
// segment.ms, or for one that never rolls by time the time e was seen in
// force (the active segment rolls at its first write after that). A
// segment.ms of Long.MAX_VALUE for 30 days was remembered as the default 7
// days, and one of 200 years for a minute as 200 years.
func (e seenSettings) span(now time.Time) time.Duration {
	if !e.unbounded {
		return e.segment
	}
	until := now
	if !e.superseded.IsZero() {
		until = e.superseded
	}
	return until.Sub(e.firstSeen)
}

// remembered records w as topic w.Topic's settings now and returns the
// window that covers every record still readable under them or under
// settings it had earlier: the longest finite retention.ms plus the longest
// segment.ms and the longest timestamp bound among the settings it
// remembers. A segment keeps the span and the timestamps it was written
// with, and Kafka deletes it once its newest record is older than the
// retention in force at its next retention check: settings superseded at
// time T are forgotten once the longest retention plus their own segment
// span and timestamp bound have passed since T. The longest, not the
// current: a retention lowered and raised again before a check ran
// (log.retention.check.interval.ms) deletes nothing, and forgetting by the
// lowered one dropped a 7-day span whose records were still there. While
// the topic deletes nothing by age (retention -1 or beyond
// inbox.MaxSafeWindow, or a compacting policy), superseded settings do not
// age: the records stored under them stay, and forgetting them meanwhile
// gave a window days short once the topic deleted by age again. A
// retention that was never finite is not counted: counted, one set to 200
// years for a minute kept SafeWindow refusing for as long. (Whole windows
// were remembered before: settings changed from 1 day / 7 days to 7 days /
// 1 hour took the old 8 days, while the segments written under the old
// span stay for 7 + 7.) Memory of this process only: after a restart the
// current settings apply at once (docs/purge.md says how to change a
// topic's settings safely).
func (s *Source) remembered(w TopicWindow, now time.Time) time.Duration {
	s.seenMu.Lock()
	defer s.seenMu.Unlock()
	current := seenSettings{retention: w.Retention, segment: w.Segment, future: w.Future, unbounded: w.segmentUnbounded, firstSeen: now}
	all := s.seen[w.Topic]
	found := false
	for i := range all {
		e := &all[i]
		switch {
		case e.retention == current.retention && e.segment == current.segment && e.future == current.future && e.unbounded == current.unbounded:
			e.superseded, found = time.Time{}, true
		case e.superseded.IsZero() || w.deletesNothing:
			e.superseded = now
		}
	}
	if !found {
		all = append(all, current)
	}
	var retention time.Duration
	for _, e := range all {
		retention = max(retention, e.retention)
	}
	kept := all[:0]
	var segment, future time.Duration
	for _, e := range all {
		if !e.superseded.IsZero() && now.Sub(e.superseded) >= duration.Add(duration.Add(retention, e.span(now)), e.future) {
			continue // every record stored under them is gone
		}
		kept = append(kept, e)
		segment, future = max(segment, e.span(now)), max(future, e.future)
	}
	retention = 0
	for _, e := range kept {
		retention = max(retention, e.retention)
	}
	s.seen[w.Topic] = kept
	return duration.Add(duration.Add(retention, segment), future)
}

// describe runs sarama's DescribeConfigs for every topic in one request and
// returns its results by topic name. DescribeConfigs takes no context, so it
// runs in a goroutine and a cancelled ctx still returns at once.
func (s *Source) describe(ctx context.Context) (map[string]*sarama.ConfigResourceResult, error) {
	var resources []*sarama.ConfigResource
	for i, topic := range s.topics {
		if !slices.Contains(s.topics[:i], topic) { // each topic once in the request
			resources = append(resources, &sarama.ConfigResource{Type: sarama.TopicResource, Name: topic})
		}
	}
	type result struct {
		results []*sarama.ConfigResourceResult
		err     error
	}
	done := make(chan result, 1)
	go func() {
		results, err := s.admin.DescribeConfigs(resources, sarama.DescribeConfigsOptions{})
		done <- result{results, err}
	}()
	select {
	case r := <-done:
		if r.err != nil {
			return nil, fmt.Errorf("kafkaretention: describe topics %s: %w", strings.Join(s.topics, ", "), r.err)
		}
		byTopic := make(map[string]*sarama.ConfigResourceResult, len(r.results))
		for _, res := range r.results {
			if res.Type == sarama.TopicResource {
				byTopic[res.Name] = res
			}
		}
		return byTopic, nil
	case <-ctx.Done():
		return nil, fmt.Errorf("kafkaretention: describe topics %s: %w", strings.Join(s.topics, ", "), ctx.Err())
	}
}

// topicEntries returns the configuration entries described for topic. The
// broker's error for that topic (an unknown topic, missing authorization)
// comes back as a *sarama.DescribeConfigError; a topic the response does not
// mention is an error too, never a topic with the broker's defaults.
func topicEntries(described map[string]*sarama.ConfigResourceResult, topic string) ([]sarama.ConfigEntry, error) {
	res, ok := described[topic]
	if !ok {
		return nil, fmt.Errorf("kafkaretention: describe topic %s: %w", topic, sarama.ErrIncompleteResponse)
	}
	if !errors.Is(res.ErrorCode, sarama.ErrNoError) {
		return nil, fmt.Errorf("kafkaretention: describe topic %s: %w", topic, &sarama.DescribeConfigError{Err: res.ErrorCode, ErrMsg: res.ErrorMsg})
	}
	return res.Configs, nil
}
