package inbox

import (
	"fmt"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Metadata keys under which other producers' message ids commonly arrive in
// a Watermill message, for MessageIDFromMetadata.
const (
	// NATSMsgIDHeader is the JetStream de-duplication header that NATS
	// producers set (nats.MsgId, jetstream.WithMsgID). watermill-nats v2's
	// NATSMarshaler copies the other NATS headers into the message metadata
	// but drops this one: the wrapping unmarshaler in docs/brokers.md puts it
	// back under this key.
	NATSMsgIDHeader = "Nats-Msg-Id"

	// AMQPMessageIDKey is the metadata key under which the marshaler shown
	// in docs/brokers.md puts the AMQP message-id property: watermill-amqp's DefaultMarshaler does not map
	// that property, only its own "_watermill_message_uuid" header.
	AMQPMessageIDKey = "amqp_message_id"
)

// MessageIDFromMetadata returns a Config.MessageID that takes the message
// id from the message metadata: the value of the first of keys that is set
// and not empty. Use it for messages from producers that are not Watermill
// (which carry no Watermill UUID) and put an id of the event in a header: a
// Kafka header (watermill-kafka copies every header into the metadata),
// or NATSMsgIDHeader or AMQPMessageIDKey with the marshalers in
// docs/brokers.md.
//
// A message that carries none of keys gets an error wrapping
// ErrInvalidMessageID and ErrEmptyMessageID, which names the keys (quoted);
// the handler is not called and nothing is written. Such a message can never
// succeed: route it to a poison queue (docs/errors.md) so that it does not
// spin between the broker and the router. The returned function is safe for
// concurrent use. It panics if keys is empty: that is a programming error
// caught when the Config is built.
func MessageIDFromMetadata(keys ...string) func(*message.Message) (string, error) {
	if len(keys) == 0 {
		panic("inbox: MessageIDFromMetadata needs at least one metadata key")
	}
	keys = append([]string(nil), keys...)
	return func(msg *message.Message) (string, error) {
		for _, k := range keys {
			if v := msg.Metadata.Get(k); v != "" {
				return v, nil
			}
		}
		return "", &wrapped{msg: ErrInvalidMessageID.Error(), also: ErrInvalidMessageID,
			err: fmt.Errorf("%w: no metadata %s", ErrEmptyMessageID, quotedList(keys))}
	}
}

// MessageIDFromMetadataOrUUID is MessageIDFromMetadata falling back to the
// Watermill message UUID when none of keys is set: for a consumer that reads
// both Watermill producers (the UUID travels in "_watermill_message_uuid")
// and others (an id in a header). The two id spaces must not overlap: a
// header value equal to another message's UUID is the same key. A message
// with neither is refused as MessageIDFromMetadata refuses it.
func MessageIDFromMetadataOrUUID(keys ...string) func(*message.Message) (string, error) {
	fromMetadata := MessageIDFromMetadata(keys...)
	return func(msg *message.Message) (string, error) {
		id, err := fromMetadata(msg)
		if err == nil {
			return id, nil
		}
		if msg.UUID != "" {
			return msg.UUID, nil
		}
		return "", fmt.Errorf("%w (and no message UUID)", err)
	}
}

func quotedList(keys []string) string {
	q := make([]string, len(keys))
	for i, k := range keys {
		q[i] = fmt.Sprintf("%q", k)
	}
	return strings.Join(q, " or ")
}
