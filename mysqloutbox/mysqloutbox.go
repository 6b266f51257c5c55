// Package mysqloutbox makes a MySQL/MariaDB outbox's offsets follow commit
// order, so that watermill-sql's offset-based relay never skips a message.
//
// # Why
//
// watermill-sql's default MySQL subscriber (DefaultMySQLSchema with
// DefaultMySQLOffsetsAdapter, in v3 and in v4) reads the rows whose
// AUTO_INCREMENT offset is above the last offset it acked. InnoDB hands out
// AUTO_INCREMENT values when a row is inserted, not when its transaction
// commits. A transaction that took offset 93 and commits after another one
// that took 94 is invisible when the relay reads and acks 94; once it
// commits, its row sits below the acked offset and is never relayed: the
// message is lost although its row is in the outbox table. The billing
// example saw it (2 of 5 MariaDB runs lost one invoice event of 300), and
// this package's tests measure it (TestRelayOrdering).
//
// # The fix
//
// Lock.Publisher wraps the outbox publisher of one transaction. Before each
// Publish it takes a row lock (SELECT … FOR UPDATE on one row of a small
// lock table) in that transaction, held until it commits or rolls back.
// Two transactions that publish to the same topic therefore insert their
// outbox rows one after the other, and the second inserts only after the
// first has ended: offsets are assigned in commit order, and the relay
// cannot read a higher offset before a lower one is committed.
//
//	lock, err := mysqloutbox.NewLock(mysqloutbox.Config{})        // once
//	err = lock.InitializeSchema(ctx, db.DB)                       // once, at start-up
//	ib, err := inbox.New(inbox.Config{DB: db, Outbox: func(tx *sqlx.Tx) (message.Publisher, error) {
//		pub, err := wsql.NewPublisher(wsql.TxFromStdSQL(tx.Tx), wsql.PublisherConfig{SchemaAdapter: wsql.DefaultMySQLSchema{}}, logger)
//		if err != nil {
//			return nil, err
//		}
//		return lock.Publisher(tx.Tx, forwarder.NewPublisher(pub, forwarder.PublisherConfig{ForwarderTopic: "outbox"})), nil
//	}})
//
// The wrapper works with watermill-sql v3 and v4 alike: it only needs the
// *sql.Tx the outbox rows are written in (an *sqlx.Tx's Tx field).
// Wrap the outermost publisher (the forwarder's, if you use one), so that
// the lock is keyed by the topic the rows are written to.
//
// # Cost
//
// It serialises publishing transactions per lock row: from a transaction's
// first Publish until its COMMIT or ROLLBACK, every other transaction that
// publishes to a topic of the same lock row waits (InnoDB's
// innodb_lock_wait_timeout, 50 s by default, bounds the wait; it then fails
// with error 1205, a nack). Handlers still run in parallel up to their first
// publish; messages a handler returns are published right before the
// commit, so the lock is held for the publish and the COMMIT only. A
// handler that publishes through inbox.OutboxFromContext early holds it for
// the rest of its run: publish late. For publishing transactions that do
// not wait for each other, use inbox.Outbox, whose relay keeps no offset.
//
// # Rollback
//
// A transaction that rolls back releases the lock and leaves no outbox row
// and no gap the relay could trip on (a skipped AUTO_INCREMENT value is never
// a visible row). The next waiting transaction takes the lock and publishes.
//
// # What it does not cover
//
//   - Writers that do not take the lock: every transaction that inserts into
//     an outbox table read by an offset-based relay must publish through a
//     Publisher of the same Lock (same table and slots).
//   - watermill-sql's queue schema (MySQLQueueSchema), which selects every
//     unacked row instead of the rows above an offset, does not skip rows
//     and does not need this package.
//   - PostgreSQL (watermill-sql orders by transaction id) and SQLite (one
//     writer commits at a time) do not need it either.
package mysqloutbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"hash/fnv"
	"regexp"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
)

// DefaultLockTable is the lock table's name when Config.LockTable is empty.
const DefaultLockTable = "watermill_outbox_lock"

// ErrNotInitialized is wrapped by the error that Publish returns when the
// lock row for the topic is missing: InitializeSchema was not run on this
// database (or was run with fewer Slots). Match it with errors.Is.
var ErrNotInitialized = errors.New("mysqloutbox: lock row missing, run Lock.InitializeSchema")

// tableNamePattern is the inbox's rule for table names (an optional schema
// qualifier, then the name), quoted by us afterwards.
var tableNamePattern = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,62}(\.[A-Za-z_][A-Za-z0-9_]{0,62})?$`)

// Config configures a Lock.
type Config struct {
	// LockTable is the table holding the lock rows, optionally qualified by
	// its database ("app.watermill_outbox_lock"). It must match
	// ^[A-Za-z_][A-Za-z0-9_]{0,62}(\.[A-Za-z_][A-Za-z0-9_]{0,62})?$ and is
	// quoted with backticks.
	// Default: DefaultLockTable ("watermill_outbox_lock").
	LockTable string

	// Slots is how many lock rows there are; it must be 1. More slots keyed
	// a topic's lock by FNV-1a(topic) modulo Slots, but the topic a Publish
	// sees is the destination, while Watermill's forwarder writes every
	// destination into one outbox table: transactions holding different
	// slots then took offsets of that one table out of commit order, and
	// the relay skipped rows (118 of 12,000 messages lost with 8 slots and 8
	// destinations). For parallel outbox writes use inbox.Outbox, whose
	// relay keeps no offset and needs no lock.
	// Default: 1.
	Slots int
}

func (c *Config) setDefaults() {
	if c.LockTable == "" {
		c.LockTable = DefaultLockTable
	}
	if c.Slots == 0 {
		c.Slots = 1
	}
}

// Validate reports every problem of c at once (errors.Join), each wrapping
// inbox.ErrInvalidTableName where the table name is at fault. It checks c as
// given: call it after filling in the defaults, as NewLock does.
func (c Config) Validate() error {
	var errs []error
	if !tableNamePattern.MatchString(c.LockTable) {
		errs = append(errs, fmt.Errorf("%w: LockTable %q must match %s", inbox.ErrInvalidTableName, c.LockTable, tableNamePattern))
	}
	if c.Slots != 1 {
		errs = append(errs, fmt.Errorf("mysqloutbox: Config.Slots must be 1, got %d: more slots lose messages behind a forwarder"+
			" (its one table takes offsets of every slot out of commit order); use inbox.Outbox for parallel outbox writes", c.Slots))
	}
	return errors.Join(errs...)
}

// Lock serialises outbox publishes per topic in commit order. Build one per
// lock table with NewLock and share it: it is immutable and safe for
// concurrent use.
type Lock struct {
	slots  int
	ddl    []string
	lockSQ string
}

// NewLock returns a Lock for cfg. An invalid cfg fails with an error wrapping
// inbox.ErrInvalidConfig (and inbox.ErrInvalidTableName for a bad table
// name).
func NewLock(cfg Config) (*Lock, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("%w: %w", inbox.ErrInvalidConfig, err)
	}
	table := quote(cfg.LockTable)
	values := make([]string, cfg.Slots)
	for i := range values {
		values[i] = fmt.Sprintf("(%d)", i)
	}
	return &Lock{
		slots: cfg.Slots,
		ddl: []string{
			"CREATE TABLE IF NOT EXISTS " + table + " (slot INT NOT NULL PRIMARY KEY) ENGINE=InnoDB",
			"INSERT INTO " + table + " (slot) VALUES " + strings.Join(values, ", ") + " ON DUPLICATE KEY UPDATE slot = slot",
		},
		lockSQ: "SELECT slot FROM " + table + " WHERE slot = ? FOR UPDATE",
	}, nil
}

// SchemaSQL returns the statements that InitializeSchema runs, in order, for
// migration tools (goose, golang-migrate, atlas): create the lock table if
// it does not exist, then insert its rows 0 to Slots-1 where missing.
func (l *Lock) SchemaSQL() []string { return append([]string(nil), l.ddl...) }

// InitializeSchema creates the lock table and its rows where missing. It is
// idempotent and safe to run concurrently from several processes; each
// statement runs on its own (MySQL commits DDL implicitly, so do not run it
// inside a transaction). Run it at start-up, before the first message.
func (l *Lock) InitializeSchema(ctx context.Context, db *sql.DB) error {
	for _, q := range l.ddl {
		if _, err := db.ExecContext(ctx, q); err != nil {
			return fmt.Errorf("mysqloutbox: initialize schema: %w", err)
		}
	}
	return nil
}

// Publisher returns next wrapped so that each Publish first locks the
// topic's lock row in tx (SELECT … FOR UPDATE), held until tx commits or
// rolls back, then calls next. next must write to the outbox through tx;
// Publisher does not check it. The lock statement runs with the first
// message's context (context.Background() for none), as watermill-sql's
// publisher runs its insert. A lock error (a missing row: ErrNotInitialized;
// a lock wait timeout, 1205; a deadlock, 1213; a lost connection) is
// returned wrapped, next is not called, and the inbox rolls the transaction
// back (nack). Close closes next. The returned publisher is as safe for
// concurrent use as tx is (a transaction runs one statement at a time).
func (l *Lock) Publisher(tx *sql.Tx, next message.Publisher) message.Publisher {
	return &publisher{lock: l, tx: tx, next: next}
}

// slot returns the lock row of topic.
func (l *Lock) slot(topic string) int {
	if l.slots == 1 {
		return 0
	}
	h := fnv.New32a()
	_, _ = h.Write([]byte(topic)) // a hash.Hash never fails to write
	return int(h.Sum32() % uint32(l.slots))
}

// quote backtick-quotes a validated, optionally qualified table name.
func quote(name string) string {
	parts := strings.Split(name, ".")
	for i, p := range parts {
		parts[i] = "`" + p + "`"
	}
	return strings.Join(parts, ".")
}

type publisher struct {
	lock *Lock
	tx   *sql.Tx
	next message.Publisher
}

func (p *publisher) Publish(topic string, msgs ...*message.Message) error {
	ctx := context.Background()
	if len(msgs) > 0 {
		ctx = msgs[0].Context()
	}
	slot := p.lock.slot(topic)
	var got int
	err := p.tx.QueryRowContext(ctx, p.lock.lockSQ, slot).Scan(&got)
	if errors.Is(err, sql.ErrNoRows) {
		return fmt.Errorf("%w (slot %d for topic %q)", ErrNotInitialized, slot, topic)
	}
	if err != nil {
		return fmt.Errorf("mysqloutbox: lock slot %d for topic %q: %w", slot, topic, err)
	}
	return p.next.Publish(topic, msgs...)
}

func (p *publisher) Close() error { return p.next.Close() }
