// Package sqliteoutboxv4 provides SQLite adapters (modernc.org/sqlite,
// driver name "sqlite") for watermill-sql v4
// (github.com/ThreeDotsLabs/watermill-sql/v4), which ships adapters for
// MySQL and PostgreSQL only, so that an inbox on SQLite writes its outbox
// in the same transaction, and Watermill's forwarder sends it on. For
// watermill-sql v3 use the sibling package sqliteoutbox.
//
// Two pairs, as in watermill-sql v4:
//
//   - SchemaAdapter with OffsetsAdapter: an append-only table per topic and
//     an acked offset per consumer group. Rows stay after they are
//     forwarded (delete old ones yourself); several consumer groups can
//     read one topic. Same tables as sqliteoutbox for v3.
//   - QueueSchema with QueueOffsetsAdapter: a queue table per topic, as v4's
//     PostgreSQLQueueSchema with PostgreSQLQueueOffsetsAdapter. With
//     DeleteOnAck: true a row is deleted in the subscriber's transaction once
//     the forwarder has published it and acked it, so the table is bounded
//     by the backlog. This is the bounded mode.
//
// An outbox for the inbox (root package) on SQLite, bounded:
//
//	ib, err := inbox.New(inbox.Config{DB: db, Outbox: func(tx *sqlx.Tx) (message.Publisher, error) {
//		pub, err := wsql.NewPublisher(wsql.TxFromStdSQL(tx.Tx), wsql.PublisherConfig{
//			SchemaAdapter: sqliteoutboxv4.QueueSchema{},
//		}, logger)
//		return forwarder.NewPublisher(pub, forwarder.PublisherConfig{ForwarderTopic: "outbox"}), err
//	}})
//	// The forwarder, on its own handle to the same file (with _txlock=immediate):
//	sub, err := wsql.NewSubscriber(wsql.BeginnerFromStdSQL(fwdDB), wsql.SubscriberConfig{
//		SchemaAdapter:    sqliteoutboxv4.QueueSchema{SubscribeBatchSize: 10},
//		OffsetsAdapter:   sqliteoutboxv4.QueueOffsetsAdapter{DeleteOnAck: true},
//		InitializeSchema: true,
//	}, logger)
//	fwd, err := forwarder.NewForwarder(sub, brokerPublisher, logger, forwarder.Config{ForwarderTopic: "outbox"})
//
// The publisher runs on the inbox's transaction, so watermill-sql refuses
// AutoInitializeSchema there: create the tables before the first message
// (the forwarder's subscriber does, with InitializeSchema, or call its
// SubscribeInitialize).
//
// # The queue schema's trade-offs
//
//   - No consumer groups (as in v4): the table has one acked state per row,
//     so it feeds one logical consumer, normally the forwarder, which fans
//     out through the broker. A subscriber with a ConsumerGroup is refused
//     with ErrConsumerGroup. Several forwarders on one file share the queue.
//   - DeleteOnAck: the table holds only what is not yet forwarded; nothing is
//     left to replay or audit, and a consumer added later sees only new
//     messages. SQLite reuses the freed pages, but the file does not shrink
//     below its high-water mark without VACUUM or auto_vacuum.
//   - Without DeleteOnAck, acked rows stay with acked = 1 (a partial index
//     keeps the subscriber's reads off them); delete them yourself, e.g.
//     DELETE FROM "watermill_outbox" WHERE acked = 1 AND created_at < ?
//     (Unix microseconds).
//   - A row is acked or deleted only in the subscriber's transaction, after
//     the forwarder's publish returned and the message was acked: a crash,
//     a closed forwarder or a failed commit before that leaves the row, and
//     it is sent again (at least once; an inbox at the receiving end absorbs
//     the duplicate). A closed subscriber or an expired ack deadline acks
//     at most the batch's rows up to its last acked message (see
//     QueueOffsetsAdapter: watermill-sql v4.1.2's own queue adapters delete
//     the whole batch then).
//
// # SQLite's single writer
//
// Ordering rests on SQLite's single writer: a transaction that writes holds
// the write lock until it ends, so offsets (AUTOINCREMENT, never reused) are
// assigned in commit order, and a subscriber never skips a message that
// commits after it read a higher offset.
//
// A watermill-sql subscriber keeps its transaction open while the batch is
// handled, then writes the ack in it; these adapters write nothing before
// that (ConsumedMessageQuery is empty). The subscriber's database handle
// decides the trade-off:
//
//   - With _txlock=immediate (as the inbox recommends), the subscriber takes
//     the write lock at BEGIN and holds it while its messages are handled:
//     delivery is exactly once and in order, and every other writer (the
//     inbox's transactions included) waits (busy_timeout) meanwhile. Right
//     for the forwarder, whose handler only publishes to the broker: keep
//     SubscribeBatchSize small and PollInterval not too short (an idle
//     subscriber takes the write lock at every poll).
//   - With deferred transactions (no _txlock), the subscriber only reads
//     while it waits and never blocks writers, but its ack fails with
//     SQLITE_BUSY_SNAPSHOT whenever another writer committed meanwhile, and
//     the batch is delivered again: at least once. Under a steady stream of
//     other writes it may keep failing, so use it only for slow consumers of
//     a quiet database. Watermill's universal pub/sub suite runs in this
//     mode (its tests leave messages unacked while others publish).
//
// SQLite does not queue writers: one that finds the write lock taken sleeps
// and polls until busy_timeout runs out, and under a sustained stream of
// other writes it can fail with SQLITE_BUSY (5) after waiting the whole
// timeout. Schema creation is such a write and watermill-sql does not retry
// it: create the tables before the load starts, and give busy_timeout room
// (seconds). Everywhere else the error is a nack, and inbox.IsTransient
// reports it as transient.
package sqliteoutboxv4
