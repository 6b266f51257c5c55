// Package inbox is the transactional inbox pattern (idempotent consumer) as a
// Watermill router middleware on PostgreSQL, MySQL/MariaDB and SQLite: a
// message delivered twice, ten times, or to two workers at the same moment
// changes the database exactly once.
//
// Brokers deliver at least once: a producer's outbox relay retries, a worker
// commits and dies before it acks, a consumer group rebalances, an operator
// rewinds a topic. The inbox keys each message by (consumer, message id) in
// a table whose primary key is exactly that pair, and claims the key in the
// same transaction as the handler's writes: both commit, or neither does.
// The database decides who wins; there is no check-then-insert race.
//
// This is the one description of the per-message flow; the README and the
// doc comments point here.
//
// # Usage
//
//	ib, err := inbox.New(inbox.Config{DB: db}) // db is a *sqlx.DB
//	if err != nil { ... }
//	if err := ib.InitializeSchema(ctx); err != nil { ... }
//	router.AddPlugin(ib.RouterPlugin) // router.Run fails if the table is missing or unsafe
//	mws, err := ib.Middlewares(inbox.MiddlewaresConfig{}) // Retry, Timeout, Recoverer, the inbox last
//	if err != nil { ... }
//	router.AddMiddleware(mws...)
//
//	func handle(msg *message.Message) error {
//		tx, ok := inbox.TxFromContext(msg.Context())
//		if !ok {
//			return inbox.MissingTxError(msg.Context()) // wraps ErrNoTx, says what is missing
//		}
//		_, err := tx.ExecContext(msg.Context(), tx.Rebind("INSERT INTO invoices (order_id) VALUES (?)"), id)
//		return err
//	}
//
// A *sql.DB is wrapped with sqlx.NewDb(db, "pgx") (or "postgres", "mysql",
// "sqlite": the name sets the dialect); a pgx pool with
// sqlx.NewDb(stdlib.OpenDBFromPool(pool), "pgx").
//
// Rules for handlers:
//   - Write through the transaction from TxFromContext, with msg.Context();
//     never through Config.DB. Writes through the pool commit on their own
//     (kept when the handler fails, repeated by the redelivery), and a
//     handler that asks the pool for a connection while the messages in
//     flight hold them all waits forever: put middleware.Timeout outside
//     the inbox (Inbox.Middlewares does), whose error then says so.
//   - Return the errors of your statements: a deadlock or serialization
//     failure ends the whole transaction, and on MySQL/MariaDB the
//     statements after it run outside any transaction and are kept.
//   - Never end the transaction: no Commit or Rollback, no COMMIT or
//     ROLLBACK statement, no MySQL statement that commits implicitly (DDL,
//     LOCK TABLES). Return nil to commit, an error to roll back. A handler
//     that ends it and returns nil is nacked with ErrTransactionEnded (not
//     transient; on MySQL/MariaDB and SQLite a ROLLBACK is ErrTxRolledBack, step 7);
//     what it committed itself stays committed, the inbox row included.
//   - Add the middleware once (ErrNestedInbox).
//
// # The flow
//
// For each message, Inbox.Middleware runs these steps in this order (the
// delivery's run method in middleware.go reads the same way):
//
//  1. Validate. A message whose context already carries an inbox
//     transaction is refused with ErrNestedInbox (the inner claim would wait
//     forever on the outer one's row). The consumer is Config.Consumer or
//     the Watermill handler name, the message id is Config.MessageID's
//     (default msg.UUID); an empty, over-long (MaxKeyLength bytes), invalid
//     UTF-8 or NUL-holding key is refused with an error wrapping
//     ErrInvalidConsumer (ErrEmptyConsumer) or ErrInvalidMessageID
//     (ErrEmptyMessageID, ErrMessageIDTooLong). A refused message is not
//     handled and nothing is written.
//  2. Begin. Before its first claim the inbox checks once, as Inbox.Verify
//     does (with Config.OutboxTables), that the dialect is for the server DB
//     reaches (ErrDialectMismatch: a PostgreSQL database opened under the
//     driver name "mysql", say) and that the tables are usable: a mismatch,
//     a missing or an incompatible table fails every message with a
//     transient error wrapping ErrDialectMismatch, ErrTableNotFound or
//     ErrIncompatibleTable, after a wait that grows from 100 ms to 5 s,
//     until a check passes (Inbox.RouterPlugin makes router.Run fail
//     instead).
//     Then it begins a transaction on Config.DB with Config.TxOptions, under
//     the message's context. On MySQL/MariaDB a BEGIN whose connection was
//     lost after START TRANSACTION was sent is retried once (logged at Debug,
//     span event inbox.begin_retried); lost twice, a ping tells a lost
//     connection (transient) from a misconfiguration (not transient).
//  3. Claim. It inserts (consumer, message id) with the dialect's
//     insert-if-absent statement and reads the rows affected: on PostgreSQL
//     and SQLite INSERT ... ON CONFLICT (consumer, message_id) DO NOTHING
//     (1 row: new, 0: already processed); on MySQL/MariaDB INSERT ... ON
//     DUPLICATE KEY UPDATE processed_at = processed_at + INTERVAL 1
//     MICROSECOND (1 row: new, 2: already processed). Any other count is
//     ErrUnexpectedRowsAffected. PostgreSQLPartitioned first takes
//     pg_advisory_xact_lock on a hash of (table, consumer, message id), then
//     inserts only if no partition holds the key, at READ COMMITTED, both in
//     one call of the table's claim function ("<table>_claim"). A
//     duplicate is never detected from error text or codes, only from the
//     rows the claim affected. The new row also stores a fingerprint of the
//     content (Config.ReusedIDs, Config.Fingerprint; the first 16 bytes of
//     the payload's SHA-256 by default), in the same statement.
//  4. Duplicate? No new row: this consumer already processed the message.
//     First the stored fingerprint is read and compared (on MySQL/MariaDB
//     the claim's reply already says whether it differs): another content
//     under the same id (a producer reusing ids) fails the delivery with
//     ErrMessageIDReused, or with ReusedIDsWarn is logged at Info and goes
//     on as a duplicate; either way Config.OnReusedID is called. A row
//     without a fingerprint, or a table without the column, matches.
//     The transaction rolls back, the handler is not called, and the
//     middleware returns nil, nil (the router acks), logs at Debug
//     (message_uuid, handler_name, consumer, message_id) and calls
//     Config.OnDuplicate. A second delivery of the same key that arrives
//     while the first is in flight waits on the key until the first
//     transaction ends, then skips (the first committed) or claims the key
//     and runs the handler (the first rolled back).
//  5. Handler. A new row: Config.Outbox, if set, is called once to bind a
//     publisher to the transaction, and the handler runs with the
//     transaction in msg.Context() (TxFromContext, OutboxFromContext).
//  6. Outbox. With Config.Outbox, the messages the handler returned are
//     published through it, to the handler's publish topic, in the
//     transaction; none are returned to the router, so they are sent if and
//     only if the transaction commits. Without it the router publishes them
//     after the commit. With the library's own relay (Config{Outbox:
//     ob.Publisher}, ob an Outbox), they are rows of the outbox table that
//     the relay sends once the transaction commits (woken by the commit, at
//     step 9) and then deletes; its writes are refused once the server has
//     ended the transaction (they would commit on their own).
//  7. Pre-commit check. The transaction must still be open: a handler that
//     committed or rolled it back itself (see the rules above) is nacked
//     with ErrTransactionEnded, because PostgreSQL and MySQL accept a COMMIT
//     outside a transaction. The inbox reads the transaction status the
//     server sent with its last response (no round trip; SQLite refuses the
//     COMMIT instead). On MySQL/MariaDB the inbox also re-reads its claim in
//     the transaction (one round trip): a deadlock (1213) or snapshot
//     conflict (1020) whose error the handler ignored has already rolled the
//     transaction back there, its later statements ran outside any
//     transaction, and COMMIT would succeed with nothing to commit. The
//     error is then ErrTxRolledBack, also for a handler's ROLLBACK, which
//     MySQL reports alike. PostgreSQL reports an error of the transaction
//     at COMMIT with its own error; on SQLite, whose COMMIT then finds no
//     transaction, the inbox reads the claim: gone, it is ErrTxRolledBack
//     (a rollback SQLite made itself, or the handler's ROLLBACK), committed
//     by the handler, ErrTransactionEnded.
//  8. Commit. COMMIT makes the inbox row and the handler's writes durable
//     together.
//  9. After-commit. The functions registered with AfterCommit run (a panic
//     in one is logged, the message is still acked), Config.OnProcessed is
//     called, and the middleware returns the handler's messages (none with
//     an outbox) and nil: the router acks.
//
// One deferred rollback ends every delivery (harmless after a commit), and
// one place reports its outcome to the hooks, the span and the log. When
// the middleware returns, msg.Context() is again the context the message
// came in with, so a Retry outside never sees a finished transaction.
//
// # Outcomes
//
// A duplicate is not an error: it is acknowledged (step 4).
//
// A handler error rolls the transaction back, inbox row included; the
// middleware returns that same error (errors.Is and errors.As match it), the
// router nacks, and the redelivery processes the message again.
// Config.OnFailed is called.
//
// A handler panic rolls the transaction back, calls Config.OnFailed and
// goes on, with the handler's stack, to Watermill's Recoverer or the router,
// which nack. No connection stays checked out.
//
// A commit failure (serialization failure, deadlock, lost connection,
// PostgreSQL turning COMMIT into ROLLBACK after a failed statement, or
// ErrTxRolledBack from step 7) is returned: the router nacks, and a message
// whose transaction did not commit is never acked. A COMMIT whose
// connection was lost after it was sent, on any database, is in doubt (the
// server may have committed): IsTransient reports it, and the redelivery
// either skips the message as a duplicate or processes it; either way the
// effect happens once. If it had committed, the messages the handler
// returned without an outbox are lost and AfterCommit functions never run.
// A failed rollback of the inbox transaction is returned too (joined,
// transient): the connection is in doubt, and the redelivery settles it.
//
// A handler that ended the transaction itself and returned nil is nacked
// with ErrTransactionEnded (step 7; not transient): a message is never
// acked unless the inbox committed its row together with the handler's
// writes. A handler that ended it and returned an error is nacked with its
// error.
//
// A deadline or cancellation of the message's context (middleware.Timeout,
// a router shutdown) that fires before the handler returns ends the
// transaction: database/sql rolls it back, the handler's statements fail
// with the context's error, and the middleware returns an error wrapping
// the context's cause (IsTransient reports it). Once the handler returned
// nil, the message's context no longer governs the transaction: the outbox
// publish, the pre-commit check and COMMIT run to completion under
// Config.CommitTimeout (DefaultCommitTimeout), so a deadline that fires
// during COMMIT cannot make a committed message look failed, and a
// committed message is acked. Past CommitTimeout the message is nacked with
// ErrCommitTimeout (transient; the COMMIT is in doubt).
//
// Errors of the database are wrapped with the operation and the key;
// errors.As still reaches the driver's error type. IsTransient tells a
// failure worth a redelivery (deadlock, serialization failure, timeout,
// lost connection, busy SQLite database, a shutdown closing the pool or
// the DB) from one that is not (including the handler's bugs:
// ErrTransactionEnded, pgx's "conn busy"), by driver error code or
// sentinel, never by text.
//
// # Order of middlewares
//
// Inbox.Middlewares returns the poison queue, Retry, Timeout, Recoverer
// and the inbox in this order. By hand, put the inbox inside (after)
// Recoverer, PoisonQueue, Retry and Timeout in router.AddMiddleware
// (middlewares added first run outermost). Each retry
// then runs in a fresh transaction, a message sent to the poison queue is
// not marked processed (so replaying it processes it), and the deadline
// covers the handler. The reverse order cannot be detected and is wrong:
// Retry inside the inbox runs every attempt in one transaction, so a failed
// attempt's writes commit with the last one (and on PostgreSQL a failed
// statement aborts the transaction for every later attempt: their SQLSTATE
// 25P02 comes back with a hint that names this mistake), and
// PoisonQueue inside commits a poisoned message's inbox row.
//
// # Keys
//
// The consumer defaults to the Watermill handler name, so two handlers that
// receive the same message each process it once; set Config.Consumer to keep
// a key space when a handler is renamed, or to share one. The message id
// defaults to the message UUID; MessageIDFromMetadata and
// MessageIDFromMetadataOrUUID take it from a header, for messages from other
// producers. Both are stored byte for byte (1 to MaxKeyLength bytes of UTF-8
// without NUL) and never truncated or normalised.
//
// # Databases
//
// PostgreSQL 12+, MySQL 8.0+ and MariaDB 10.5+, SQLite 3.42+. The DDL is in
// the repository's schema/ folder and SchemaSQL; InitializeSchema creates
// it, and a table made by hand is checked before use (Inbox.Verify): key
// columns must compare byte for byte, so MySQL/MariaDB use varbinary(255).
// On MySQL the claim's update always changes the row, so a duplicate reports
// 2 rows with or without the driver's clientFoundRows=true (a no-op update
// would report 1 with it, the same as a new row); the duplicate's
// transaction rolls back, so the change is never kept. INSERT IGNORE is not
// used: it also silences unrelated errors. PostgreSQLPartitioned
// (PostgreSQL 14+, never inferred) range-partitions the table on
// processed_at, by ISO week (Monday 00:00 UTC) for a new table
// (DefaultPartitionInterval) or by UTC day (PartitionInterval), so that
// the purge drops partitions (DropPartitions) instead of deleting rows.
//
// # Purge
//
// The table grows by one row per message and consumer. Purge deletes rows
// older than a window by the database clock, in short batches; a Purger
// runs it periodically and may run in every instance (on PostgreSQL and
// MySQL a round takes a lock, and an instance that does not get it skips
// the round); a WindowSource (the kafkaretention or jetstreamretention
// package, or FixedWindow) refuses a window
// shorter than the broker can redeliver (ErrWindowTooShort), and a source's
// error (a topic or stream that keeps messages forever: ErrNoSafeWindow of
// those packages) or a window out of range (ErrWindowOutOfRange: below 1µs
// or above MaxSafeWindow) stops the purge before anything is deleted.
//
// # Operations
//
// Config.OnProcessed, OnDuplicate and OnFailed are hooks for metrics (the
// metrics module adapts them to Prometheus); Config.TracerProvider adds one
// OpenTelemetry span per message; Stats, EstimateRows, OldestRowAge and CountExpired
// describe the table; the inbox command (cmd/inbox) prints, applies and
// verifies the schema, purges and reports statistics from a shell.
package inbox
