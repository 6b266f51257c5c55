// Package kafkaoutbox is the Kafka publisher for the outbox relay
// (inbox.Outbox): a drop-in for watermill-kafka's kafka.NewPublisher, with
// the same kafka.PublisherConfig and marshalers, that sends all the messages
// of one Publish call together and waits for the broker's acks once.
//
//	pub, err := kafkaoutbox.NewPublisher(kafka.PublisherConfig{Brokers: brokers, Marshaler: kafka.DefaultMarshaler{}}, logger)
//	...
//	ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Publisher: pub})
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
// Publish returns nil only once the broker acked every message; otherwise
// it returns an error (sarama.ProducerErrors is reachable with errors.As)
// and the relay keeps the rows and sends them again, with their UUIDs: at
// least once. The default sarama configuration is watermill-kafka's
// (kafka.DefaultSaramaSyncPublisherConfig) made safe for an outbox, whose
// relay deletes a row once Publish returned nil:
//   - RequiredAcks WaitForAll: a message acked by the leader alone is lost
//     if the leader fails before a follower copied it, after its row is
//     gone (Kafka's acks=all; keep the topics' min.insync.replicas at 2 or
//     more);
//   - the idempotent producer with Net.MaxOpenRequests 1: a produce request
//     the client retries cannot be overtaken by a later one, so a
//     partition's messages keep the order the relay published them in, and
//     a retry does not write a message twice (Kafka's enable.idempotence).
//
// A configuration passed in kafka.PublisherConfig.OverwriteSaramaConfig is
// used as given; NewPublisher logs a warning when it weakens either
// setting.
//
// It is a package of its own so that the inbox core package does not import
// watermill-kafka.
package kafkaoutbox

import (
	"errors"
	"fmt"
	"sync"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
)

// ErrPublisherClosed is returned by Publish after Close.
var ErrPublisherClosed = errors.New("kafkaoutbox: publisher closed")

// Publisher publishes Watermill messages to Kafka, all the messages of one
// Publish call in one batch. It implements message.Publisher and is safe
// for concurrent use.
type Publisher struct {
	producer  sarama.SyncProducer
	marshaler kafka.Marshaler

	mu     sync.RWMutex // Publish holds it shared, Close exclusively
	closed bool
}

// DefaultSaramaConfig returns the sarama configuration NewPublisher uses
// when config.OverwriteSaramaConfig is nil: watermill-kafka's
// kafka.DefaultSaramaSyncPublisherConfig (Kafka 1.0 protocol, 10 retries,
// client id "watermill") with RequiredAcks WaitForAll, the idempotent
// producer and Net.MaxOpenRequests 1 (see the package documentation).
// Start from it to change other settings.
func DefaultSaramaConfig() *sarama.Config {
	cfg := kafka.DefaultSaramaSyncPublisherConfig()
	cfg.Producer.RequiredAcks = sarama.WaitForAll
	cfg.Producer.Idempotent = true
	cfg.Net.MaxOpenRequests = 1
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
func NewPublisher(config kafka.PublisherConfig, logger watermill.LoggerAdapter) (*Publisher, error) {
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	if config.OverwriteSaramaConfig == nil {
		config.OverwriteSaramaConfig = DefaultSaramaConfig()
	}
	if err := validate(config); err != nil {
		return nil, fmt.Errorf("%w: kafkaoutbox: %w", inbox.ErrInvalidConfig, err)
	}
	if p := config.OverwriteSaramaConfig.Producer; p.RequiredAcks != sarama.WaitForAll || (!p.Idempotent && config.OverwriteSaramaConfig.Net.MaxOpenRequests > 1) {
		logger.Info("kafkaoutbox: the sarama configuration weakens the outbox's guarantees: without "+
			"RequiredAcks WaitForAll a leader failure can lose relayed messages; without Idempotent "+
			"or Net.MaxOpenRequests 1 a retried request can reorder a partition's messages", watermill.LogFields{
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
	return &Publisher{producer: producer, marshaler: config.Marshaler}, nil
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
// message was acked; a marshaling error sends nothing; when the broker
// refused some, the error wraps sarama.ProducerErrors (the others may have
// been written: a relay sends them all again, at least once). After Close
// it returns ErrPublisherClosed. Messages of one partition are written in
// the order of msgs.
func (p *Publisher) Publish(topic string, msgs ...*message.Message) error {
	if len(msgs) == 0 {
		return nil
	}
	batch := make([]*sarama.ProducerMessage, len(msgs))
	for i, msg := range msgs {
		m, err := p.marshaler.Marshal(topic, msg)
		if err != nil {
			return fmt.Errorf("kafkaoutbox: cannot marshal message %s: %w", msg.UUID, err)
		}
		batch[i] = m
	}
	p.mu.RLock()
	defer p.mu.RUnlock()
	if p.closed {
		return ErrPublisherClosed
	}
	if err := p.producer.SendMessages(batch); err != nil {
		var refused sarama.ProducerErrors
		if errors.As(err, &refused) && len(refused) > 0 {
			return fmt.Errorf("kafkaoutbox: %d of %d messages to %s not acked (the first: %s): %w",
				len(refused), len(msgs), topic, refusedUUID(batch, msgs, refused[0]), err)
		}
		return fmt.Errorf("kafkaoutbox: publish %d messages to %s: %w", len(msgs), topic, err)
	}
	return nil
}

// refusedUUID is the UUID of the message the broker refused with e, for the
// error text.
func refusedUUID(batch []*sarama.ProducerMessage, msgs []*message.Message, e *sarama.ProducerError) string {
	for i, m := range batch {
		if m == e.Msg {
			return msgs[i].UUID
		}
	}
	return "unknown"
}

// Close waits for the Publish calls in progress, then closes the producer.
// It is safe to call more than once; later calls return nil.
func (p *Publisher) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	p.closed = true
	if err := p.producer.Close(); err != nil {
		return fmt.Errorf("kafkaoutbox: close the Kafka producer: %w", err)
	}
	return nil
}
