// Package pgxinbox is the transactional inbox (idempotent consumer) for
// services that use pgx natively: a Watermill middleware over a
// *pgxpool.Pool whose handlers get a pgx.Tx. It runs the same per-message
// flow as package inbox (read its documentation for the flow, the
// semantics, the errors and the middleware order); only the transaction
// is pgx's instead of database/sql's. It is its own package so that users
// of package inbox on MySQL or SQLite do not compile pgx.
//
//	ib, err := pgxinbox.New(pgxinbox.Config{Pool: pool})
//	if err != nil { … }
//	if err := ib.InitializeSchema(ctx); err != nil { … }
//	mws, err := ib.Middlewares(inbox.MiddlewaresConfig{}) // Retry, Timeout, Recoverer, then the inbox
//	if err != nil { … }
//	router.AddMiddleware(mws...)
//	router.AddPlugin(ib.RouterPlugin) // checks the table before the first message
//
//	func handle(msg *message.Message) error {
//		tx, ok := pgxinbox.TxFromContext(msg.Context())
//		if !ok {
//			return pgxinbox.MissingTxError(msg.Context()) // wraps inbox.ErrNoTx, says what is missing
//		}
//		_, err := tx.Exec(msg.Context(), "INSERT INTO invoices …", …)
//		return err
//	}
//
// What is different from package inbox:
//
//   - One round trip fewer per message. BEGIN, the partitioned dialect's key
//     lock and the claim are sent as one pgx batch (pgx's Batch.BeginTx, in
//     pgx v5.12.0 and later), and the claim's rows affected come back with
//     it: a processed message costs the batch, the handler's statements and
//     COMMIT; a duplicate costs the batch and ROLLBACK. Through database/sql,
//     BEGIN is a round trip of its own.
//   - The handler's transaction is pgx's own (pgxinbox.TxFromContext):
//     Exec, Query, CopyFrom, SendBatch, LargeObjects and nested
//     transactions (savepoints) work as pgx documents them.
//   - The outbox factory takes the pgx.Tx (Config.Outbox): with
//     watermill-sql v4, wsql.NewPublisher(wsql.TxFromPgx(tx), …), and the
//     forwarder's subscriber reads with wsql.BeginnerFromPgx(pool).
//   - How statements are sent is the pool's query exec mode. pgx's default
//     (cache_statement) prepares each statement once per connection.
//     Behind a transaction-mode connection pooler (PgBouncer before 1.21)
//     set default_query_exec_mode=exec or simple_protocol in the pool's
//     connection string: both still send BEGIN and the claim in one round
//     trip.
//
// inbox.OutboxFromContext, inbox.AfterCommit and inbox.IsTransient work on
// this package's messages and errors (IsTransient knows pgx's errors). The
// Outbox, the purge, the Purger, the stats, the metrics module's WatchTable
// and the DDL of InitializeSchema or your migrations take a *sqlx.DB: make
// one with DB(pool) at startup, once per pool, pass it to all of them, and
// keep it as long as the process (close it, which leaves the pool open,
// after they have stopped). The Inbox's DB() is the wrapper the Inbox made
// for itself the same way, and Close closes it: a component that outlives
// the Inbox (WatchTable, scraped until the process exits) fails on it. The
// CLI (cmd/inbox) takes the pool's DSN (-db).
package pgxinbox
