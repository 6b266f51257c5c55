package inbox

import (
	"errors"
	"fmt"
	"strings"
)

// MaxKeyLength is the longest consumer name or message id, in bytes, that the
// inbox stores. It matches the width of the consumer and message_id columns
// (varbinary(255) on MySQL/MariaDB); longer keys are refused, never truncated,
// because a truncated key could collide with another message's key.
const MaxKeyLength = 255

// Sentinel errors. Match them with errors.Is; the returned errors wrap them
// with details (the offending value, the failed operation).
var (
	// ErrInvalidConfig is wrapped by the error New and Purge return when the
	// configuration is invalid. The same error also wraps every individual
	// problem found (joined with errors.Join), so errors.Is matches those too,
	// for example ErrInvalidTableName.
	ErrInvalidConfig = errors.New("inbox: invalid config")

	// ErrInvalidTableName means a table name does not match the allowed
	// pattern: one or two dot-separated identifiers, each starting with a
	// letter or underscore, followed by at most 62 letters, digits or
	// underscores. Names are never accepted pre-quoted.
	ErrInvalidTableName = errors.New("inbox: invalid table name")

	// ErrUnknownDialect means Config.Dialect was nil and the DB's driver name
	// is not one the inbox recognises. Set Config.Dialect explicitly.
	ErrUnknownDialect = errors.New("inbox: unknown SQL dialect")

	// ErrInvalidMessageID is wrapped by every error about a message id the
	// inbox refuses: empty, longer than MaxKeyLength bytes, not valid UTF-8,
	// or containing a NUL byte (which PostgreSQL text cannot store). When it
	// is returned, the handler was not called and nothing was written; the
	// router nacks the message. Route such messages to a poison queue with
	// middleware.PoisonQueueWithFilter and errors.Is(err, ErrInvalidMessageID).
	ErrInvalidMessageID = errors.New("inbox: invalid message id")

	// ErrEmptyMessageID is wrapped, together with ErrInvalidMessageID, when
	// the message id is the empty string.
	ErrEmptyMessageID = errors.New("inbox: empty message id")

	// ErrMessageIDTooLong is wrapped, together with ErrInvalidMessageID, when
	// the message id is longer than MaxKeyLength bytes.
	ErrMessageIDTooLong = errors.New("inbox: message id too long")

	// ErrMessageIDReused is wrapped by the error of a delivery whose message
	// id was already processed with other content (a producer that reuses
	// an id for a different event): the stored fingerprint of the content
	// (Config.Fingerprint) differs from the delivery's. The handler was not
	// called and nothing was written; the router nacks, and IsTransient
	// reports false, so a poison queue filter (middleware.PoisonQueueWithFilter
	// with errors.Is) can take the message instead of retrying it forever.
	// With Config.ReusedIDs set to ReusedIDsWarn the delivery is skipped as
	// a duplicate instead, and nothing wraps this error.
	ErrMessageIDReused = errors.New("inbox: message id reused for other content")

	// ErrInvalidConsumer is wrapped by every error about a consumer name the
	// inbox refuses: empty, longer than MaxKeyLength bytes, not valid UTF-8 or
	// containing a NUL byte. A configured Config.Consumer is checked in New;
	// a handler name taken from the message context is checked per message.
	ErrInvalidConsumer = errors.New("inbox: invalid consumer")

	// ErrEmptyConsumer is wrapped, together with ErrInvalidConsumer, when no
	// consumer name is configured and the message context carries no
	// Watermill handler name (the middleware was called outside a router).
	// An empty consumer is never used as a shared key.
	ErrEmptyConsumer = errors.New("inbox: empty consumer")

	// ErrWindowTooShort means a purge was asked to delete rows younger than
	// the safe window its PurgeConfig.Window reported: the broker could still
	// redeliver their messages, which would then be processed again. Nothing
	// was deleted.
	ErrWindowTooShort = errors.New("inbox: purge window shorter than the broker can redeliver")

	// ErrWindowOutOfRange means a PurgeConfig.Window (or the window given to
	// DropPartitions) reported a safe window below 1µs (zero, negative) or
	// above MaxSafeWindow: a broken or overflowing WindowSource, whose window
	// cannot be trusted to keep the rows of messages the broker still holds.
	// The purge stopped before deleting anything. A source whose broker keeps
	// messages without a time limit must return an error instead (as
	// kafkaretention.ErrNoSafeWindow and jetstreamretention.ErrNoSafeWindow).
	ErrWindowOutOfRange = errors.New("inbox: window source reported a safe window out of range")

	// ErrNestedInbox means the message context already carries an inbox
	// transaction: an inbox middleware runs inside another (for example
	// added both to the router and to the handler). The inner claim would
	// otherwise wait forever on the outer transaction's row. Add the
	// middleware once. The delivery's error is transient (a setup mistake,
	// as a missing table: a poison filter drained the topic with it), after
	// a wait of 100 ms doubling to 5 s.
	ErrNestedInbox = errors.New("inbox: inbox middleware nested inside another inbox middleware")

	// ErrTxRolledBack means that when the handler returned, the database had
	// already rolled the inbox transaction back, inbox row included, so there
	// was nothing to commit: on MySQL/MariaDB a deadlock (1213) or a
	// snapshot-isolation conflict (1020) ends the whole transaction, and a
	// handler that ignores that error runs its later statements outside any
	// transaction (they are kept). The message is nacked, and its redelivery
	// processes it. IsTransient reports true. SQLite rolls a transaction
	// back by itself too (a full disk, an interrupted statement, a
	// constraint declared ON CONFLICT ROLLBACK): its COMMIT then finds no
	// transaction and the inbox reads the claim, gone, which is this error.
	// (PostgreSQL reports an error of the transaction at COMMIT, with its
	// own error.) A handler's ROLLBACK statement on MySQL/MariaDB and SQLite
	// removes the inbox row in the same way and cannot be told apart from
	// it: it is reported with this error too, and so is an outbox write or
	// publish refused there for a claim gone (on PostgreSQL that refusal is
	// ErrTransactionEnded).
	ErrTxRolledBack = errors.New("inbox: the database rolled the transaction back before the commit")

	// ErrUnexpectedRowsAffected means the claim statement reported a number
	// of affected rows that the dialect cannot produce for an insert of one
	// row. The transaction is rolled back and the message nacked.
	ErrUnexpectedRowsAffected = errors.New("inbox: unexpected rows affected by claim")
)

// Errors about the inbox table itself, from Inbox.Verify, InitializeSchema,
// the middleware's check of the table before its first claim, and
// Inbox.RouterPlugin. Neither is transient (IsTransient): a redelivery cannot
// succeed until the table is created or fixed.
var (
	// ErrTableNotFound means the inbox table (or, from Outbox.Verify, an
	// outbox table) does not exist: run InitializeSchema, apply the DDL of
	// schema/ (SchemaSQL), or fix Config.Table.
	ErrTableNotFound = errors.New("inbox: table not found")

	// ErrIncompatibleTable means the inbox table exists but could merge,
	// truncate or reject message ids, or lacks what the claim or the purge
	// relies on: a key column that compares other than byte for byte (a
	// case- or accent-insensitive or PAD SPACE collation, citext, a
	// nondeterministic collation, a NOCASE or RTRIM collation) or is
	// narrower than MaxKeyLength bytes, a primary key other than
	// (consumer, message_id), a processed_at of another type, or no purge
	// index. The error names every problem found and the DDL that fixes it.
	// A claim into a PostgreSQLPartitioned table that has no partition for
	// the database's current time wraps it too (create partitions ahead); at
	// message time such errors are transient.
	ErrIncompatibleTable = errors.New("inbox: inbox table incompatible")
)

// ErrDialectMismatch means the dialect (Config.Dialect, or the one inferred
// from DB's driver name) is for another database server than the one DB
// reaches: a PostgreSQL database opened under the driver name "mysql", or
// Config.Dialect MySQL on SQLite. Its statements would fail there with
// syntax errors. The error names the dialect, the server found and the
// configuration that fixes it. Inbox.Verify, Inbox.RouterPlugin,
// InitializeSchema and the middleware's first message check it (once per
// Inbox). It is not transient (IsTransient): no redelivery can succeed.
var ErrDialectMismatch = errors.New("inbox: dialect does not match the database server")

// ErrDatabaseReadOnly means that the database refuses the inbox's writes:
// DB reaches a replica (a hot standby on PostgreSQL, a read_only MySQL
// server), a primary being demoted in a failover, or sessions that are
// read-only (PostgreSQL's default_transaction_read_only, MySQL's
// transaction_read_only, SQLite's query_only or a file opened read-only).
// Inbox.Verify finds it with a statement that writes nothing, in a
// transaction it rolls back; Inbox.RouterPlugin waits for writes within
// VerifyTimeout (a failover in progress) and then returns it. A claim the
// database refuses so wraps it too: that message is nacked after a wait,
// and IsTransient reports true for it, so that a poison queue filter keeps
// the topic until the database takes writes again.
var ErrDatabaseReadOnly = errors.New("inbox: the database refuses writes")

// ErrCommitTimeout means that what runs after the handler returned nil (the
// outbox publish, the pre-commit check, COMMIT) did not finish within
// Config.CommitTimeout. Whether the transaction committed is unknown (in
// doubt): the message is nacked, and its redelivery processes it if the
// transaction rolled back or skips it as a duplicate if it committed.
// IsTransient reports true.
var ErrCommitTimeout = errors.New("inbox: commit timed out")

// ErrTransactionEnded means that the handler ended the inbox transaction
// itself before returning nil: it committed or rolled it back (tx.Commit,
// tx.Rollback, a COMMIT or ROLLBACK statement run through it) or, on
// MySQL/MariaDB, ran a statement that commits implicitly (DDL such as
// CREATE TABLE or ALTER TABLE, LOCK TABLES). The inbox row and the handler's
// writes were then not committed together, or not at all, so the message is
// nacked instead of acked. Fix the handler: let the inbox commit, return an
// error to roll back, and run DDL outside the handler. IsTransient reports
// false: a redelivery runs the same handler. Whatever the handler committed
// stays committed; if that included the inbox row, the redelivery is skipped
// as a duplicate. An outbox write or publish after the handler's end fails
// with it too (on PostgreSQL also after its ROLLBACK statement, as at the
// COMMIT), and writes nothing; on SQLite, whose driver reports no
// transaction status, one after the handler's COMMIT finds the claim
// committed and is written on its own, once, and relayed, as the handler's
// committed work is kept.
//
// It is detected before COMMIT from the transaction status the server sent
// with its last response (no round trip): with pgxinbox, and with
// database/sql on pgx's stdlib, lib/pq, go-sql-driver/mysql and
// mattn/go-sqlite3, also wrapped by an instrumentation driver that keeps
// the driver.Conn it wraps in an exported field (XSAM/otelsql, DataDog's
// sqltrace, sqlhooks); on modernc.org/sqlite from the COMMIT that SQLite
// refuses. Through a wrapper that hides it (ngrok/sqlmw, instrumentedsql)
// the inbox reads its claim on PostgreSQL before COMMIT and before each
// outbox write (one round trip more each, logged once at Info). On MySQL/MariaDB a ROLLBACK statement (which removed the inbox
// row) looks exactly like a deadlock the handler ignored and is reported as
// ErrTxRolledBack; tx.Rollback is ErrTransactionEnded there too. Not
// detected: a handler that ends the transaction and begins another before
// it returns, on PostgreSQL ("ROLLBACK; BEGIN" or "COMMIT; BEGIN" in one
// statement or two, ROLLBACK AND CHAIN) and on SQLite (ROLLBACK, then BEGIN
// or SAVEPOINT), since the server then reports a transaction open again;
// the inbox commits that new transaction and acks, with the claim rolled
// back or committed apart from what follows (after a ROLLBACK the
// redelivery runs the handler again). Nor on MySQL/MariaDB when, between
// the handler's ROLLBACK and its START TRANSACTION, another delivery of the
// same message committed the claim. Catching these would cost every
// message a claim check tied to its own transaction before COMMIT.
var ErrTransactionEnded = errors.New("inbox: the handler ended the inbox transaction itself " +
	"(COMMIT, ROLLBACK, tx.Commit, tx.Rollback, or a statement that commits implicitly, such as DDL on MySQL): " +
	"return nil to commit or an error to roll back, and leave the transaction to the inbox")

// ErrNoTx is wrapped by the error MissingTxError (and pgxinbox.MissingTxError)
// returns when a handler finds no inbox transaction of the kind it asks for
// in the message context: the inbox middleware is not around the handler,
// the handler did not use msg.Context(), or the message was claimed by the
// other backend (package pgxinbox gives a pgx.Tx, this package a *sqlx.Tx).
// IsTransient reports true: nothing about the message is wrong, and a poison
// filter (!IsTransient) drained the whole topic with it; behind the inbox
// middleware the delivery waits before its nack (100 ms doubling to 5 s), so
// that a broker that redelivers at once does not spin, and Retry does not
// retry it in place.
var ErrNoTx = errors.New("inbox: no inbox transaction in the message context")

// ErrNoOutbox means that ContextOutbox was asked to publish a message whose
// context carries no inbox transaction with an outbox: it was published
// outside a claimed message's handler (or after it returned), or the inbox
// has no Config.Outbox. Nothing was published. IsTransient reports false.
var ErrNoOutbox = errors.New("inbox: no inbox outbox in the message context")

// ErrBrokerUnavailable is for an OutboxConfig.Publisher to wrap in its
// error when the broker could not take the messages now (no leader for
// the partition, a timeout, no connection), as opposed to refusing a
// message for what it is (too large, not valid). The outbox relay never
// sets aside a message whose last attempt failed with it, and such a
// refusal uses none of the message's attempts (OutboxConfig.MaxAttempts):
// it stays first in line for its topic until the broker takes it.
// kafkaoutbox's Publisher wraps it for every refusal that is not of the
// message itself: Kafka's retriable errors, a fenced or out-of-sequence
// producer, an authorization, an error code Kafka does not name, sarama's
// open circuit breaker and a closed publisher.
var ErrBrokerUnavailable = errors.New("inbox: the broker cannot take the message now")

// ErrMessageRejected is for an OutboxConfig.Publisher to wrap in its error
// when the broker refuses a message for what it is and always will (too
// large for the broker, not valid for it) or the publisher cannot encode
// it. The outbox relay sets such a message aside once it used its
// MaxAttempts, without waiting for the next message of its topic to go
// through: two such messages in a row would otherwise hold their topic
// back for good. kafkaoutbox's Publisher wraps it for messages over the
// producer's or the broker's size limit, records the broker finds
// corrupt or invalid, timestamps the topic refuses, topic names Kafka
// cannot hold, and messages its marshaler refuses.
var ErrMessageRejected = errors.New("inbox: the broker refuses the message")

// PublishError is for an OutboxConfig.Publisher to return from Publish,
// itself or wrapped (the relay finds it with errors.As), when the broker
// refused some or all of the call's messages and the publisher knows
// which: MessageErrors holds one entry per message of the call, in
// the call's order, nil for a message the broker acked.
//
// The outbox relay then deletes the rows of the acked messages, wherever
// they stand, and keeps the refused ones first in line, each with its own
// error taken as a whole call's would be (wrapping ErrBrokerUnavailable: no
// attempt used; ErrMessageRejected: set aside on its last attempt; neither:
// an attempt used, and on its last one set aside only once a message
// behind the call's goes through alone), instead of sending the whole call again: a broker that
// refuses one partition's messages neither holds back nor sends again the
// messages of its other partitions, and those are no evidence against a
// refused one. When several were refused, the relay publishes each alone
// in the same round unless its refusal wraps ErrBrokerUnavailable (a Kafka
// partition's batch is written or refused whole, so a message may have
// been refused for another one of its request); one refused alone for
// what it is (ErrMessageRejected) holds back none of the call's other
// refused messages. A message refused with ErrBrokerUnavailable is not
// tried again in the same round, even when the whole call was refused
// (kafkaoutbox: each try of a partition without a leader waits for
// sarama's retries, about 13 s). A PublishError without one entry per
// message, or without a non-nil entry, is taken as a refusal of the whole
// call. kafkaoutbox's Publisher returns one whenever the broker refused
// some of a call's messages.
//
// Its Error text counts the refused messages and gives the first one's
// error; it does not unwrap to them: errors.Is on a call's error says what
// the publisher says of the call as a whole.
type PublishError struct {
	MessageErrors []error
}

func (e *PublishError) Error() string {
	refused, first := 0, error(nil)
	for _, err := range e.MessageErrors {
		if err != nil {
			refused++
			if first == nil {
				first = err
			}
		}
	}
	if first == nil {
		return fmt.Sprintf("inbox: none of %d messages refused", len(e.MessageErrors))
	}
	return fmt.Sprintf("inbox: %d of %d messages refused, the first: %v", refused, len(e.MessageErrors), first)
}

// prefix starts the text of every error of this package.
const prefix = "inbox: "

// wrapped is the error "<msg>: <err>" without a second "inbox: ": err's
// own prefix is dropped, on each of its lines (errors.Join puts one problem
// per line). It wraps also (a sentinel; may be nil) and err, so errors.Is
// and errors.As reach both.
type wrapped struct {
	msg  string
	also error
	err  error
}

func (e *wrapped) Error() string {
	lines := strings.Split(e.err.Error(), "\n")
	for i, l := range lines {
		lines[i] = strings.TrimPrefix(l, prefix)
	}
	return e.msg + ": " + strings.Join(lines, "\n")
}

func (e *wrapped) Unwrap() []error {
	if e.also == nil {
		return []error{e.err}
	}
	return []error{e.also, e.err}
}

// invalidConfig is the error of New, Purge and NewPurger for the problems
// Validate found: "inbox: invalid config: <problem>", one problem per line,
// wrapping ErrInvalidConfig and every problem (and so its sentinel).
func invalidConfig(problems error) error {
	return &wrapped{msg: ErrInvalidConfig.Error(), also: ErrInvalidConfig, err: problems}
}

// claimGoneError is what a write or a publish refused because the
// transaction no longer holds the delivery's claim wraps, on a transaction
// of dialect d: the error the same handler's delivery gets at the COMMIT
// when it writes no output. PostgreSQL never ends a transaction on its own
// (an error leaves it failed until the client ends it; a timeout closes
// the session), so there the claim is gone with the handler's ROLLBACK:
// ErrTransactionEnded, not transient, which a poison queue filter takes
// instead of a redelivery that rolls back again for ever. On MySQL/MariaDB
// (a deadlock or a lock wait timeout the handler ignored) and SQLite (a
// full disk, an interrupted statement, a constraint declared ON CONFLICT
// ROLLBACK) the database rolls back by itself, which the handler's ROLLBACK
// looks the same as: ErrTxRolledBack, transient.
func claimGoneError(d Dialect) error {
	if d != nil && d.server() == serverPostgreSQL {
		return ErrTransactionEnded
	}
	return ErrTxRolledBack
}
