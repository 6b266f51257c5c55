// Package inbox is the transactional inbox pattern (idempotent consumer) as a
// Watermill router middleware: a message delivered twice, ten times, or to two
// workers at the same moment changes the database exactly once.
//
// # The flow
//
// Brokers deliver at least once: a producer's outbox relay retries, a worker
// commits and dies before it acks, a consumer group rebalances, an operator
// rewinds a topic. For each message, the middleware
//
//  1. begins a transaction on Config.DB with the message's context;
//  2. inserts (consumer, message id) into the inbox table, whose primary key
//     is exactly that pair, with the dialect's insert-if-absent statement;
//  3. reads the rows affected. A new row means the message is claimed: the
//     handler runs with the transaction in msg.Context() (TxFromContext), and
//     its writes commit together with the inbox row. No new row means this
//     consumer already processed the message: the transaction rolls back, the
//     handler is not called, and the router acks.
//
// The database decides who wins: there is no check-then-insert race. A second
// delivery of the same key that arrives while the first is in flight waits on
// the key until the first transaction ends, then skips (first committed) or
// processes (first rolled back). A handler error or panic rolls back the
// inbox row with the handler's writes, so the redelivery processes the
// message again; a failed commit is returned to the router (nack), never
// acknowledged.
//
// # Usage
//
//	ib, err := inbox.New(inbox.Config{DB: db}) // db is a *sqlx.DB
//	if err != nil { ... }
//	if err := ib.InitializeSchema(ctx); err != nil { ... }
//	router.AddMiddleware(
//		middleware.Recoverer,
//		middleware.Retry{MaxRetries: 3, InitialInterval: 100 * time.Millisecond}.Middleware,
//		ib.Middleware, // last
//	)
//
//	func handle(msg *message.Message) error {
//		tx, ok := inbox.TxFromContext(msg.Context())
//		if !ok {
//			return errors.New("no inbox transaction")
//		}
//		_, err := tx.ExecContext(msg.Context(), tx.Rebind("INSERT INTO invoices (order_id) VALUES (?)"), id)
//		return err
//	}
//
// A *sql.DB is wrapped with sqlx.NewDb(db, "pgx") (or "postgres", "mysql",
// "sqlite"); a pgx pool with sqlx.NewDb(stdlib.OpenDBFromPool(pool), "pgx").
//
// # Order of middlewares
//
// Put the inbox inside (after) Recoverer, PoisonQueue and Retry. Each retry
// then runs in a fresh transaction, and a message sent to the poison queue is
// not marked processed, so replaying it later processes it. The reverse order
// cannot be detected and is wrong: Retry inside the inbox runs every attempt
// in one transaction, so a failed attempt's writes commit with the last one.
//
// # Keys
//
// The consumer defaults to the Watermill handler name, so two handlers that
// receive the same message each process it once; the message id defaults to
// the message UUID. Both are stored byte for byte (1 to MaxKeyLength bytes of
// UTF-8 without NUL) and never truncated or normalised.
//
// # Databases
//
// PostgreSQL (INSERT ... ON CONFLICT DO NOTHING), MySQL 8 and MariaDB
// (INSERT ... ON DUPLICATE KEY UPDATE that reports 1 or 2 rows, correct with
// or without clientFoundRows) and SQLite (ON CONFLICT DO NOTHING). The DDL is
// in the repository's schema/ folder and SchemaSQL.
package inbox
