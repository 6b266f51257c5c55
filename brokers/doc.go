// Package brokers holds the inbox's end-to-end tests on real brokers:
// RabbitMQ (watermill-amqp v3) and NATS JetStream (watermill-nats v2), with
// the inbox on PostgreSQL. It has no code of its own; docs/brokers.md shows
// the marshalers and configuration these tests run, and
// TestDocs_snippetsAreTestCode keeps the two in step.
//
// TestRabbitMQ_effectsExactlyOnce and TestNATSJetStream_effectsExactlyOnce
// run worker processes (the test binary re-run with INBOX_BROKERS_WORKER
// set). Each is a Watermill router with middleware.Recoverer, a poison queue
// for inbox.ErrInvalidMessageID, the inbox, and a handler that inserts one
// business row per message id through inbox.TxFromContext. The business
// table's primary key is the message id, so a second effect of a message
// fails loudly. The test publishes:
//   - 300 messages with Watermill's publisher, and 30 of them a second time
//     with the same UUID, later in the stream (an outbox relay's retry);
//   - 20 messages from a producer that is not Watermill (amqp091-go with the
//     AMQP message-id property, or nats.go with the Nats-Msg-Id header), each
//     again: on RabbitMQ later in the stream; on JetStream at once (the
//     server drops that copy) and after the stream's duplicate window;
//   - one such message with no id at all, which must go to the poison queue
//     once instead of spinning.
//
// Two workers run at a time. Two of them SIGKILL themselves right after the
// commit of a message and before its ack (from an inbox.AfterCommit
// function), so the broker redelivers a committed message to another
// worker; the test starts a replacement. At the end, every message published
// has exactly one business row and one inbox row and nothing else has one,
// every message was committed once, the inbox skipped each further copy and
// each redelivery of a committed message, and every worker stopped cleanly
// with no database connection in use.
//
// TestRabbitMQ_refusedMessageSpinsWithoutPoisonQueue and
// TestNATSJetStream_nakDelayBoundsRedelivery measure what happens without
// the poison queue: how often each broker hands a refused message back.
//
//	cd brokers && go test -race -count=1 ./...
//
// A broker or PostgreSQL that cannot be reached skips its test locally and
// fails it when CI=true. INBOX_TEST_AMQP_URL, INBOX_TEST_NATS_URL and
// INBOX_TEST_POSTGRES_DSN point the tests at other servers.
package brokers
