// Package soak holds the inbox's soak test: messages through a real Kafka
// protocol (kfake, in process) into worker processes whose routers run the
// inbox middleware on SQLite, PostgreSQL and MariaDB (one database after the
// other), while redelivery is injected at every layer at once.
//
// Injected, all in one run:
//   - the producer re-sends 5 % of the messages (same UUID, to a random
//     partition, some time later), as an outbox relay or a producer retry
//     does;
//   - worker processes are SIGKILLed right after a commit and before the
//     router acks (from an inbox.AfterCommit function), so the committed
//     message and up to an auto-commit interval of acked ones come back;
//   - three worker instances join and leave the consumer groups: killed ones
//     are replaced, and at fixed points of progress the oldest one leaves
//     gracefully and a new one joins (rebalances);
//   - the consumer groups' offsets are reset to the start mid-run (the
//     workers stop, the groups are deleted, new workers replay the topic);
//   - 5 % of handler attempts fail transiently after writing their business
//     row, so the rollback matters (Retry once in process, then a nack that
//     watermill-kafka resends).
//
// Each worker runs two consumers, "billing" and "shipping", on the same
// topic, each in its own consumer group and with its own business table.
//
// Checked at the end, for each consumer: business rows = distinct messages
// (every message produced has exactly one row, nothing else has one); no
// inbox row without its business row and no business row without its inbox
// row; every worker that was stopped gracefully had no database connection
// in use and exited cleanly; no session of a worker is left on the server,
// and no session of the run is left in a transaction (PostgreSQL: the run's
// application_name in pg_stat_activity; MariaDB: the session ids each
// connection reports when it opens, in information_schema.PROCESSLIST and
// INNODB_TRX, which needs the PROCESS privilege). Every failure that was not
// injected is one inbox.IsTransient reports as transient, so that a
// PoisonQueue filtered on it would not have set the message aside: a context
// ended by a graceful stop, a lost connection, and on MariaDB the deadlock
// (1213) of three deliveries of one key whose first rolls back. And each
// injected cause must have happened at least once (re-sends, kills, leaves,
// resets, handler failures, duplicates skipped).
//
// PostgreSQL and MariaDB are found through INBOX_TEST_POSTGRES_DSN and
// INBOX_TEST_MYSQL_DSN, defaulting to the local servers (MariaDB:
// root@tcp(127.0.0.1:3306)/test?parseTime=true). A server that cannot be
// reached skips its part locally, with how to start it, and fails it when
// CI=true.
//
//	cd soak && go test -race -count=1 ./...                            # 2,000 messages per database (CI)
//	cd soak && go test -race -count=1 -run 'TestSoak$/mariadb' .       # one database
//	cd soak && go test -race -count=1 -run 'TestSoak$' -soak.long -timeout 70m .  # 20,000 messages
//
// See soak_test.go for the flags.
package soak
