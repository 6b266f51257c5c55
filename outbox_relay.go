package inbox

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
)

// outboxRetryFirst is the first wait after a failed relay round; it doubles
// up to OutboxConfig.MaxBackoff.
const outboxRetryFirst = 50 * time.Millisecond

// Run relays the outbox until ctx ends, then returns nil (the error result
// is for the router-plugin and errgroup shapes). A round reads up to
// BatchSize messages, publishes them and deletes their rows; a full round
// is followed by the next at once, a short one by a wait for a commit of
// this process (through an Inbox whose Config.Outbox is ob.Publisher) or
// for PollInterval. A failed round is logged, reported to OnRound and
// retried after a backoff. Run one relay per process; several processes
// may each run one on the same table (see Outbox).
func (o *Outbox) Run(ctx context.Context) error {
	o.relayStarted.Store(true)
	var backoff time.Duration
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		o.prepareInsertOne(ctx)
		round := o.RelayOnce(ctx)
		if ctx.Err() != nil {
			return nil
		}
		wait, wake := o.cfg.PollInterval, o.wake
		switch {
		case round.Err != nil:
			backoff = min(max(2*backoff, outboxRetryFirst), o.cfg.MaxBackoff)
			wait, wake = backoff, nil // a commit does not cut a backoff short
		case round.Relayed+round.DeadLettered >= o.cfg.BatchSize:
			backoff = 0
			continue
		default:
			backoff = 0
		}
		timer.Reset(wait)
		select {
		case <-ctx.Done():
			return nil
		case <-wake:
			if !timer.Stop() {
				<-timer.C
			}
			// Gather the commits of the next moment into this round: one
			// round per commit would cost the database a transaction for
			// every message, beside the handlers'.
			if o.cfg.Linger > 0 {
				timer.Reset(o.cfg.Linger)
				select {
				case <-ctx.Done():
					return nil
				case <-timer.C:
				}
			}
		case <-timer.C:
		}
	}
}

// RouterPlugin checks the outbox tables (Verify, bounded by VerifyTimeout)
// and then runs the relay (Run) for as long as the router runs: add it with
// router.AddPlugin(ob.RouterPlugin), and router.Run returns Verify's error
// (errors.Is matches ErrTableNotFound) instead of starting handlers whose
// every output would fail. The relay starts once the router is running and
// stops within a second of the router closing, cancelling a round in
// progress (whose messages are sent again later). Router plugins run once,
// in router.Run, before its handlers start (a Watermill convention).
func (o *Outbox) RouterPlugin(r *message.Router) error {
	ctx, cancel := context.WithTimeout(context.Background(), VerifyTimeout)
	defer cancel()
	if err := o.Verify(ctx); err != nil {
		return err
	}
	runWhileRouterRuns(r, o.logger, "Inbox outbox relay", func(ctx context.Context) { _ = o.Run(ctx) })
	return nil
}

// Verify checks that the outbox table and its dead-letter table exist and
// that the relay can read the outbox: an error wrapping ErrTableNotFound
// (run InitializeSchema, or apply SchemaSQL) or the driver's error. It
// reads the catalog and no row, in one short transaction.
func (o *Outbox) Verify(ctx context.Context) error {
	err := withReadTx(ctx, o.cfg.DB, o.dialect, func(q sqlx.QueryerContext) error {
		for _, t := range []qualifiedName{o.table, o.dead} {
			if _, err := o.dialect.checkTable(ctx, q, t); errors.Is(err, ErrTableNotFound) {
				return fmt.Errorf("%w: outbox table %q does not exist: run Outbox.InitializeSchema, or apply Outbox.SchemaSQL"+
					" with your migrations", ErrTableNotFound, t.String())
			}
		}
		rows, err := q.QueryxContext(ctx, o.sql.probe)
		if err != nil {
			return fmt.Errorf("inbox: outbox table %q cannot be read by the relay (compare with Outbox.SchemaSQL): %w", o.table, err)
		}
		return rows.Close()
	})
	return poolerHint(err)
}

// outboxRow is one message read by the relay.
type outboxRow struct {
	ID       int64  `db:"id"`
	Topic    string `db:"topic"`
	UUID     string `db:"uuid"`
	Payload  []byte `db:"payload"`
	Metadata []byte `db:"metadata"`
	Attempts int    `db:"attempts"`
}

// outboxBatch is what a round decided for the rows it read.
type outboxBatch struct {
	sent   []int64             // published: delete
	failed map[int64]error     // refused: count the attempt
	bury   map[int64]error     // refused for the last time while the broker accepts its topic
	rows   map[int64]outboxRow // by id
}

// RelayOnce runs one relay round now: read up to BatchSize messages, publish
// them, delete the rows of those the broker accepted, count a failed
// attempt for the others (setting aside those that used their last one),
// and report the outcome to OnRound. On PostgreSQL and MySQL/MariaDB it all
// happens in one transaction that locks the rows it read (FOR UPDATE SKIP
// LOCKED), so a relay that dies before the commit leaves them to be sent
// again; on SQLite the rows are read without a lock and deleted in a short
// transaction after the publishes.
func (o *Outbox) RelayOnce(ctx context.Context) OutboxRound {
	start := time.Now()
	round := o.relay(ctx)
	round.Duration = time.Since(start)
	if round.Err != nil && ctx.Err() == nil {
		o.logger.Error("Inbox outbox relay round failed", round.Err, watermill.LogFields{
			"relayed": round.Relayed, "failed": round.Failed, "dead_lettered": round.DeadLettered,
		})
	}
	if o.cfg.OnRound != nil && (round.Relayed+round.Failed+round.DeadLettered > 0 || round.Err != nil) {
		o.cfg.OnRound(round)
	}
	return round
}

func (o *Outbox) relay(ctx context.Context) (round OutboxRound) {
	db := o.cfg.DB
	var read sqlx.QueryerContext = db
	var tx *sqlx.Tx
	if o.sql.locks {
		var err error
		// READ COMMITTED: on MySQL/MariaDB the locking read then takes no
		// gap locks, which would hold back the handlers' outbox inserts.
		if tx, err = db.BeginTxx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted}); err != nil {
			return OutboxRound{Err: fmt.Errorf("inbox: outbox relay: begin: %w", err)}
		}
		defer tx.Rollback() //nolint:errcheck // no-op after Commit
		read = tx
	}
	var rows []outboxRow
	if err := sqlx.SelectContext(ctx, read, &rows, o.sql.selectBatch(o.cfg.BatchSize)); err != nil {
		return OutboxRound{Err: fmt.Errorf("inbox: outbox relay: read: %w", err)}
	}
	if len(rows) > 0 && o.sql.stillThere != nil {
		var err error
		if rows, err = o.keepExisting(ctx, read, rows); err != nil {
			return OutboxRound{Err: fmt.Errorf("inbox: outbox relay: read: %w", err)}
		}
	}
	if len(rows) == 0 {
		return round
	}
	b := o.publish(rows)
	round.Failed = len(b.failed) + len(b.bury)
	if tx == nil {
		// SQLite: queued behind this process's other writers (see
		// writerQueue), not polling for the write lock against them.
		place, err := sqliteWriterQueue(db.DB).enter(ctx)
		if err != nil {
			return OutboxRound{Failed: round.Failed, Err: fmt.Errorf("inbox: outbox relay: begin: %w", err)}
		}
		defer place.leave()
		if tx, err = db.BeginTxx(ctx, nil); err != nil {
			return OutboxRound{Failed: round.Failed, Err: fmt.Errorf("inbox: outbox relay: begin: %w", err)}
		}
		defer tx.Rollback() //nolint:errcheck // no-op after Commit
	}
	if err := o.record(ctx, tx, b); err != nil {
		return OutboxRound{Failed: round.Failed, Err: err}
	}
	if err := tx.Commit(); err != nil {
		// Published but not deleted: the next round sends them again.
		return OutboxRound{Failed: round.Failed, Err: fmt.Errorf("inbox: outbox relay: commit: %w", err)}
	}
	round.Relayed, round.DeadLettered = len(b.sent), len(b.bury)
	for id, err := range b.bury {
		r := b.rows[id]
		o.logger.Error("Inbox outbox message set aside in the dead-letter table after its last attempt", err, watermill.LogFields{
			"message_uuid": r.UUID, "topic": r.Topic, "attempts": r.Attempts + 1,
		})
	}
	if len(b.failed)+len(b.bury) > 0 {
		var errs []error
		for id, err := range b.failed {
			errs = append(errs, fmt.Errorf("message %s to %q: %w", b.rows[id].UUID, b.rows[id].Topic, err))
		}
		for id, err := range b.bury {
			errs = append(errs, fmt.Errorf("message %s to %q (set aside): %w", b.rows[id].UUID, b.rows[id].Topic, err))
		}
		round.Err = fmt.Errorf("inbox: outbox relay: the broker refused %d messages: %w", len(errs), errors.Join(errs...))
	}
	return round
}

// keepExisting returns the rows that the locking read stillThere finds.
func (o *Outbox) keepExisting(ctx context.Context, q sqlx.QueryerContext, rows []outboxRow) ([]outboxRow, error) {
	ids := make([]int64, len(rows))
	for i, r := range rows {
		ids[i] = r.ID
	}
	var there []int64
	if err := sqlx.SelectContext(ctx, q, &there, o.sql.stillThere(ids)); err != nil {
		return nil, err
	}
	exists := make(map[int64]bool, len(there))
	for _, id := range there {
		exists[id] = true
	}
	kept := rows[:0]
	for _, r := range rows {
		if exists[r.ID] {
			kept = append(kept, r)
		}
	}
	return kept, nil
}

// publish sends rows to the broker, topic by topic, each topic's messages
// in id order: first all at once, and when that fails one by one up to the
// first the broker refuses, which keeps the rest of its topic for a later
// round. A message refused on its last attempt is set aside only if the
// next message of its topic is then accepted (the broker takes that topic,
// so the message itself is the problem) and the refusal does not wrap
// ErrBrokerUnavailable (a partition without a leader while its topic's
// other partitions take messages); otherwise it stays first in line with
// its last attempt left.
func (o *Outbox) publish(rows []outboxRow) outboxBatch {
	b := outboxBatch{failed: map[int64]error{}, bury: map[int64]error{}, rows: make(map[int64]outboxRow, len(rows))}
	var topics []string
	byTopic := map[string][]outboxRow{}
	for _, r := range rows {
		b.rows[r.ID] = r
		if _, ok := byTopic[r.Topic]; !ok {
			topics = append(topics, r.Topic)
		}
		byTopic[r.Topic] = append(byTopic[r.Topic], r)
	}
	for _, topic := range topics {
		group := byTopic[topic]
		msgs, err := decodeOutboxRows(group)
		if err == nil {
			err = o.cfg.Publisher.Publish(topic, msgs...)
		}
		if err == nil {
			for _, r := range group {
				b.sent = append(b.sent, r.ID)
			}
			continue
		}
		// One by one, to find the message the broker refuses. Those sent
		// before it in the failed call go again: at least once.
		for i, r := range group {
			err := o.publishOne(r)
			if err == nil {
				b.sent = append(b.sent, r.ID)
				continue
			}
			if r.Attempts+1 < o.cfg.MaxAttempts || errors.Is(err, ErrBrokerUnavailable) {
				// Attempts left, or the broker's state rather than the
				// message's: it stays first in line.
				b.failed[r.ID] = err
				break
			}
			if i+1 < len(group) && o.publishOne(group[i+1]) == nil {
				// Its successor went through: the message, not the broker,
				// is the problem. The successor counts as sent.
				// The rest of the topic waits for the next round, in order.
				b.bury[r.ID] = err
				b.sent = append(b.sent, group[i+1].ID)
				break
			}
			b.failed[r.ID] = err // stays first in line
			break
		}
	}
	return b
}

// publishOne publishes one row to its topic.
func (o *Outbox) publishOne(r outboxRow) error {
	msgs, err := decodeOutboxRows([]outboxRow{r})
	if err != nil {
		return err
	}
	return o.cfg.Publisher.Publish(r.Topic, msgs...)
}

// decodeOutboxRows returns the messages of rows, with their UUIDs, payloads
// and metadata as they were written.
func decodeOutboxRows(rows []outboxRow) ([]*message.Message, error) {
	msgs := make([]*message.Message, len(rows))
	for i, r := range rows {
		m := message.NewMessage(r.UUID, r.Payload)
		if err := json.Unmarshal(r.Metadata, &m.Metadata); err != nil {
			return nil, fmt.Errorf("metadata of message %s (outbox id %d): %w", r.UUID, r.ID, err)
		}
		if m.Metadata == nil {
			m.Metadata = message.Metadata{}
		}
		msgs[i] = m
	}
	return msgs, nil
}

// record deletes the sent rows, counts the failed attempts and moves the
// rows set aside to the dead-letter table, in tx.
func (o *Outbox) record(ctx context.Context, tx *sqlx.Tx, b outboxBatch) error {
	for start := 0; start < len(b.sent); start += outboxInsertChunk {
		ids := b.sent[start:min(len(b.sent), start+outboxInsertChunk)]
		if _, err := tx.ExecContext(ctx, o.sql.deleteIDs(ids)); err != nil {
			return fmt.Errorf("inbox: outbox relay: delete %d relayed rows: %w", len(ids), err)
		}
	}
	for id, perr := range b.failed {
		if _, err := tx.ExecContext(ctx, tx.Rebind(o.sql.failed), perr.Error(), id); err != nil {
			return fmt.Errorf("inbox: outbox relay: count a failed attempt: %w", err)
		}
	}
	for id, perr := range b.bury {
		if _, err := tx.ExecContext(ctx, tx.Rebind(o.sql.bury), perr.Error(), id); err != nil {
			return fmt.Errorf("inbox: outbox relay: set aside outbox id %d: %w", id, err)
		}
		if _, err := tx.ExecContext(ctx, o.sql.deleteIDs([]int64{id})); err != nil {
			return fmt.Errorf("inbox: outbox relay: set aside outbox id %d: %w", id, err)
		}
	}
	return nil
}
