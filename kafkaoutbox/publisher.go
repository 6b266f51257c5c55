// Package kafkaoutbox is the Kafka publisher for the outbox relay
// (inbox.Outbox): a drop-in for watermill-kafka's kafka.NewPublisher, with
// the same kafka.PublisherConfig and marshalers, that sends all the messages
// of one Publish call together and waits for the broker's acks once.
//
//	pub, err := kafkaoutbox.NewPublisher(kafka.PublisherConfig{Brokers: brokers, Marshaler: kafka.DefaultMarshaler{}}, logger)
//	...
//	ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Publisher: pub, Logger: logger})
//
// # Why not watermill-kafka's publisher
//
// The relay hands the broker a round's messages of one topic in one
// Publish call. watermill-kafka's Publisher sends them one at a time and
// waits for each one's ack before the next, so a relay behind it moves one
// message per broker round trip: with a broker whose produce takes 2 ms (a
// replicated topic with acks=all) that is about 400 messages a second,
// while the inbox commits thousands (BENCHMARKS.md, "Relaying to Kafka").
// This Publisher sends them with one sarama SyncProducer.SendMessages: the
// client batches them per partition into as few produce requests as it can.
//
// # Delivery and order
//
// Publish returns nil only once the broker acked every message. When the
// broker refused some of a call's messages, its error says which with an
// *inbox.PublishError, and the relay deletes the acked ones
// and keeps the refused ones, which it sends again with their UUIDs: at
// least once, and a partition that refuses its messages holds back none of
// the other partitions' and has none of theirs sent again. A refusal of
// the message itself (over the size limits, a corrupt or invalid record, a
// timestamp of the message's own that the topic refuses, a message the
// marshaler refuses) wraps
// inbox.ErrMessageRejected, and the relay sets the message aside once it
// used its attempts; every other refusal (no leader for the partition, a
// timeout, not enough replicas, a producer fenced or out of sequence, an
// authorization, an error code Kafka does not name, no connection, sarama's
// circuit breaker open after failed metadata lookups, a closed publisher)
// is the broker's state and wraps inbox.ErrBrokerUnavailable: the relay
// never sets those messages aside, however long it lasts. A topic name
// Kafka cannot hold is refused before anything is sent (ErrMessageRejected).
// The default sarama configuration (DefaultSaramaConfig) is
// watermill-kafka's made safe for an outbox, whose relay deletes a row once
// Publish said its message was acked:
//   - RequiredAcks WaitForAll: a message acked by the leader alone is lost
//     if the leader fails before a follower copied it, after its row is
//     gone (Kafka's acks=all; keep the topics' min.insync.replicas at 2 or
//     more);
//   - the idempotent producer with Net.MaxOpenRequests 1: a produce request
//     the client retries cannot be overtaken by a later one, and a retry
//     does not write a message twice (Kafka's enable.idempotence);
//   - retries that last about 13 s, so that a leader election holds the
//     partition's messages in sarama, in order, instead of failing them;
//   - Producer.Flush.Frequency 5 ms: sarama gathers a call's messages for
//     5 ms and sends them in one produce request per broker, refused or
//     written together (it sends the first message of an idle producer
//     alone otherwise).
//
// A partition's messages are written in the order of the call, with one
// exception: when a call's messages of one partition do not go in one
// request (more than Producer.MaxMessageBytes of them, 1 MB, or more than
// 5 ms to hand to sarama) and the broker refuses one request for good (an
// error it does not retry, or a retriable one that outlasts the retries),
// the later requests are still written. The relay sends the refused
// messages again, and they first arrive after later ones of their
// partition.
//
// A configuration passed in kafka.PublisherConfig.OverwriteSaramaConfig is
// used as given; NewPublisher logs a line at Info (Watermill's logger has
// no warning level) when it is not idempotent or not acks=all.
//
// A message for a topic the cluster does not have fails on every round
// once sarama's metadata retries are spent (UNKNOWN_TOPIC_OR_PARTITION, a
// retriable error: it is never set aside) and holds back its topic; the
// outbox's age and depth (Outbox.Stats, the metrics module's alerts) show
// it.
//
// It is a package of its own so that the inbox core package does not import
// watermill-kafka.
package kafkaoutbox

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
)

// ErrPublisherClosed is returned by Publish after Close, wrapped with
// inbox.ErrBrokerUnavailable: a relay still running after the publisher
// closed (a shutdown in the wrong order) keeps its messages for a later
// round and sets none aside.
var ErrPublisherClosed = errors.New("kafkaoutbox: publisher closed")

// ErrCloseTimedOut is wrapped by Close's error when the Publish calls in
// progress, or the producer's own close, did not end within the close
// timeout (WithCloseTimeout): the broker has not answered them. Close then
// returns without them; they end when sarama gives up, and the relay sends
// their messages again (at least once).
var ErrCloseTimedOut = errors.New("kafkaoutbox: close timed out")

// DefaultCloseTimeout is how long Close waits for the Publish calls in
// progress and the producer's close, unless WithCloseTimeout says
// otherwise.
const DefaultCloseTimeout = 10 * time.Second

// Publisher publishes Watermill messages to Kafka, all the messages of one
// Publish call in one batch. It implements message.Publisher and is safe
// for concurrent use.
type Publisher struct {
	producer     sarama.SyncProducer
	marshaler    kafka.Marshaler
	closeTimeout time.Duration
	// maxMessageBytes and recordVersion are what sarama measures a message
	// against before it sends it (Producer.MaxMessageBytes; record batches
	// from Kafka 0.11).
	maxMessageBytes, recordVersion int

	mu       sync.Mutex // guards closed and the inFlight.Add that follows its check
	closed   bool
	inFlight sync.WaitGroup // the Publish calls in progress
}

// Option changes a Publisher made by NewPublisher.
type Option func(*Publisher)

// WithCloseTimeout sets how long Close waits for the Publish calls in
// progress and the producer's close before it returns ErrCloseTimedOut.
// Must be positive. Default: DefaultCloseTimeout (10 s).
func WithCloseTimeout(d time.Duration) Option {
	return func(p *Publisher) {
		if d > 0 {
			p.closeTimeout = d
		}
	}
}

// DefaultSaramaConfig returns the sarama configuration NewPublisher uses
// when config.OverwriteSaramaConfig is nil: watermill-kafka's
// kafka.DefaultSaramaSyncPublisherConfig (Kafka 1.0 protocol, client id
// "watermill") with
//   - RequiredAcks WaitForAll, the idempotent producer and
//     Net.MaxOpenRequests 1 (see the package documentation);
//   - Producer.Retry.Max 10 with a backoff that doubles from 100 ms to 2 s
//     (about 13 s in all), so that a partition whose leader is being
//     elected waits in sarama, in order, instead of failing the call;
//   - Metadata.Retry.Backoff 250 ms, sarama's own (watermill-kafka's 2 s
//     made each call with a message for a topic that does not exist take
//     12 s, and the relay's round with it);
//   - Producer.Flush.Frequency 5 ms (see the package documentation).
//
// Start from it to change other settings. Producer.MaxMessageBytes stays
// sarama's 1,000,000: keep it at or below your topics' max.message.bytes,
// or a partition's batch over the topic's limit is refused whole and every
// relay round falls back to one publish per message (docs/outbox.md,
// Order).
func DefaultSaramaConfig() *sarama.Config {
	cfg := kafka.DefaultSaramaSyncPublisherConfig()
	cfg.Producer.RequiredAcks = sarama.WaitForAll
	cfg.Producer.Idempotent = true
	cfg.Net.MaxOpenRequests = 1
	cfg.Producer.Retry.Max = 10
	cfg.Producer.Retry.BackoffFunc = func(retries, _ int) time.Duration {
		return min(100*time.Millisecond<<min(max(retries-1, 0), 5), 2*time.Second) // 100, 200, … 1,600 ms, then 2 s
	}
	cfg.Metadata.Retry.Backoff = 250 * time.Millisecond
	cfg.Producer.Flush.Frequency = 5 * time.Millisecond
	return cfg
}

// NewPublisher connects a sarama SyncProducer to config.Brokers and returns
// a Publisher that marshals with config.Marshaler (the same marshalers as
// watermill-kafka's publisher, so watermill-kafka's subscribers read the
// messages as they read that publisher's). config.OverwriteSaramaConfig
// defaults to DefaultSaramaConfig(); config.Tracer (or OTELEnabled) wraps
// the producer as watermill-kafka's NewPublisher does. A missing broker list
// or marshaler, or a sarama configuration that cannot make a SyncProducer
// (Producer.Return.Successes false), is an error wrapping
// inbox.ErrInvalidConfig; a broker that cannot be reached is sarama's error.
// logger defaults to watermill.NopLogger{}.
func NewPublisher(config kafka.PublisherConfig, logger watermill.LoggerAdapter, options ...Option) (*Publisher, error) {
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	if config.OverwriteSaramaConfig == nil {
		config.OverwriteSaramaConfig = DefaultSaramaConfig()
	}
	if err := validate(config); err != nil {
		return nil, fmt.Errorf("%w: kafkaoutbox: %w", inbox.ErrInvalidConfig, err)
	}
	if p := config.OverwriteSaramaConfig.Producer; p.RequiredAcks != sarama.WaitForAll || !p.Idempotent {
		logger.Info("kafkaoutbox: the sarama configuration weakens the outbox's guarantees: without "+
			"RequiredAcks WaitForAll a leader failure can lose relayed messages; without Idempotent a "+
			"request whose answer was lost is written twice, and with Net.MaxOpenRequests over 1 a "+
			"retried request can reorder a partition's messages", watermill.LogFields{
			"required_acks": int(p.RequiredAcks), "idempotent": p.Idempotent,
			"max_open_requests": config.OverwriteSaramaConfig.Net.MaxOpenRequests,
		})
	}
	producer, err := sarama.NewSyncProducer(config.Brokers, config.OverwriteSaramaConfig)
	if err != nil {
		return nil, fmt.Errorf("kafkaoutbox: cannot create the Kafka producer: %w", err)
	}
	if config.OTELEnabled && config.Tracer == nil {
		config.Tracer = kafka.NewOTELSaramaTracer()
	}
	if config.Tracer != nil {
		producer = config.Tracer.WrapSyncProducer(config.OverwriteSaramaConfig, producer)
	}
	p := &Publisher{producer: producer, marshaler: config.Marshaler, closeTimeout: DefaultCloseTimeout,
		maxMessageBytes: config.OverwriteSaramaConfig.Producer.MaxMessageBytes, recordVersion: 1}
	if config.OverwriteSaramaConfig.Version.IsAtLeast(sarama.V0_11_0_0) {
		p.recordVersion = 2
	}
	for _, o := range options {
		o(p)
	}
	return p, nil
}

// validate reports every problem of config at once.
func validate(config kafka.PublisherConfig) error {
	var errs []error
	if len(config.Brokers) == 0 {
		errs = append(errs, errors.New("the broker list (Brokers) is empty"))
	}
	if config.Marshaler == nil {
		errs = append(errs, errors.New("no marshaler (Marshaler): kafka.DefaultMarshaler{} is watermill-kafka's"))
	}
	if !config.OverwriteSaramaConfig.Producer.Return.Successes {
		errs = append(errs, errors.New("OverwriteSaramaConfig.Producer.Return.Successes must be true for a SyncProducer"))
	}
	return errors.Join(errs...)
}

// Publish marshals msgs for topic and sends them in one batch, then waits
// until the broker acked or refused each one. It returns nil only when every
// message was acked. A topic name Kafka cannot hold (see validTopic) sends
// nothing, with an error wrapping inbox.ErrMessageRejected. When the
// marshaler refuses a message, or the broker refuses some, the error says
// each message's outcome with an *inbox.PublishError (errors.As): the
// relay then deletes the acked ones and keeps the rest. Each refused message's own error there wraps
// inbox.ErrMessageRejected when the refusal is of the message itself (the
// marshaler's, over the size limits, a record the broker finds corrupt or
// invalid), and inbox.ErrBrokerUnavailable otherwise: a partition that
// refuses its messages (no leader, a producer fenced or out of sequence, an
// error Kafka does not name) says nothing against them, and the relay sets
// none of them aside. The error also wraps sarama.ProducerErrors when the
// broker refused some, and as a whole wraps inbox.ErrBrokerUnavailable or
// inbox.ErrMessageRejected when every refusal is of that kind. Its text
// gives the reason of the first refused message. After Close it returns
// ErrPublisherClosed. Messages of one partition are written in the order of
// msgs.
func (p *Publisher) Publish(topic string, msgs ...*message.Message) error {
	if len(msgs) == 0 {
		return nil
	}
	if err := validTopic(topic); err != nil {
		return fmt.Errorf("%w: kafkaoutbox: %w", inbox.ErrMessageRejected, err)
	}
	errs := make([]error, len(msgs))
	batch := make([]*sarama.ProducerMessage, 0, len(msgs))
	index := make(map[*sarama.ProducerMessage]int, len(msgs)) // in msgs
	var hostStamped map[*sarama.ProducerMessage]bool          // no timestamp of their own: sarama stamps them
	for i, msg := range msgs {
		m, err := p.marshaler.Marshal(topic, msg)
		if err != nil {
			errs[i] = fmt.Errorf("%w: kafkaoutbox: cannot marshal message %s: %w", inbox.ErrMessageRejected, msg.UUID, err)
			continue
		}
		index[m] = i
		batch = append(batch, m)
		if m.Timestamp.IsZero() {
			if hostStamped == nil {
				hostStamped = make(map[*sarama.ProducerMessage]bool, len(msgs))
			}
			hostStamped[m] = true
		}
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return fmt.Errorf("%w: %w", inbox.ErrBrokerUnavailable, ErrPublisherClosed)
	}
	p.inFlight.Add(1)
	p.mu.Unlock()
	defer p.inFlight.Done()
	var sendErr error
	if len(batch) > 0 {
		if err := p.producer.SendMessages(batch); err != nil {
			var refused sarama.ProducerErrors
			if !errors.As(err, &refused) || len(refused) == 0 {
				return fmt.Errorf("kafkaoutbox: publish %d messages to %s: %w", len(msgs), topic, err)
			}
			// Kafka refuses a partition's record batch whole: when a message
			// with a timestamp of its own was refused for it, the ones sarama
			// stamped beside it may have been refused for it too.
			ownRefused := false
			for _, e := range refused {
				ownRefused = ownRefused || !hostStamped[e.Msg] && errors.Is(e.Err, sarama.ErrInvalidTimestamp)
			}
			for _, e := range refused {
				i, ok := index[e.Msg]
				if !ok { // not one of this call's: say nothing of each
					return fmt.Errorf("kafkaoutbox: publish %d messages to %s: %w", len(msgs), topic, err)
				}
				errs[i] = p.refusal(e, msgs[i].UUID, hostStamped[e.Msg], ownRefused)
			}
			sendErr = err
		}
	}
	return publishError(topic, errs, sendErr)
}

// refusal is the error of a message the broker refused with e: wrapping
// inbox.ErrMessageRejected when e is of the message itself, and
// inbox.ErrBrokerUnavailable for every other refusal. An invalid timestamp
// is the message's own when the marshaler gave it one; when sarama stamped
// it (hostStamped: kafka.DefaultMarshaler sets none) it is this host's
// clock against the broker's and the topic's message.timestamp.*.max.ms,
// which a clock that ran off (NTP down, a VM resumed) fails for every
// message: set aside, the whole outbox went to the dead-letter table.
//
// ownRefused says that a message of the call with a timestamp of its own was
// refused for it: Kafka refuses a partition's record batch whole, so a
// message sarama stamped beside it may be refused for the other's
// timestamp, and its refusal says neither (the relay then tries it alone,
// and the one with the refused timestamp is set aside once it used its
// attempts). Taken for the clock, it ended the relay's walk before the
// other was tried alone, and the partition never moved again.
func (p *Publisher) refusal(e *sarama.ProducerError, uuid string, hostStamped, ownRefused bool) error {
	err := fmt.Errorf("kafkaoutbox: message %s not acked: %w", uuid, e.Err)
	if hostStamped && errors.Is(e.Err, sarama.ErrInvalidTimestamp) {
		if ownRefused {
			return fmt.Errorf("%w (its record batch held a message whose own timestamp the topic refused)", err)
		}
		return fmt.Errorf("%w: %w (the timestamp sarama gave it from this host's clock: check the clock against the broker's)",
			inbox.ErrBrokerUnavailable, err)
	}
	if oneOf(e.Err, rejected) || e.Msg.ByteSize(p.recordVersion) > p.maxMessageBytes {
		return fmt.Errorf("%w: %w", inbox.ErrMessageRejected, err)
	}
	return fmt.Errorf("%w: %w", inbox.ErrBrokerUnavailable, err)
}

// publishError is the error of a call whose messages' outcomes are errs
// (nil: acked), sendErr sarama's error when the broker refused some; nil
// when every message was acked.
func publishError(topic string, errs []error, sendErr error) error {
	var first error
	refused, unavailable, rejected := 0, 0, 0
	for _, err := range errs {
		switch {
		case err == nil:
			continue
		case first == nil:
			first = err
		}
		refused++
		switch {
		case errors.Is(err, inbox.ErrBrokerUnavailable):
			unavailable++
		case errors.Is(err, inbox.ErrMessageRejected):
			rejected++
		}
	}
	if refused == 0 {
		return nil
	}
	err := fmt.Errorf("kafkaoutbox: %d of %d messages to %s not acked (the first: %w)", refused, len(errs), topic, first)
	err = fmt.Errorf("%w%w", err, &inbox.PublishError{MessageErrors: errs})
	if sendErr != nil {
		err = fmt.Errorf("%w%w", err, sendErr)
	}
	switch refused {
	case unavailable:
		err = fmt.Errorf("%w: %w", inbox.ErrBrokerUnavailable, err)
	case rejected:
		err = fmt.Errorf("%w: %w", inbox.ErrMessageRejected, err)
	}
	return err
}

// validTopic reports a topic name that no Kafka cluster accepts (Kafka's
// Topic.validate: 1 to 249 characters of ASCII letters, digits, '.', '_'
// and '-', and not "." or ".."). sarama does not check: the cluster's
// metadata answer refuses it, and sarama's circuit breaker opens, which
// says unavailable, so the message would wait for good instead of being
// set aside.
func validTopic(topic string) error {
	if topic == "" || len(topic) > 249 || topic == "." || topic == ".." {
		return fmt.Errorf("topic name %q is not one Kafka accepts (1 to 249 characters, not \".\" or \"..\")", topic)
	}
	for _, c := range []byte(topic) {
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '.' || c == '_' || c == '-') {
			return fmt.Errorf("topic name %q is not one Kafka accepts (only ASCII letters, digits, '.', '_' and '-')", topic)
		}
	}
	return nil
}

// rejected are the errors that say the broker refuses the message itself,
// for good: over the producer's MaxMessageBytes or the broker's
// message.max.bytes (sarama's ErrMessageSizeTooLarge, for both), a record
// batch larger than the topic's segment.bytes (RECORD_LIST_TOO_LARGE,
// sarama's ErrMessageSetSizeTooLarge: Kafka does not retry it), a record
// the broker finds corrupt or invalid, a timestamp the marshaler set outside
// the topic's message.timestamp.*.max.ms (one sarama set from this host's
// clock is the clock's fault: ErrBrokerUnavailable), a topic name the broker refuses. A
// message refused with one of them is set aside by the relay once it used
// its attempts, without waiting for the next message of its topic
// (inbox.ErrMessageRejected). Every other refusal is taken as the broker's
// state (inbox.ErrBrokerUnavailable): Kafka's retriable errors, a partition
// whose producer is fenced or out of sequence, an authorization, an error
// code Kafka does not name, no connection, sarama's open circuit breaker.
var rejected = []error{sarama.ErrMessageSizeTooLarge, sarama.ErrMessageSetSizeTooLarge, sarama.ErrInvalidMessage,
	sarama.ErrInvalidRecord, sarama.ErrInvalidTimestamp, sarama.ErrInvalidTopic}

// oneOf reports whether err is one of kinds (errors.Is).
func oneOf(err error, kinds []error) bool {
	return slices.ContainsFunc(kinds, func(k error) bool { return errors.Is(err, k) })
}

// Close makes later Publish calls fail with ErrPublisherClosed, waits for
// the calls in progress, then closes the producer. When that takes longer
// than the close timeout (a broker that does not answer: sarama waits for
// it up to Net.ReadTimeout on every retry), Close returns an error wrapping
// ErrCloseTimedOut and lets them end in the background. It is safe to call
// more than once; later calls return nil.
func (p *Publisher) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	p.mu.Unlock()
	done := make(chan error, 1)
	go func() {
		p.inFlight.Wait()
		done <- p.producer.Close()
	}()
	timeout := time.NewTimer(p.closeTimeout)
	defer timeout.Stop()
	select {
	case err := <-done:
		if err != nil {
			return fmt.Errorf("kafkaoutbox: close the Kafka producer: %w", err)
		}
		return nil
	case <-timeout.C:
		return fmt.Errorf("%w after %s: the broker has not answered the messages in flight (the relay sends them again)",
			ErrCloseTimedOut, p.closeTimeout)
	}
}
