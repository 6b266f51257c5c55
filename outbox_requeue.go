package inbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/jmoiron/sqlx"
)

// DeadLetterSelection chooses the dead letters that RequeueDeadLetters moves
// back to the outbox: those whose ids IDs lists, those of Topic, both (the
// listed ones on that topic), or All of them. A dead letter's id is the
// outbox id it had (the id column of Outbox.DeadLetterTable; the relay's
// log and last_error name it). The zero value selects nothing and is
// refused, so that a forgotten field cannot requeue every dead letter.
type DeadLetterSelection struct {
	// IDs are the ids of the dead letters to move. Default: none.
	IDs []int64
	// Topic, when not empty, selects the dead letters of that topic (the
	// topic they were written for). Default: "" (any topic, with IDs).
	Topic string
	// All selects every dead letter; IDs and Topic must then be empty.
	// Default: false.
	All bool
}

// requeueChunk is how many dead letters RequeueDeadLetters moves in one
// transaction: a dead-letter table of thousands moves in short
// transactions, each holding its rows' locks (and on SQLite the write
// lock) briefly, and each statement lists at most this many ids.
const requeueChunk = 500

// RequeueDeadLetters moves the dead letters sel selects from the
// dead-letter table (Outbox.DeadLetterTable) back into the outbox, where the
// relay sends them again, and returns how many it moved. Use it once the
// cause of their refusal is fixed (a topic created, a size limit raised);
// docs/operations.md has the alert that tells. Each message keeps its
// topic, UUID, payload and metadata, so a consumer whose inbox processed it
// already skips it; it gets a new outbox id (after every message written
// before the move), no attempts, and the time of the move as its age.
//
// The move runs in transactions of up to 500 dead letters, in the order of
// their ids: in each, the dead letters are copied and deleted together, so
// none is lost nor left in both tables; a dead letter that another
// RequeueDeadLetters moves at the same time is moved once (the second waits
// for the first's row locks and then finds it gone; SQLite takes the write
// lock first). A transaction that loses a race (a deadlock, a lock wait
// timeout, SQLite busy) is tried again, up to 8 times; one that outlasts
// the statement timeout is tried again with half as many dead letters. By
// Topic or All it moves the dead letters whose ids are at most the largest
// id present when it began: a message set aside during the move keeps the
// id it had in the outbox, so one written after the move began is never
// moved (a topic still refused would otherwise come back to the
// dead-letter table and be moved again, without end), and one written
// before it may or may not be, by its id and how far the move has got.
// Ids that are not in the table are left out of the count; a selection
// that finds nothing moves nothing and returns 0 and nil.
//
// Errors: an empty selection, or All beside IDs or Topic, wraps
// ErrInvalidConfig; a missing table wraps ErrTableNotFound (run
// Outbox.InitializeSchema); a dialect for another database server than
// the DB's wraps ErrDialectMismatch; others wrap the driver's, a deadlock or the
// end of ctx among them, with the number moved before it (those moves
// are committed; call it again for the rest). It wakes this process's
// relay when it moved some. Safe for concurrent use, beside the relay and
// the writers, and from several processes.
func (o *Outbox) RequeueDeadLetters(ctx context.Context, sel DeadLetterSelection) (int, error) {
	if err := sel.validate(); err != nil {
		return 0, err
	}
	if err := o.checkServer(ctx); err != nil {
		return 0, fmt.Errorf("inbox: requeue dead letters: %w", err)
	}
	t, err := o.pinTarget(ctx)
	if err != nil {
		return 0, fmt.Errorf("inbox: requeue dead letters: %w", err)
	}
	if o.pinned.Load() == nil {
		return 0, fmt.Errorf("inbox: requeue dead letters: %w: outbox table %s is not on the search_path:"+
			" run Outbox.InitializeSchema, or apply Outbox.SchemaSQL with your migrations", ErrTableNotFound, o.configured.table)
	}
	moved, err := o.requeue(ctx, t, sel)
	if moved > 0 {
		select {
		case o.wake <- struct{}{}:
		default:
		}
	}
	if err != nil && moved == 0 && ctx.Err() == nil {
		// A missing table told from the catalog, never from the error's
		// text.
		if verr := o.Verify(ctx); errors.Is(verr, ErrTableNotFound) {
			return 0, fmt.Errorf("inbox: requeue dead letters: %w", verr)
		}
	}
	return moved, err
}

// RequeueDeadLetters moves the dead letters sel selects back into the
// outbox table on db, as Outbox.RequeueDeadLetters does, without an Outbox
// (which needs a Publisher): for tools that look after an outbox they do
// not relay, such as the inbox command. d nil: inferred from db's driver
// name; table "": DefaultOutboxTable. Errors as Outbox.RequeueDeadLetters',
// and an invalid table name wraps ErrInvalidTableName. A relay of another
// process finds the moved messages at its next round (PollInterval at the
// latest). Safe for concurrent use.
func RequeueDeadLetters(ctx context.Context, db *sqlx.DB, d Dialect, table string, sel DeadLetterSelection) (int, error) {
	if db == nil {
		return 0, errors.New("inbox: RequeueDeadLetters needs a DB")
	}
	if table == "" {
		table = DefaultOutboxTable
	}
	inferred := d == nil
	d, t, err := resolveTarget(db, d, table)
	if err != nil {
		return 0, err
	}
	o := newOutbox(OutboxConfig{DB: db, Dialect: d, Table: table}, t)
	o.dialectInferred = inferred
	return o.RequeueDeadLetters(ctx, sel)
}

// validate refuses a selection of nothing, and All beside IDs or Topic.
func (sel DeadLetterSelection) validate() error {
	switch {
	case sel.All && (len(sel.IDs) > 0 || sel.Topic != ""):
		return fmt.Errorf("%w: DeadLetterSelection: All selects every dead letter: leave IDs and Topic empty", ErrInvalidConfig)
	case !sel.All && len(sel.IDs) == 0 && sel.Topic == "":
		return fmt.Errorf("%w: DeadLetterSelection selects nothing: set IDs, Topic or All", ErrInvalidConfig)
	}
	return nil
}

// requeue moves sel's dead letters in chunks of up to requeueChunk, each
// in a transaction of its own, and returns how many it moved. A chunk
// that lost a race (a deadlock with another requeue on MySQL/MariaDB,
// where a locking read scans rows the other holds; SQLite busy) is rolled
// back whole and tried again, up to requeueConflictTries times; one that
// outlasted the statement timeout (large dead letters: they are often the
// messages refused for their size) is tried again at half the size, as
// the relay's reads are (Outbox.readTimedOutAt), down to one.
func (o *Outbox) requeue(ctx context.Context, t *outboxTarget, sel DeadLetterSelection) (int, error) {
	db := o.cfg.DB
	byTopic := sel.Topic != ""
	size := requeueChunk
	moved := 0
	// chunk moves one chunk: the ids of ids (IDs), or the first size ids
	// after after (Topic, All); it returns how many it moved and the
	// largest, once it succeeded or gave up.
	chunk := func(ids []int64, after, last int64) (int, int64, error) {
		for tries := 1; ; tries++ {
			var pick string
			args := []any{}
			if ids != nil {
				pick = t.sql.deadPick(ids, len(ids), byTopic)
			} else {
				pick = t.sql.deadPick(nil, size, byTopic)
				args = append(args, after, last)
			}
			if byTopic {
				args = append(args, sel.Topic)
			}
			n, end, err := o.requeueChunk(ctx, db, t, db.Rebind(pick), args)
			switch {
			case err == nil || ctx.Err() != nil:
				return n, end, err
			case isStatementTimeout(err) && size > 1 && (ids == nil || len(ids) > 1):
				size = max(size/2, 1)
				if ids != nil {
					// The caller goes on with the rest at the new size.
					return 0, 0, errChunkTooLarge
				}
				tries = 0
			case isConflict(err) && tries < requeueConflictTries:
				select {
				case <-ctx.Done():
					return 0, 0, err
				case <-time.After(time.Duration(tries) * 20 * time.Millisecond):
				}
			default:
				return n, end, err
			}
		}
	}
	if len(sel.IDs) > 0 {
		ids := slices.Clone(sel.IDs)
		slices.Sort(ids)
		ids = slices.Compact(ids)
		for len(ids) > 0 {
			part := ids[:min(len(ids), size)]
			n, _, err := chunk(part, 0, 0)
			if errors.Is(err, errChunkTooLarge) {
				continue // again, at the smaller size
			}
			moved += n
			if err != nil {
				return moved, err
			}
			ids = ids[len(part):]
		}
		return moved, nil
	}
	// By Topic or All: the dead letters up to the largest id present now.
	var last sql.NullInt64
	if err := db.QueryRowxContext(ctx, t.sql.deadLast).Scan(&last); err != nil {
		return 0, fmt.Errorf("inbox: requeue dead letters: read the last dead letter's id: %w", err)
	}
	if !last.Valid {
		return 0, nil
	}
	after := int64(math.MinInt64)
	for {
		n, end, err := chunk(nil, after, last.Int64)
		moved += n
		if err != nil || n == 0 {
			return moved, err
		}
		after = end
	}
}

// requeueConflictTries bounds the tries of a requeue's chunk that keeps
// losing races.
const requeueConflictTries = 8

// errChunkTooLarge tells requeue's loop over listed ids that the chunk
// outlasted the statement timeout and is to be tried again smaller.
var errChunkTooLarge = errors.New("inbox: requeue chunk too large for the statement timeout")

// requeueChunk moves, in one transaction, the dead letters that pick (a
// locking read of their ids, with args) returns: copied into the outbox in
// the order of their ids, then deleted. It returns how many it moved and
// the largest id among them.
func (o *Outbox) requeueChunk(ctx context.Context, db *sqlx.DB, t *outboxTarget, pick string, args []any) (n int, last int64, err error) {
	var tx *sqlx.Tx
	if t.sql.deadWriteLock != "" {
		// SQLite: behind this process's other writers (see writerQueue).
		place, err := sqliteWriterQueue(db.DB).enter(ctx)
		if err != nil {
			return 0, 0, fmt.Errorf("inbox: requeue dead letters: begin: %w", err)
		}
		defer place.leave()
		if tx, err = db.BeginTxx(ctx, nil); err != nil {
			return 0, 0, fmt.Errorf("inbox: requeue dead letters: begin: %w", err)
		}
		defer tx.Rollback() //nolint:errcheck // no-op after Commit
		if _, err := tx.ExecContext(ctx, t.sql.deadWriteLock); err != nil {
			return 0, 0, fmt.Errorf("inbox: requeue dead letters: take the write lock: %w", err)
		}
	} else {
		// READ COMMITTED: on MySQL/MariaDB the locking read then takes no
		// gap locks, which would hold back the relay's moves to the
		// dead-letter table meanwhile.
		if tx, err = db.BeginTxx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted}); err != nil {
			return 0, 0, fmt.Errorf("inbox: requeue dead letters: begin: %w", err)
		}
		defer tx.Rollback() //nolint:errcheck // no-op after Commit
	}
	var ids []int64
	if err := tx.SelectContext(ctx, &ids, pick, args...); err != nil {
		return 0, 0, fmt.Errorf("inbox: requeue dead letters: read %s: %w", t.dead.quoted(o.dialect), err)
	}
	if len(ids) == 0 {
		return 0, 0, nil
	}
	res, err := tx.ExecContext(ctx, t.sql.requeue(ids))
	if err != nil {
		return 0, 0, fmt.Errorf("inbox: requeue dead letters: copy %d of them to %s: %w", len(ids), t.table.quoted(o.dialect), err)
	}
	if err := sameCount(res, len(ids), "copied"); err != nil {
		return 0, 0, fmt.Errorf("inbox: requeue dead letters: %w", err)
	}
	if res, err = tx.ExecContext(ctx, t.sql.deadDelete(ids)); err != nil {
		return 0, 0, fmt.Errorf("inbox: requeue dead letters: delete %d of them: %w", len(ids), err)
	}
	if err := sameCount(res, len(ids), "deleted"); err != nil {
		return 0, 0, fmt.Errorf("inbox: requeue dead letters: %w", err)
	}
	if err := tx.Commit(); err != nil {
		return 0, 0, fmt.Errorf("inbox: requeue dead letters: commit: %w", err)
	}
	return len(ids), ids[len(ids)-1], nil
}

// sameCount checks that res affected want rows: the rows the locking read
// returned are held until the commit, so another count is a table that
// does not behave as the outbox's (a trigger, a rule), and the transaction
// is rolled back.
func sameCount(res sql.Result, want int, what string) error {
	got, err := res.RowsAffected()
	if err != nil {
		return err
	}
	if got != int64(want) {
		return fmt.Errorf("%d rows %s where %d were read: rolled back", got, what, want)
	}
	return nil
}
