package inbox_test

import "testing"

// With watermill-sql v4 on database/sql (TxFromStdSQL for the outbox
// publisher, BeginnerFromStdSQL for the forwarder's subscriber), the
// messages a handler returns and those it publishes through
// OutboxFromContext reach the broker if and only if the inbox transaction
// commits: a handler error, a panic or a failed COMMIT forwards nothing,
// a success forwards each message exactly once, and a duplicate delivery
// forwards nothing again. On PostgreSQL and MariaDB, through a real router
// and Watermill's forwarder.
func TestOutboxV4PublishesIffCommitted(t *testing.T) {
	testOutboxPublishesIffCommitted(t, outboxV4)
}
