//go:build unix

package brokers

import (
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/watermill-inbox/inbox"
)

// The two marshalers below are the ones docs/brokers.md shows: keep them in
// step.

// AMQPMarshaler is watermill-amqp's DefaultMarshaler that also puts the
// AMQP message-id property, which DefaultMarshaler does not map, into the
// metadata under inbox.AMQPMessageIDKey.
type AMQPMarshaler struct {
	amqp.DefaultMarshaler
}

func (m AMQPMarshaler) Unmarshal(d amqp091.Delivery) (*message.Message, error) {
	msg, err := m.DefaultMarshaler.Unmarshal(d)
	if err != nil {
		return nil, err
	}
	if d.MessageId != "" {
		msg.Metadata.Set(inbox.AMQPMessageIDKey, d.MessageId)
	}
	return msg, nil
}

// NATSMarshaler is watermill-nats's NATSMarshaler that keeps the
// Nats-Msg-Id header, which NATSMarshaler drops, in the metadata under
// inbox.NATSMsgIDHeader.
type NATSMarshaler struct {
	wmnats.NATSMarshaler
}

func (m *NATSMarshaler) Unmarshal(nm *nats.Msg) (*message.Message, error) {
	msg, err := m.NATSMarshaler.Unmarshal(nm)
	if err != nil {
		return nil, err
	}
	if id := nm.Header.Get(nats.MsgIdHdr); id != "" {
		msg.Metadata.Set(inbox.NATSMsgIDHeader, id)
	}
	return msg, nil
}
