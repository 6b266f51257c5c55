package inbox

import (
	"context"
	"strconv"
	"strings"

	"github.com/jmoiron/sqlx"
)

// outboxSQL is every statement the outbox relay runs on one dialect, for
// one outbox table and its dead-letter table, built once by NewOutbox.
// Placeholders are "?" (rebound by the driver's bind type); ids and batch
// sizes are written into the text as integers the relay itself read or
// chose, so that the relay's reads and deletes carry no other bind
// parameters.
type outboxSQL struct {
	// create is the DDL of the outbox and dead-letter tables, in order.
	create []string
	// insertPrefix and insertRow make a multi-row INSERT of the outbox:
	// insertPrefix, then insertRow once per message joined by ", ". A row's
	// bind parameters: topic, uuid, payload, metadata.
	insertPrefix, insertRow string
	// claimedInsert, when set (MySQL/MariaDB, SQLite), returns the INSERT of n
	// messages that writes them only while the inbox transaction holds its
	// claim in inboxTable (quoted): its row is read with a locking read, as
	// the pre-commit check reads it, in the same statement, so that nothing
	// is written in autocommit after the database rolled the transaction
	// back. Bind parameters: each row's as insertRow's, then the consumer
	// and the message id. inTx adds the server's own test that a
	// transaction is open (MariaDB's @@in_transaction; MySQL has none).
	// Rows affected: n while the claim holds, 0 otherwise.
	claimedInsert func(inboxTable string, n int, inTx bool) string
	// selectBatch returns the oldest n rows not yet relayed (id, topic,
	// uuid, payload, metadata, attempts), ordered by id; locked (FOR UPDATE
	// SKIP LOCKED) when locks. With skipTopics it leaves out the rows of the
	// topics its one bind parameter lists, a JSON array of strings. With idleTimeouts, and
	// idleTimeoutsOff set, every row also carries idle_timeouts, the sum of
	// the session's idle-transaction timeouts. On PostgreSQL it turns off
	// the transaction's idle_in_transaction_session_timeout (SET LOCAL, in
	// a one-time condition: no round trip of its own). With from, it reads
	// only the rows from an id on, bound before the topics (see
	// outboxFloor).
	selectBatch func(n int, from, skipTopics, idleTimeouts bool) string
	// floorProbe, when set (PostgreSQL, SQLite, MySQL/MariaDB), reads without a lock,
	// from one snapshot: the smallest id from a given one on of the topics
	// not waiting (NULL when none), the largest id (NULL when empty), the
	// id and uuid of the last row below a given id (the floor, or the
	// row a candidate kept plus one; NULL when none), and on
	// PostgreSQL the snapshot's xmin and the transaction's id, taken by it
	// when the round's transaction has none yet (its first statement that
	// takes one), so after the snapshot (SQLite, MySQL/MariaDB: 0 and 0). Bind
	// parameters: the id, the waiting topics as selectBatch takes them, the
	// id of the last row's bound. See outboxFloor.
	floorProbe string
	// floorBelow reads the id and uuid of the last row below an id (no
	// row: none); bind parameter the id.
	floorBelow string
	// floorXmin, when set (PostgreSQL), reads the snapshot's xmin alone:
	// while a floor's candidate waits for it, a round reads it instead of
	// running the whole probe, whose read from the head of the table costs
	// what the round's own read does.
	floorXmin string
	// floorLocked, when set (MySQL/MariaDB, which tell which transactions
	// run only to users with the PROCESS privilege), is the check that a
	// floor's candidate waits for instead of the transactions: a locking
	// read, NOWAIT, of every row from an id to below another (bind
	// parameters), run in a transaction of its own. InnoDB keeps the row a
	// transaction inserted and has not committed in the index, locked,
	// where a read from a snapshot does not see it: the check fails on it,
	// at once, and on a row another transaction holds (a relay's round, a
	// DELETE by hand), and succeeds once no row below the candidate is
	// uncommitted.
	floorLocked string
	// idsInOrder, when set, returns the read of whether the table's ids are
	// handed out in increasing order and never again (1; 0 or no row: not):
	// on PostgreSQL a sequence of cache 1 (a cache gives each session a
	// range of its own), on SQLite AUTOINCREMENT (without it a new row takes
	// the largest id left plus one, below ids already deleted), and its
	// bind parameters.
	idsInOrder func() (string, []any)
	// idleTimeoutsOff, when set (MariaDB), turns off the session's
	// idle-transaction timeouts and keeps their values in user variables;
	// idleTimeoutsBack puts them back. A relay round holds its transaction
	// open, idle, while it publishes: a server that ends the session then
	// fails the round after its publishes, and every round after it.
	idleTimeoutsOff, idleTimeoutsBack string
	// nextOfTopic reads the row of a topic with the smallest id above a
	// given one among the outboxWalkWindow rows that follow it, locked as
	// selectBatch locks: bind parameters id, topic. The window bounds the
	// read (the table has no index on topic): a topic whose next message
	// is further on waits until the rows before it leave.
	nextOfTopic string
	// topicIDsBelow returns a read of the ids of a topic's rows from a
	// given id up to below another, at most n of them in id order: bind
	// parameters from (inclusive), below, topic. It reads what has
	// committed by the statement, and so also sees a row that committed
	// after the round's batch read with an id below the batch's last (see
	// walkReads.next). It locks as selectBatch does, skipping the rows
	// another transaction holds: those of another relay instance's round
	// (or a hand-made UPDATE) are not late commits, and counting them
	// kept a refused message from being set aside while another instance
	// held an earlier row of its topic. (The earlier message of a writer
	// whose later one the walk found has committed, its locks released,
	// before the later one was written.)
	topicIDsBelow func(n int) string
	// deadHas reads whether the dead-letter table holds an id: bind
	// parameter id.
	deadHas string
	// locks reports whether selectBatch locks the rows it returns, so that
	// a relay holds its transaction open while it publishes them and other
	// relay instances skip them.
	locks bool
	// stillThere, when set, returns a locking read of which of the listed
	// ids still exist, run right after selectBatch: on MariaDB a row that
	// another relay deleted and committed while selectBatch ran can come
	// back from it (seen here on 10.11: two relays sent 5-15 % of the
	// messages twice); read again under the lock, it is gone.
	stillThere func(ids []int64) string
	// visibleUpTo, when set, returns the read from the statement's
	// snapshot of the ids of the rows between two bounds, bind parameters
	// the bounds (from the floor, 0 without one: below it lie only the
	// waiting topics' rows, which a read from the head of the table passed
	// over every round) then the waiting topics (skipTopics), run right after
	// selectBatch in its place of stillThere: the rows of the batch still
	// there, and the rows before its last that the batch's read skipped,
	// of a transaction that committed during it (see mysqlVisibleUpTo),
	// which stillThere then locks and rowsByID reads.
	visibleUpTo func(skipTopics bool) string
	rowsByID    func(ids []int64) string
	// deleteIDs returns the DELETE of the rows whose ids are listed.
	deleteIDs func(ids []int64) string
	// byUUID: the statements that record a round's outcome (failed, waited,
	// bury, deleteKeyed) find a row by its id and its uuid, bound after the
	// id, and not by its id alone: SQLite's relay holds no lock while it
	// publishes, and an id reset meanwhile (the table re-created) gave the
	// round's ids to new messages, which its DELETE removed unsent.
	byUUID bool
	// deleteKeyed, with byUUID, returns the DELETE of the rows of ids by
	// their id and uuid, bound in pairs in the order of ids.
	deleteKeyed func(ids []int64) string
	// failed records a failed attempt: bind parameters last error, id.
	failed string
	// waited records a refusal that wraps ErrBrokerUnavailable, which is no
	// attempt (the broker's state, not the message's): bind parameters
	// last error, id.
	waited string
	// bury copies a row to the dead-letter table unless that table holds
	// its id already (the outbox's ids started again): bind parameters
	// last error, id, id. Rows affected: 1, or 0 when it did not.
	bury string
	// probe reads no row of every column the relay reads (Outbox.Verify).
	probe string
	// probeStatements run each kind of the relay's statements on no row
	// (Outbox.Verify): its locking read, the attempt count, the move to
	// the dead-letter table and the DELETE, last. A server without their
	// syntax (FOR UPDATE SKIP LOCKED, JSON_TABLE) or a database user without
	// the privileges they need is then told at startup, not at the first
	// round or the first message the broker refuses.
	probeStatements []string
	// stats returns the age of the oldest row in microseconds (NULL when
	// empty) and the first row's last_error (NULL when empty or not
	// refused), dead the number of dead letters and pending the number of
	// rows.
	// The oldest row is the oldest of the first rows by id, read through
	// the primary key: MIN(created_at) read every row (no index on it), as
	// the count does, and a backlog large enough to outlast a scrape's
	// timeout hid its age with its depth (MariaDB: 2.3-2.9 s at 2 million
	// rows). A row's id and created_at are both taken as it is written, so
	// the first ids are the oldest rows, but for writes that raced by
	// microseconds, which reading the first 100 covers.
	stats, dead, pending string
	// deadLast reads the largest id of the dead-letter table (NULL when
	// empty), the bound of a requeue by topic or of all.
	deadLast string
	// deadPick returns the locking read of up to n ids of the dead-letter
	// table, ordered: with ids, those of ids; without, those above the
	// first bind parameter and up to the second; byTopic adds a bind
	// parameter, the topic.
	deadPick func(ids []int64, n int, byTopic bool) string
	// requeue returns the INSERT that copies the dead letters of ids back
	// into the outbox, in the order of their ids, as new messages (new
	// ids, no attempts, written now); deadDelete, the DELETE of those
	// dead letters.
	requeue, deadDelete func(ids []int64) string
	// deadWriteLock, when set (SQLite), is the requeue transaction's first
	// statement: it writes nothing and takes the write lock, which a
	// deferred transaction that read first could not take once another
	// connection had written (SQLITE_BUSY_SNAPSHOT, 517: "database is
	// locked", whatever the busy timeout).
	deadWriteLock string
}

// floorProbeSQL returns outboxSQL.floorProbe for table q (quoted), with the
// snapshot's xmin and the horizon as SQL expressions.
func floorProbeSQL(d Dialect, q, xmin, horizon string) string {
	return "SELECT (SELECT min(id) FROM " + q + " WHERE id >= ? AND " + skipTopicsCondition(d) + ") AS first_other," +
		" (SELECT max(id) FROM " + q + ") AS last, b.id AS below, b.uuid AS below_uuid, " + xmin + " AS xmin, " + horizon + " AS horizon" +
		" FROM (SELECT 1 AS one) AS o LEFT JOIN (" + floorBelowSQL(q) + ") AS b ON 1 = 1"
}

// floorBelowSQL returns outboxSQL.floorBelow for table q (quoted).
func floorBelowSQL(q string) string {
	return "SELECT id, uuid FROM " + q + " WHERE id < ? ORDER BY id DESC LIMIT 1"
}

// outboxWalkWindow is how many rows past a message the relay's walk looks
// for the next message of its topic (outboxSQL.nextOfTopic).
const outboxWalkWindow = 1000

// insert returns the INSERT of n messages: insertPrefix, then insertRow n
// times.
func (s outboxSQL) insert(n int) string {
	return s.insertPrefix + strings.TrimSuffix(strings.Repeat(s.insertRow+", ", n), ", ")
}

// idList writes ids as a comma-separated list of integers.
func idList(ids []int64) string {
	var b strings.Builder
	for i, id := range ids {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString(strconv.FormatInt(id, 10))
	}
	return b.String()
}

// outboxColumns are the columns of a row that the relay reads, but its
// attempts.
const outboxColumns = "id, topic, uuid, payload, metadata"

// outboxBatchRead returns outboxSQL.selectBatch for table q (quoted), with
// lock after it: guard, when set, is a condition without a column that the
// read tests too (once), and idleColumns, when set, the columns read beside
// every row when the caller asks for the idle timeouts.
func outboxBatchRead(d Dialect, q, lock, guard, idleColumns string) func(n int, from, skipTopics, idleTimeouts bool) string {
	skip := skipTopicsCondition(d)
	return func(n int, from, skipTopics, idleTimeouts bool) string {
		var conditions []string
		if guard != "" {
			conditions = append(conditions, guard)
		}
		if from {
			conditions = append(conditions, "id >= ?")
		}
		if skipTopics {
			conditions = append(conditions, skip)
		}
		where := ""
		if len(conditions) > 0 {
			where = " WHERE " + strings.Join(conditions, " AND ")
		}
		extra := ""
		if idleTimeouts && idleColumns != "" {
			extra = ", " + idleColumns
		}
		return "SELECT " + outboxColumns + ", attempts" + extra + " FROM " + q + where + " ORDER BY id LIMIT " + strconv.Itoa(n) + lock
	}
}

// skipTopicsCondition is the condition that leaves the waiting topics out of
// a read. They come as one bind parameter, a JSON array of strings,
// whatever their number: one parameter each passed the database's limit
// (SQLite 32766, PostgreSQL and MySQL 65535) when thousands waited, and
// every read failed, the healthy topics' too.
func skipTopicsCondition(d Dialect) string {
	switch d.server() {
	case serverPostgreSQL:
		return "topic NOT IN (SELECT jsonb_array_elements_text(CAST(? AS jsonb)))"
	case serverMySQL:
		// topic is varbinary: the JSON strings compared as their bytes.
		// The list comes in ASCII (asciiJSON): a connection in utf8mb3
		// (charset=utf8) broke a 4-byte character in it, and JSON_TABLE
		// refused the whole list (4035), every read with it.
		return "topic NOT IN (SELECT CAST(j.t AS BINARY) FROM JSON_TABLE(?, '$[*]' COLUMNS (t VARCHAR(1024) CHARACTER SET utf8mb4 PATH '$')) AS j)"
	}
	return "topic NOT IN (SELECT value FROM json_each(?))" // SQLite
}

// newOutboxSQL builds the statements shared by every dialect around what
// differs: column types, the time of a row, and whether rows can be locked.
func newOutboxSQL(d Dialect, t, dead qualifiedName, columns, deadColumns []string, now, ageMicros, lock string) outboxSQL {
	q, dq := t.quoted(d), dead.quoted(d)
	return outboxSQL{
		create: []string{
			"CREATE TABLE IF NOT EXISTS " + q + " (\n    " + strings.Join(columns, ",\n    ") + "\n)" + d.outboxTableOptions(),
			"CREATE TABLE IF NOT EXISTS " + dq + " (\n    " + strings.Join(deadColumns, ",\n    ") + "\n)" + d.outboxTableOptions(),
		},
		insertPrefix: "INSERT INTO " + q + " (topic, uuid, payload, metadata, created_at) VALUES ",
		insertRow:    "(?, ?, ?, ?, " + now + ")",
		selectBatch:  outboxBatchRead(d, q, lock, "", ""),
		nextOfTopic: "SELECT " + outboxColumns + ", attempts FROM " + q + " WHERE id = (SELECT w.id FROM (SELECT id, topic FROM " + q +
			" WHERE id > ? ORDER BY id LIMIT " + strconv.Itoa(outboxWalkWindow) + ") AS w WHERE w.topic = ? ORDER BY w.id LIMIT 1)" + lock,
		topicIDsBelow: func(n int) string {
			return "SELECT id FROM " + q + " WHERE id >= ? AND id < ? AND topic = ? ORDER BY id LIMIT " + strconv.Itoa(n) + lock
		},
		deadHas: "SELECT id FROM " + dq + " WHERE id = ?",
		locks:   lock != "",
		probe:   "SELECT " + outboxColumns + ", attempts FROM " + q + " WHERE 1 = 0",
		probeStatements: []string{
			"SELECT " + outboxColumns + ", attempts FROM " + q + " WHERE 1 = 0 ORDER BY id" + lock,
			"UPDATE " + q + " SET attempts = attempts + 1, last_error = NULL WHERE 1 = 0",
			"INSERT INTO " + dq + " (" + outboxColumns + ", created_at, attempts, last_error, dead_at) SELECT " + outboxColumns +
				", created_at, attempts, last_error, " + now + " FROM " + q + " WHERE 1 = 0 AND NOT EXISTS (SELECT 1 FROM " + dq + " WHERE 1 = 0)",
			"DELETE FROM " + q + " WHERE 1 = 0",
		},
		deleteIDs: func(ids []int64) string {
			return "DELETE FROM " + q + " WHERE id IN (" + idList(ids) + ")"
		},
		failed: "UPDATE " + q + " SET attempts = attempts + 1, last_error = ? WHERE id = ?",
		waited: "UPDATE " + q + " SET last_error = ? WHERE id = ?",
		bury: "INSERT INTO " + dq + " (" + outboxColumns + ", created_at, attempts, last_error, dead_at) SELECT " + outboxColumns +
			", created_at, attempts + 1, ?, " + now + " FROM " + q + " WHERE id = ? AND NOT EXISTS (SELECT 1 FROM " + dq + " WHERE id = ?)",
		stats: "SELECT (SELECT " + ageMicros + " FROM (SELECT created_at FROM " + q + " ORDER BY id LIMIT 100) AS oldest)," +
			" (SELECT last_error FROM " + q + " ORDER BY id LIMIT 1)",
		dead:     "SELECT count(*) FROM " + dq,
		pending:  "SELECT count(*) FROM " + q,
		deadLast: "SELECT MAX(id) FROM " + dq,
		deadPick: func(ids []int64, n int, byTopic bool) string {
			where := "id > ? AND id <= ?"
			if ids != nil {
				where = "id IN (" + idList(ids) + ")"
			}
			if byTopic {
				where += " AND topic = ?"
			}
			deadLock := ""
			if lock != "" {
				// Waits for the rows another requeue holds (SKIP LOCKED
				// would leave them, a requeue rolled back included).
				deadLock = " FOR UPDATE"
			}
			return "SELECT id FROM " + dq + " WHERE " + where + " ORDER BY id LIMIT " + strconv.Itoa(n) + deadLock
		},
		requeue: func(ids []int64) string {
			return "INSERT INTO " + q + " (topic, uuid, payload, metadata, created_at) SELECT topic, uuid, payload, metadata, " + now +
				" FROM " + dq + " WHERE id IN (" + idList(ids) + ") ORDER BY id"
		},
		deadDelete: func(ids []int64) string {
			return "DELETE FROM " + dq + " WHERE id IN (" + idList(ids) + ")"
		},
	}
}

// The outbox tables on PostgreSQL. The id is a 64-bit identity, so it
// cannot run out (watermill-sql v4's queue schema uses a 32-bit SERIAL,
// whose inserts fail for good after 2^31 of them, rolled-back ones
// included). Payload and metadata (JSON) are bytea: a []byte parameter is
// bytea in every pgx query mode, where a json column refuses it in the
// exec and simple_protocol modes PgBouncer needs (22P02).
func (d postgresDialect) outbox(t, dead qualifiedName) outboxSQL {
	row := []string{
		"topic      text        NOT NULL",
		"uuid       text        NOT NULL",
		"payload    bytea       NOT NULL",
		"metadata   bytea       NOT NULL",
		"created_at timestamptz NOT NULL DEFAULT now()",
		"attempts   integer     NOT NULL DEFAULT 0",
		"last_error text",
	}
	s := newOutboxSQL(d, t, dead,
		append([]string{"id         bigint      GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY"}, row...),
		append(append([]string{"id         bigint      PRIMARY KEY"}, row...), "dead_at    timestamptz NOT NULL DEFAULT now()"),
		// clock_timestamp(), not now(): now() is the writing transaction's
		// start, and the oldest message's age included the handler's time
		// (a 2 s handler's message read 2 s old as it committed).
		"clock_timestamp()", "CAST(EXTRACT(EPOCH FROM clock_timestamp() - MIN(created_at)) * 1000000 AS bigint)", " FOR UPDATE SKIP LOCKED")
	// The relay's round commits asynchronously (synchronous_commit off for
	// its own transaction, set in the DELETE's one-time subquery: no round
	// trip of its own), so that it does not wait for the WAL flush beside
	// the handlers' commits. A server crash may lose the last rounds'
	// deletes: those messages are sent again, with their UUIDs (at least
	// once), as after a relay crash.
	plain := s.deleteIDs
	s.deleteIDs = func(ids []int64) string {
		return plain(ids) + " AND (SELECT set_config('synchronous_commit', 'off', true)) IS NOT NULL"
	}
	// The round's transaction stays open, idle, while it publishes: a
	// server or role idle_in_transaction_session_timeout shorter than a
	// slow publish (a broker's retries take seconds) ended the session,
	// failed the round after its publishes, and failed every round after
	// it, each sending its messages again. The locking read turns it off
	// for this transaction only (SET LOCAL), as the purge's round does.
	// It also asks for bytea in hex (bytea_output, for this transaction
	// only): a session's 'escape' (a role's or database's setting, or one
	// a handler left on a pooled connection) read as text, as pgx's
	// simple protocol reads it, failed every round ("invalid hex format").
	s.selectBatch = outboxBatchRead(d, t.quoted(d), " FOR UPDATE SKIP LOCKED",
		"(SELECT set_config('idle_in_transaction_session_timeout', '0', true) || set_config('bytea_output', 'hex', true)) IS NOT NULL", "")
	// txid_* (PostgreSQL 12; pg_current_snapshot and its kin are 13+):
	// 64-bit transaction ids, which do not wrap around.
	s.floorProbe = floorProbeSQL(d, t.quoted(d), "txid_snapshot_xmin(txid_current_snapshot())", "txid_current()")
	s.floorXmin = "SELECT txid_snapshot_xmin(txid_current_snapshot())"
	s.floorBelow = floorBelowSQL(t.quoted(d))
	s.idsInOrder = func() (string, []any) {
		return "SELECT CAST(s.seqcache = 1 AS integer) FROM pg_catalog.pg_sequence s WHERE s.seqrelid = CAST(pg_get_serial_sequence(?, 'id') AS regclass)",
			[]any{t.quoted(d)}
	}
	return s
}

func (postgresDialect) outboxTableOptions() string { return "" }

func (d postgresDialect) createOutbox(ctx context.Context, db *sqlx.DB, t qualifiedName, stmts []string) error {
	return createSchemaLocked(ctx, db, d, t, stmts)
}

// The outbox tables on MySQL/MariaDB: a 64-bit AUTO_INCREMENT id, binary
// strings (no collation folds or pads them), and rows locked with FOR
// UPDATE SKIP LOCKED (MySQL 8.0, MariaDB 10.6).
func (d mysqlDialect) outbox(t, dead qualifiedName) outboxSQL {
	row := []string{
		"topic      varbinary(1024) NOT NULL",
		"uuid       varbinary(255)  NOT NULL",
		"payload    longblob        NOT NULL",
		"metadata   longblob        NOT NULL",
		"created_at datetime(6)     NOT NULL",
		"attempts   int             NOT NULL DEFAULT 0",
		"last_error text",
	}
	s := newOutboxSQL(d, t, dead,
		append([]string{"id         bigint unsigned NOT NULL AUTO_INCREMENT PRIMARY KEY"}, row...),
		append(append([]string{"id         bigint unsigned NOT NULL PRIMARY KEY"}, row...), "dead_at    datetime(6)     NOT NULL"),
		"UTC_TIMESTAMP(6)", "TIMESTAMPDIFF(MICROSECOND, MIN(created_at), UTC_TIMESTAMP(6))", " FOR UPDATE SKIP LOCKED")
	// MariaDB's idle-transaction timeouts (MySQL has none; the relay finds
	// that out from the first read that names them) end a session whose
	// transaction idles while the round publishes: the round failed after
	// its publishes, and every round after it. The read says whether any is
	// set, and only then does the round turn them off while it publishes
	// and put them back before its commit (the session goes back to the
	// pool).
	s.selectBatch = outboxBatchRead(d, t.quoted(d), " FOR UPDATE SKIP LOCKED", "",
		"@@session.idle_transaction_timeout + @@session.idle_write_transaction_timeout"+
			" + @@session.idle_readonly_transaction_timeout AS idle_timeouts")
	s.idleTimeoutsOff = "SET @inbox_outbox_idle = @@session.idle_transaction_timeout," +
		" @inbox_outbox_idle_write = @@session.idle_write_transaction_timeout," +
		" @inbox_outbox_idle_readonly = @@session.idle_readonly_transaction_timeout," +
		" SESSION idle_transaction_timeout = 0, SESSION idle_write_transaction_timeout = 0, SESSION idle_readonly_transaction_timeout = 0"
	s.idleTimeoutsBack = "SET SESSION idle_transaction_timeout = @inbox_outbox_idle," +
		" SESSION idle_write_transaction_timeout = @inbox_outbox_idle_write," +
		" SESSION idle_readonly_transaction_timeout = @inbox_outbox_idle_readonly"
	// An empty payload goes as x'' when the session's EMPTY_STRING_IS_NULL
	// (MariaDB) makes NULL of the empty bind parameter, which the NOT NULL
	// column refused: every output without a payload failed its delivery.
	s.insertRow = "(?, ?, IFNULL(?, x''), ?, UTC_TIMESTAMP(6))"
	s.stillThere = mysqlStillThere(t)
	s.visibleUpTo = mysqlVisibleUpTo(d, t)
	s.rowsByID = func(ids []int64) string {
		return "SELECT " + outboxColumns + ", attempts FROM " + t.quoted(d) + " WHERE id IN (" + idList(ids) + ") ORDER BY id"
	}
	// The walk's read of a topic's next message is read from the
	// statement's snapshot, then locked (stillThere follows it), for the
	// reason lockedUpTo gives; a row another relay holds ends the walk
	// there, which is safe.
	s.nextOfTopic = strings.TrimSuffix(s.nextOfTopic, " FOR UPDATE SKIP LOCKED")
	s.deleteIDs = mysqlDeleteIDs(t)
	s.probeStatements[len(s.probeStatements)-1] = s.deleteIDs(nil)
	s.claimedInsert = mysqlClaimedInsert(t)
	// A requeue's listed dead letters are read and deleted by primary-key
	// lookups too (see mysqlDeleteIDs): with "WHERE id IN (…)" two requeues
	// of other ids scanned each other's locked rows and deadlocked.
	s.deadDelete = mysqlDeleteIDs(dead)
	// A floor (see outboxFloor): the candidate waits until no row below
	// it is locked (floorLocked).
	s.floorProbe = floorProbeSQL(d, t.quoted(d), "0", "0")
	s.floorBelow = floorBelowSQL(t.quoted(d))
	// From the top down: a range read that goes up locks the first row
	// past its end, the candidate's, which is often another relay's (a
	// row of the topics not waiting), and failed on it; down, the row
	// past the end is below the floor, a waiting topic's. ORDER BY with a
	// LIMIT, which MariaDB does not drop from a derived table.
	s.floorLocked = "SELECT COUNT(*) FROM (SELECT id FROM " + t.quoted(d) +
		" WHERE id >= ? AND id < ? ORDER BY id DESC LIMIT 18446744073709551615 FOR UPDATE NOWAIT) AS below"
	s.idsInOrder = func() (string, []any) {
		// AUTO_INCREMENT hands ids out in increasing order, whatever
		// innodb_autoinc_lock_mode, and not again after a restart
		// (MariaDB 10.2.4 and MySQL 8.0 keep the counter). Not where
		// auto_increment_increment is above 1: that is how a
		// multi-primary cluster (Galera, which sets it to the number of
		// nodes; MySQL Group Replication, 7) keeps its nodes' ids apart,
		// and a transaction still running on another node is not in this
		// one's index for the floor's check to see.
		schema := "DATABASE()"
		args := []any{t.name}
		if t.schema != "" {
			schema, args = "?", []any{t.schema, t.name}
		}
		return "SELECT CAST(EXTRA LIKE '%auto_increment%' AND @@session.auto_increment_increment = 1 AS SIGNED)" +
			" FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = " + schema + " AND TABLE_NAME = ? AND COLUMN_NAME = 'id'", args
	}
	pick := s.deadPick
	s.deadPick = func(ids []int64, n int, byTopic bool) string {
		if ids == nil {
			return pick(nil, n, byTopic)
		}
		where := ""
		if byTopic {
			where = " WHERE d.topic = ?"
		}
		return "SELECT d.id FROM JSON_TABLE('[" + strings.ReplaceAll(idList(ids), " ", "") +
			"]', '$[*]' COLUMNS (id BIGINT PATH '$')) AS picked STRAIGHT_JOIN " + dead.quoted(d) +
			" AS d ON d.id = picked.id" + where + " ORDER BY d.id FOR UPDATE"
	}
	return s
}

// mysqlClaimedInsert is outboxSQL.claimedInsert on MySQL/MariaDB. Several
// messages go through a derived table numbered in their order, so that
// their AUTO_INCREMENT ids follow it (INSERT … SELECT … ORDER BY). Its
// columns are CAST AS BINARY: without it MariaDB 10.11 types a derived
// table's bind parameters in the connection's character set and changed
// payload bytes that are not UTF-8 (a 1 MiB payload came out 2 bytes short;
// TestOutboxKeepsTheBytesAndOrderOfReturnedMessages).
func mysqlClaimedInsert(t qualifiedName) func(inboxTable string, n int, inTx bool) string {
	prefix := "INSERT INTO " + t.quoted(MySQL) + " (topic, uuid, payload, metadata, created_at) SELECT "
	return func(inboxTable string, n int, inTx bool) string {
		open := ""
		if inTx {
			open = " AND @@in_transaction = 1"
		}
		if n == 1 {
			return prefix + "?, ?, IFNULL(?, x''), ?, UTC_TIMESTAMP(6) FROM " + inboxTable +
				" WHERE consumer = ? AND message_id = ?" + open + " FOR UPDATE"
		}
		var b strings.Builder
		b.WriteString(prefix + "r.topic, r.uuid, IFNULL(r.payload, x''), r.metadata, UTC_TIMESTAMP(6) FROM (" +
			"SELECT CAST(? AS BINARY) AS topic, CAST(? AS BINARY) AS uuid, CAST(? AS BINARY) AS payload, CAST(? AS BINARY) AS metadata, 0 AS seq")
		for i := 1; i < n; i++ {
			b.WriteString(" UNION ALL SELECT CAST(? AS BINARY), CAST(? AS BINARY), CAST(? AS BINARY), CAST(? AS BINARY), " + strconv.Itoa(i))
		}
		b.WriteString(") AS r JOIN " + inboxTable + " AS c ON c.consumer = ? AND c.message_id = ?" + open +
			" ORDER BY r.seq FOR UPDATE")
		return b.String()
	}
}

func (mysqlDialect) outboxTableOptions() string { return " ENGINE=InnoDB" }

// mysqlStillThere is outboxSQL.stillThere on MySQL/MariaDB. SKIP LOCKED:
// InnoDB reads a small table by a list of ids with a scan of the whole
// table (MariaDB 10.11 plans "index" for 50 ids of 150 rows), and a locking
// scan waits for every row another relay's round holds, which then waits
// for this round's rows in its own statements: a deadlock. The rows this
// round locked are returned; a row another round holds is not this round's.
func mysqlStillThere(t qualifiedName) func(ids []int64) string {
	q := t.quoted(MySQL)
	return func(ids []int64) string {
		return "SELECT id FROM " + q + " WHERE id IN (" + idList(ids) + ") FOR UPDATE SKIP LOCKED"
	}
}

// mysqlVisibleUpTo is outboxSQL.visibleUpTo on MySQL/MariaDB. InnoDB's
// locking read checks each row's lock as its scan reaches it: a transaction
// that committed during the batch's read had its first row skipped (still
// locked then) and its later ones read, and the relay sent them a round
// before the first, nothing crashing (7 in 3,000 transactions of two
// messages); a second locking read up to the batch's end has the same race.
// A read from the statement's snapshot, after the batch's, sees such a
// transaction whole: its rows the batch skipped are there, and free to lock
// (stillThere), unless another relay holds them. (Reading the batch itself
// from a snapshot stalled a relay whose first BatchSize rows another relay
// held: it read those, found them locked, and sent nothing, every round.)
func mysqlVisibleUpTo(d Dialect, t qualifiedName) func(skipTopics bool) string {
	read := "SELECT id FROM " + t.quoted(d) + " WHERE id >= ? AND id <= ?"
	return func(skipTopics bool) string {
		if skipTopics {
			return read + " AND " + skipTopicsCondition(d) + " ORDER BY id"
		}
		return read + " ORDER BY id"
	}
}

// mysqlDeleteIDs is outboxSQL.deleteIDs on MySQL/MariaDB: the ids come from
// a JSON_TABLE read first (STRAIGHT_JOIN), each deleted by a primary-key
// lookup. "DELETE … WHERE id IN (…)" scans a small table whole (MariaDB
// 10.11 plans "ALL") and waits for the rows another relay's round holds;
// when that round then deletes its own rows, one of the two is rolled back
// as a deadlock, after its messages reached the broker, and sends them
// again (TestOutboxRelayDoesNotWaitForRowsAnotherRelayHolds). JSON_TABLE:
// MySQL 8.0.4, MariaDB 10.6, as SKIP LOCKED, which the relay needs anyway.
func mysqlDeleteIDs(t qualifiedName) func(ids []int64) string {
	q := t.quoted(MySQL)
	return func(ids []int64) string {
		return "DELETE o FROM JSON_TABLE('[" + strings.ReplaceAll(idList(ids), " ", "") +
			"]', '$[*]' COLUMNS (id BIGINT UNSIGNED PATH '$')) AS relayed STRAIGHT_JOIN " + q +
			" AS o ON o.id = relayed.id"
	}
}

func (mysqlDialect) createOutbox(ctx context.Context, db *sqlx.DB, _ qualifiedName, stmts []string) error {
	return execAll(ctx, db, stmts)
}

// The outbox tables on SQLite: AUTOINCREMENT, so an id is never reused
// after its row was deleted. SQLite has no row locks: the relay reads
// without locking, and a second relay on the same database may send a
// message again (at least once, as after a crash).
func (d sqliteDialect) outbox(t, dead qualifiedName) outboxSQL {
	s := d.outboxByID(t, dead)
	q, dq := t.quoted(d), dead.quoted(d)
	s.claimedInsert = sqliteClaimedInsert(t)
	s.byUUID = true
	s.failed = "UPDATE " + q + " SET attempts = attempts + 1, last_error = ? WHERE id = ? AND uuid = ?"
	s.waited = "UPDATE " + q + " SET last_error = ? WHERE id = ? AND uuid = ?"
	now := "CAST(unixepoch('subsec') * 1000000 AS INTEGER)"
	s.bury = "INSERT INTO " + dq + " (" + outboxColumns + ", created_at, attempts, last_error, dead_at) SELECT " + outboxColumns +
		", created_at, attempts + 1, ?, " + now + " FROM " + q + " WHERE id = ? AND uuid = ? AND NOT EXISTS (SELECT 1 FROM " + dq + " WHERE id = ?)"
	s.deadWriteLock = "DELETE FROM " + dq + " WHERE 0"
	// A floor (see outboxFloor) needs no wait on SQLite: one transaction
	// writes at a time, and an AUTOINCREMENT id is above every id committed
	// before it, so a row committed later is never below what a read saw.
	s.floorProbe = floorProbeSQL(d, q, "0", "0")
	s.floorBelow = floorBelowSQL(q)
	s.idsInOrder = func() (string, []any) {
		master := "sqlite_master"
		if t.schema != "" {
			master = d.quote(t.schema) + ".sqlite_master"
		}
		return "SELECT sql LIKE '%AUTOINCREMENT%' FROM " + master + " WHERE type = 'table' AND name = ? COLLATE NOCASE", []any{t.name}
	}
	s.deleteKeyed = func(ids []int64) string {
		// The ids first, so that SQLite finds the rows by their rowid.
		return "DELETE FROM " + q + " WHERE id IN (" + idList(ids) + ") AND (id, uuid) IN (VALUES " +
			strings.TrimSuffix(strings.Repeat("(?, ?), ", len(ids)), ", ") + ")"
	}
	return s
}

// sqliteClaimedInsert is outboxSQL.claimedInsert on SQLite: the claim's row
// read in the same statement. modernc.org/sqlite reports no transaction
// status, and SQLite rolls a whole transaction back on its own (a trigger's
// RAISE(ROLLBACK), a constraint declared ON CONFLICT ROLLBACK, SQLITE_FULL)
// as on a handler's ROLLBACK: an insert after that ran in autocommit, the
// COMMIT then failed (no transaction), and each redelivery wrote the
// outputs again under new UUIDs, which the relay sent for a message never
// processed. Without the claim's row, which went with the rollback, it
// writes nothing. SQLite has no row locks to take: its write lock, held
// since the claim, keeps the row. Several messages go through VALUES rows
// numbered in their order, so that their ids follow it.
func sqliteClaimedInsert(t qualifiedName) func(inboxTable string, n int, inTx bool) string {
	const now = "CAST(unixepoch('subsec') * 1000000 AS INTEGER)"
	prefix := "INSERT INTO " + t.quoted(SQLite) + " (topic, uuid, payload, metadata, created_at) SELECT "
	return func(inboxTable string, n int, _ bool) string {
		if n == 1 {
			return prefix + "?, ?, ?, ?, " + now + " FROM " + inboxTable + " WHERE consumer = ? AND message_id = ?"
		}
		var b strings.Builder
		b.WriteString(prefix + "r.column1, r.column2, r.column3, r.column4, " + now + " FROM (VALUES ")
		for i := range n {
			if i > 0 {
				b.WriteString(", ")
			}
			b.WriteString("(?, ?, ?, ?, " + strconv.Itoa(i) + ")")
		}
		b.WriteString(") AS r JOIN " + inboxTable + " AS c ON c.consumer = ? AND c.message_id = ? ORDER BY r.column5")
		return b.String()
	}
}

// outboxByID is the SQLite outbox's statements before byUUID.
func (d sqliteDialect) outboxByID(t, dead qualifiedName) outboxSQL {
	row := []string{
		"topic      TEXT    NOT NULL",
		"uuid       TEXT    NOT NULL",
		"payload    BLOB    NOT NULL",
		"metadata   BLOB    NOT NULL",
		"created_at INTEGER NOT NULL",
		"attempts   INTEGER NOT NULL DEFAULT 0",
		"last_error TEXT",
	}
	now := "CAST(unixepoch('subsec') * 1000000 AS INTEGER)"
	return newOutboxSQL(d, t, dead,
		append([]string{"id         INTEGER PRIMARY KEY AUTOINCREMENT"}, row...),
		append(append([]string{"id         INTEGER PRIMARY KEY"}, row...), "dead_at    INTEGER NOT NULL"),
		now, now+" - MIN(created_at)", "")
}

func (sqliteDialect) outboxTableOptions() string { return "" }

func (sqliteDialect) createOutbox(ctx context.Context, db *sqlx.DB, _ qualifiedName, stmts []string) error {
	return execAll(ctx, db, stmts)
}

// execAll runs stmts in order on db.
func execAll(ctx context.Context, db *sqlx.DB, stmts []string) error {
	for _, stmt := range stmts {
		if _, err := db.ExecContext(ctx, stmt); err != nil {
			return err
		}
	}
	return nil
}
