// Package bench holds the inbox's benchmark suite: throughput and latency of
// the inbox against the same handler without deduplication and against
// Watermill's in-memory Deduplicator, on PostgreSQL, MariaDB and SQLite; the
// claim's cost as the inbox table grows; what not preparing the claim costs
// on PostgreSQL, straight and through PgBouncer; what one message costs,
// counted rather than timed (round trips, statements, rows, index entries,
// WAL), and what other purge indexes would save and cost; and a Kafka
// (kfake) end-to-end pipeline. It is its own module so that the core keeps a small go.mod.
// See BENCHMARKS.md at the repository root.
package bench
