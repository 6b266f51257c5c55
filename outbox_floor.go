package inbox

import (
	"context"
	"database/sql"
	"errors"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jmoiron/sqlx"
)

// outboxFloor lets a relay round skip, on every database, the rows
// of the topics that wait for their next try at the head of the table. The
// rounds leave those rows out of their reads, but a read in id order still
// passed over every one of them (the table has no index on topic, which
// would cost every output's INSERT): behind 1,000,000 rows of a topic the
// broker cannot take (a deleted topic: ErrBrokerUnavailable, never set
// aside) the other topics went out at 3,471 msgs/s instead of 74,104 on
// PostgreSQL, and with a statement timeout shorter than such a read, not at
// all.
//
// The floor is an id below which every row is of a topic in topics: the
// rounds read from it while every one of those topics waits. Finding it
// takes care, since ids are taken when a row is written and rows become
// visible when their transaction commits: a transaction that took a smaller
// id than a row the relay saw can commit after the relay looked, and a
// floor set past that row would have left it behind, sent only after the
// later messages of its topic (of its consumed partition). A candidate, the
// smallest id of the other topics a probe saw (or the largest id plus one
// when it saw none), becomes the floor once no transaction can still commit
// a row below it, and the floor is then the smaller of the candidate and
// what the probe of that later round sees.
//   - PostgreSQL: once every transaction that had a transaction id at the
//     probe has ended: the oldest running id (the snapshot's xmin) has
//     reached the one the round's transaction took at the probe, after its
//     snapshot (not the snapshot's xmax, the last ended id plus one: a
//     transaction that took its id after the last one to end runs beyond
//     it). Every outbox id below the candidate was taken before the probe
//     (a sequence of cache 1 hands them out in order) by a transaction that
//     had written a row already (the inbox's claim comes first), so by one
//     of those. A probe from the head of the table every outboxFloorSweep
//     covers what that does not: an outbox written in a transaction of the
//     user's own whose first write it is, whose outbox id can be taken a
//     moment before its transaction id.
//   - SQLite: at the next round: one transaction writes at a time, and an
//     AUTOINCREMENT id is above every id committed before it, so a row
//     committed after the probe is above every row it saw.
//   - MySQL/MariaDB (which tell which transactions run only to users with
//     the PROCESS privilege): once a locking read, NOWAIT, of the rows from
//     the floor to below the candidate, in a transaction of its own before
//     a later round's, finds none locked (floorLocked), no sooner than
//     outboxFloorLockedAge after the probe. InnoDB keeps a row inserted and
//     not committed in the index, locked: the read, which sees it where the
//     probe's snapshot does not, fails on it. An id below the candidate
//     was taken before the probe (AUTO_INCREMENT hands them out in
//     increasing order), and its row is in the index a moment later, in
//     the same INSERT; the age covers that moment. An INSERT that waits
//     longer between the two (for a lock another transaction holds at the
//     end of the table) is found by the probe from the head every
//     outboxFloorSweep.
//
// The probe reads without a lock, so the rows another relay instance holds
// count as present. Guarded by the Outbox's round turn (relaying).
type outboxFloor struct {
	from    int64           // 0: none
	topics  map[string]bool // the topics whose rows may lie below from
	pending *outboxFloorCandidate
	swept   time.Time // the last read from the head with the floor's bookkeeping
	// off: the table's ids are not handed out in order (idsInOrder: a
	// hand-made table); checked is whether that was looked at, at
	// checkedAt (again every outboxFloorSweep).
	off, checked bool
	checkedAt    time.Time
	// probeFailed: the last probe failed, and the log said so;
	// checkFailed: the last check of a candidate (checkFloorCandidate)
	// failed otherwise than on a locked row, and the log said so.
	probeFailed, checkFailed bool
	// belowID and belowUUID are the last row below from when it was set
	// (0: none): each probe reads it again, and any other row there means
	// that the ids started again (the table re-created, TRUNCATE …
	// RESTART IDENTITY), a row committed late, or a waiting topic's row
	// deleted: the floor starts over.
	belowID   int64
	belowUUID string
}

// outboxFloorCandidate is a floor that waits for the transactions that ran
// at its probe to end: id, below which every row the probe saw was of
// topics, and horizon, the id the probe's transaction took after its
// snapshot, above every id taken before.
type outboxFloorCandidate struct {
	id, horizon int64
	topics      map[string]bool
	// MySQL/MariaDB (floorLocked): when the probe found it, when it was
	// last checked, and whether the check found no row below it locked.
	found, checked time.Time
	cleared        bool
	// belowID and belowUUID: the last row below id when the probe found
	// it, read when there is no floor yet; that row gone when it is to be
	// promoted (the ids started again) starts over.
	belowID   int64
	belowUUID string
}

// errNoRowBelow: a candidate with no row below it, not kept.
var errNoRowBelow = errors.New("no row below the candidate")

// outboxFloorSweep is how often a round's probe reads from the head of the
// table although a floor is set (a variable for the tests).
var outboxFloorSweep = 30 * time.Second

// outboxFloorLockedAge is how long after its probe a candidate is first
// checked on MySQL/MariaDB, and then how often (see outboxFloor).
var outboxFloorLockedAge = time.Second

// reset forgets the floor and its candidate.
func (f *outboxFloor) reset() {
	f.from, f.topics, f.pending, f.swept = 0, nil, nil, time.Time{}
	f.belowID, f.belowUUID = 0, ""
}

// anchor reads the last row below the floor (see outboxFloor.belowID), in
// tx on PostgreSQL, right after the probe that set it: the table cannot be
// truncated or dropped in between (the probe's read holds its lock until
// the round ends). A failed read starts the floor over.
func (o *Outbox) anchor(ctx context.Context, q sqlx.QueryerContext, tx *sqlx.Tx) {
	f := &o.floor
	id, uuid, err := o.lastRowBelow(ctx, q, tx, f.from)
	if err != nil {
		f.reset()
		return
	}
	f.belowID, f.belowUUID = id, uuid
}

// lastRowBelow reads the id and uuid of the last row below id (0 and "":
// none), in tx on PostgreSQL.
func (o *Outbox) lastRowBelow(ctx context.Context, q sqlx.QueryerContext, tx *sqlx.Tx, id int64) (int64, string, error) {
	var below sql.NullInt64
	var uuid sql.NullString
	err := o.readInWalk(ctx, tx, func() error {
		err := q.QueryRowxContext(ctx, o.cfg.DB.Rebind(o.target().sql.floorBelow), id).Scan(&below, &uuid)
		if errors.Is(err, sql.ErrNoRows) {
			return nil
		}
		return err
	})
	return below.Int64, uuid.String, err
}

// floorRead is what a round does with the floor: read from from (0: from
// the head), and, when track, probe from probeFrom for the next floor.
type floorRead struct {
	from, probeFrom int64
	track           bool
	// waiting is the set of topics the round leaves out.
	waiting map[string]bool
}

// topicsWithin reports whether every topic whose rows may lie below the floor or
// its candidate is in topics.
func (f *outboxFloor) topicsWithin(topics map[string]bool) bool {
	return subsetOf(f.topics, topics) && (f.pending == nil || subsetOf(f.pending.topics, topics))
}

// subsetOf reports whether every topic of a is in b.
func subsetOf(a, b map[string]bool) bool {
	for t := range a {
		if !b[t] {
			return false
		}
	}
	return true
}

// union returns the topics of a and b in a new set.
func union(a, b map[string]bool) map[string]bool {
	u := make(map[string]bool, len(a)+len(b))
	for t := range a {
		u[t] = true
	}
	for t := range b {
		u[t] = true
	}
	return u
}

// floorFor returns what the round that leaves waiting out does with the
// floor, all being every topic with a wait (due or not), tx the round's
// transaction. Called with the round's turn.
func (o *Outbox) floorFor(ctx context.Context, q sqlx.QueryerContext, tx *sqlx.Tx, waiting []any, all map[string]bool) floorRead {
	f := &o.floor
	if o.target().sql.floorProbe == "" || len(all) == 0 {
		f.reset()
		return floorRead{}
	}
	if len(waiting) == 0 {
		// Every refused topic is tried this round: from the head, and the
		// floor kept for the rounds after, when they wait again. (Reset,
		// it cost two or three reads past the whole backlog after each
		// try, every MaxBackoff.)
		return floorRead{}
	}
	if f.checked && time.Since(f.checkedAt) >= outboxFloorSweep {
		// Looked at again every while: a sequence given a cache, a
		// cluster grown to several primaries.
		f.checked = false
	}
	if !f.checked {
		var inOrder sql.NullInt64
		query, args := o.target().sql.idsInOrder()
		err := o.readInWalk(ctx, tx, func() error {
			err := q.QueryRowxContext(ctx, o.cfg.DB.Rebind(query), args...).Scan(&inOrder)
			if errors.Is(err, sql.ErrNoRows) {
				return nil
			}
			return err
		})
		if err != nil {
			return floorRead{} // looked at again next round
		}
		f.checked, f.checkedAt = true, time.Now()
		wasOff := f.off
		f.off = inOrder.Int64 != 1
		if f.off && !wasOff {
			f.reset()
			o.logger.get().Info("Inbox outbox relay reads past the waiting topics' rows from the head of the table:"+
				" the table's ids are not handed out in increasing order (PostgreSQL: a sequence with CACHE above 1;"+
				" SQLite: no AUTOINCREMENT; MySQL/MariaDB: no AUTO_INCREMENT, or an auto_increment_increment above 1, as in a"+
				" multi-primary cluster)", nil)
		}
	}
	if f.off {
		return floorRead{}
	}
	now := make(map[string]bool, len(waiting))
	for _, t := range waiting {
		now[t.(string)] = true
	}
	if !f.topicsWithin(all) {
		// A topic whose rows may lie below is no longer refused.
		f.reset()
	}
	if !f.topicsWithin(now) {
		// A topic whose rows may lie below is tried this round: from the
		// head, where its rows are, and the floor kept for the rounds
		// after.
		return floorRead{}
	}
	r := floorRead{from: f.from, probeFrom: f.from, track: true, waiting: now}
	if f.from > 0 && time.Since(f.swept) >= outboxFloorSweep {
		r.probeFrom = 0
	}
	if r.probeFrom == 0 {
		f.swept = time.Now()
	}
	return r
}

// probeFloor runs the round's floor probe (see outboxFloor) on q (in tx on
// PostgreSQL, its first statement that takes a transaction id, before the
// round's locking read), moves the floor, and returns what the round reads
// from: r, or the head of the table when the probe found that the ids
// started again. A probe that fails (a statement timeout) leaves the floor
// as it was and the round's transaction usable.
func (o *Outbox) probeFloor(ctx context.Context, q sqlx.QueryerContext, tx *sqlx.Tx, r floorRead, skipArgs []any) floorRead {
	if !r.track {
		return r
	}
	f := &o.floor
	if f.pending != nil && o.target().sql.floorLocked != "" && !f.pending.cleared && f.from == 0 {
		// No floor yet, and the candidate waits for its check (see
		// checkFloorCandidate): until then the probe would read past the
		// waiting rows once more for nothing.
		return r
	}
	if f.pending != nil && o.target().sql.floorXmin != "" && f.from == 0 {
		// No floor yet, and the candidate waits for the transactions that
		// ran at its probe: until they have ended, the probe would read
		// past the waiting rows once more for nothing (the round's read,
		// from the head, does). With a floor, the probe reads from it, and
		// looks at the first row (the ids may have started again).
		var xmin int64
		err := o.readInWalk(ctx, tx, func() error {
			return q.QueryRowxContext(ctx, o.target().sql.floorXmin).Scan(&xmin)
		})
		if err != nil || xmin < f.pending.horizon {
			return r
		}
	}
	var firstOther, last, below sql.NullInt64
	var belowUUID sql.NullString
	var xmin, horizon int64
	// The last row below the floor; with no floor yet, the row the
	// candidate kept (the last one up to it).
	belowOf := f.from
	if f.from == 0 && f.pending != nil {
		belowOf = f.pending.belowID + 1
	}
	args := append(append([]any{r.probeFrom}, skipArgs...), belowOf)
	err := o.readInWalk(ctx, tx, func() error {
		return q.QueryRowxContext(ctx, o.cfg.DB.Rebind(o.target().sql.floorProbe), args...).Scan(&firstOther, &last, &below, &belowUUID, &xmin, &horizon)
	})
	if err != nil {
		if ctx.Err() == nil && !f.probeFailed {
			f.probeFailed = true // said once until a probe succeeds
			o.logger.get().Info("Inbox outbox relay could not look for where the waiting topics' rows end: its floor stays where it is", watermill.LogFields{
				"err": err.Error(),
			})
		}
		return r
	}
	f.probeFailed = false
	if f.from > 0 && (below.Int64 != f.belowID || belowUUID.String != f.belowUUID) {
		// The last row below the floor is not the one it was: the ids may
		// have started again (the table re-created, TRUNCATE … RESTART
		// IDENTITY), below the floor; or a row was committed late below
		// it, or a waiting topic's row deleted (only a cost). This round
		// reads from the head; the table is looked at again too, as it may
		// be another one now.
		f.reset()
		f.checked, f.off = false, false
		return floorRead{}
	}
	if f.from == 0 && f.pending != nil && (below.Int64 != f.pending.belowID || belowUUID.String != f.pending.belowUUID) {
		// The row the candidate kept is gone: the ids may have started
		// again since its probe, and a transaction that began after that
		// probe, which its wait does not cover, can hold a new id below
		// it (found by a review); or a waiting topic's row was deleted.
		// As above. (Not the last row below the candidate: a transaction
		// its wait covers commits there, and a topic still written to,
		// while the broker refuses it, had every candidate start over.)
		f.reset()
		f.checked, f.off = false, false
		return floorRead{}
	}
	from := f.from
	c := r.probeFrom
	switch {
	case firstOther.Valid:
		c = firstOther.Int64
	case last.Valid:
		c = max(last.Int64+1, r.probeFrom)
	}
	topics := r.waiting
	if r.probeFrom > 0 {
		topics = union(r.waiting, f.topics) // the rows below probeFrom
	}
	if r.probeFrom < f.from && firstOther.Valid && c < f.from {
		// The sweep saw a row of another topic below the floor: a lower
		// floor is always right.
		f.from = c
	}
	promote := f.pending != nil && xmin >= f.pending.horizon
	if o.target().sql.floorLocked != "" {
		promote = f.pending != nil && f.pending.cleared
	}
	if promote {
		f.from = min(f.pending.id, c)
		f.topics = union(f.pending.topics, topics)
		f.pending = nil
	}
	if f.pending == nil && c > 0 {
		p := &outboxFloorCandidate{id: c, horizon: horizon, topics: topics, found: time.Now()}
		var err error
		if f.from == 0 {
			// With no floor to anchor to, the candidate keeps the last row
			// below it, which the probe that promotes it looks for again.
			// With none, there is nothing to read past yet (and nothing
			// would tell ids that started again): no candidate.
			p.belowID, p.belowUUID, err = o.lastRowBelow(ctx, q, tx, c)
			if p.belowID == 0 {
				err = errNoRowBelow
			}
		}
		if err == nil {
			f.pending = p
		}
	}
	if f.from != from && f.from > 0 {
		o.anchor(ctx, q, tx)
	}
	if f.from > 0 && f.from < r.from {
		// Lowered by the sweep: this round reads from there, so that the
		// row it found goes before the later messages of its topic above
		// the old floor (it went a round after them).
		r.from = f.from
	}
	return r
}

// The errors of a locking read that found a row locked: MariaDB's NOWAIT
// (and a lock wait's timeout), MySQL's NOWAIT.
const (
	erLockWaitTimeout = 1205
	erLockNowait      = 3572
)

// checkFloorCandidate checks, on MySQL/MariaDB (floorLocked), the floor's
// candidate that is at least outboxFloorLockedAge old, at most once per
// outboxFloorLockedAge: a locking read, NOWAIT, of the rows from the floor
// to below the candidate, in a READ COMMITTED transaction of its own
// (rolled back), before the round's. A row there that is locked (inserted
// by a transaction still running, or held by another) fails it, at once,
// and the candidate waits; so does any other error (said once). Run it in
// its own transaction, not the round's: a lock wait that fails ends the
// whole transaction under innodb_rollback_on_timeout. Called with the
// round's turn, before the round's transaction begins (a pool of one
// connection would otherwise wait for itself).
func (o *Outbox) checkFloorCandidate(ctx context.Context) {
	f := &o.floor
	p := f.pending
	check := o.target().sql.floorLocked
	if check == "" || p == nil || p.cleared || time.Since(p.found) < outboxFloorLockedAge || time.Since(p.checked) < outboxFloorLockedAge {
		return
	}
	p.checked = time.Now()
	err := func() error {
		tx, err := o.cfg.DB.BeginTxx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
		if err != nil {
			return err
		}
		defer tx.Rollback() //nolint:errcheck // it only releases the locks
		var n int64
		return tx.QueryRowxContext(ctx, check, f.from, p.id).Scan(&n)
	}()
	if err == nil {
		p.cleared = true
		f.checkFailed = false
		return
	}
	if ctx.Err() == nil && !f.checkFailed && !hasMySQLNumber(err, erLockWaitTimeout) && !hasMySQLNumber(err, erLockNowait) {
		f.checkFailed = true // said once until a check succeeds
		o.logger.get().Info("Inbox outbox relay could not check that no transaction still writes below where the waiting"+
			" topics' rows end: its floor stays where it is", watermill.LogFields{"err": err.Error()})
	}
}
