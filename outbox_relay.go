package inbox

import (
	"bytes"
	"cmp"
	"context"
	"database/sql"
	"database/sql/driver"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf16"
	"unicode/utf8"

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
// for PollInterval. A round that fails on the database is logged, reported
// to OnRound and retried after a backoff (doubling from 50 ms to
// MaxBackoff). A topic whose message the broker refused is tried again
// after a wait of its own (the same doubling), and the rounds meanwhile
// leave its rows out of their reads, so the other topics go on however
// many of its messages are first in the table (the reads then start where
// its rows end, so that they do not pass over a large backlog of it each
// time: see docs/outbox.md); a refused topic whose
// messages left the table another way (another relay instance sent them)
// is forgotten. Run one relay per process; several processes may each run
// one on the same table (see Outbox). The rounds of one Outbox run one at a
// time, whoever runs them: two Runs (two routers that each add
// ob.RouterPlugin) and RelayOnce calls take turns, which keeps a writer's
// order; side by side they broke it, and on SQLite sent twice.
func (o *Outbox) Run(ctx context.Context) error {
	o.running.begin()
	defer o.running.end()
	o.relayStarted.Store(true)
	var backoff time.Duration
	topics := o.topics // shared by every Run of this Outbox, whose rounds take turns
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		o.prepareInsertOne(ctx)
		round := o.relayOnce(ctx, topics)
		if ctx.Err() != nil {
			return nil
		}
		wait, wake := o.cfg.PollInterval, o.wake
		if next, ok := topics.next(time.Now()); ok {
			wait = min(wait, next) // a topic the broker refused is tried again then
		}
		switch {
		case round.Err != nil && (round.unrecorded || round.Relayed+round.DeadLettered+round.Failed == 0):
			// The database is down or refuses the relay's statements,
			// before the broker had its say or after it (then what was
			// published goes again in a later round). What the broker
			// refuses waits per topic, and the next round leaves it out.
			backoff = min(max(2*backoff, outboxRetryFirst), o.cfg.MaxBackoff)
			wait, wake = backoff, nil // a commit does not cut a backoff short
		case round.read >= round.limit && round.skipped < round.read:
			backoff = 0
			continue // a full round: more may be waiting
		case round.DeadLettered > 0:
			// A set-aside ends its topic's walk: the rest of that topic
			// waits for the next round, which need not wait.
			backoff = 0
			continue
		case round.skipped > 0 && round.Relayed+round.Failed+round.DeadLettered == 0:
			// Every message read waits for its topic's retry: a commit
			// would only read them again.
			backoff = 0
			wake = nil
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

// topicBackoff is the Outbox's memory of the topics whose messages the
// broker refused, shared by its Runs: each is skipped until its wait is
// over (doubling from outboxRetryFirst up to MaxBackoff), so that a topic
// the broker keeps refusing (one that does not exist, a partition without
// a leader) does not slow the others down. (Each Run kept its own, and two
// Runs, whose rounds take turns, tried such a topic twice as often.) Safe
// for concurrent use.
type topicBackoff struct {
	mu    sync.Mutex
	max   time.Duration
	waits map[string]topicWait
	// forgotten keeps, for 2 MaxBackoffs, the last wait of the topics
	// forgetAllBut forgot, so that a refusal soon after goes on doubling
	// from there: with several relay instances, a topic's rows that
	// another instance held (SKIP LOCKED) looked gone, and each instance
	// started the topic's wait again from 50 ms, trying it dozens of times
	// a MaxBackoff. Later, a refusal starts from 50 ms again, and the entry
	// goes (one topic per tenant kept one each for good).
	forgotten map[string]forgottenWait
}

// forgottenWait is a forgotten topic's last wait, and when it was
// forgotten.
type forgottenWait struct {
	wait time.Duration
	at   time.Time
}

// forgottenFor is how long a forgotten topic's wait is kept.
func (t *topicBackoff) forgottenFor() time.Duration { return 2 * t.max }

// topicWait is a refused topic's next try and its current wait.
type topicWait struct {
	until time.Time
	wait  time.Duration
}

// skip reports whether topic waits for its next try at now.
func (t *topicBackoff) skip(topic string, now time.Time) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.skipLocked(topic, now)
}

func (t *topicBackoff) skipLocked(topic string, now time.Time) bool {
	w, ok := t.waits[topic]
	return ok && now.Before(w.until)
}

// refused doubles topic's wait and starts it at now.
func (t *topicBackoff) refused(topic string, now time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	w, ok := t.waits[topic]
	if f, forgot := t.forgotten[topic]; !ok && forgot && now.Sub(f.at) <= t.forgottenFor() {
		w.wait = f.wait
	}
	delete(t.forgotten, topic)
	w.wait = min(max(2*w.wait, outboxRetryFirst), t.max)
	w.until = now.Add(w.wait)
	t.waits[topic] = w
}

// accepted forgets topic's wait.
func (t *topicBackoff) accepted(topic string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.waits, topic)
	delete(t.forgotten, topic)
}

// waiting returns the topics that wait for their next try at now.
func (t *topicBackoff) waiting(now time.Time) []any {
	t.mu.Lock()
	defer t.mu.Unlock()
	var topics []any
	for topic := range t.waits {
		if t.skipLocked(topic, now) {
			topics = append(topics, topic)
		}
	}
	return topics
}

// all returns every topic that has a wait, over or not.
func (t *topicBackoff) all() map[string]bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	topics := make(map[string]bool, len(t.waits))
	for topic := range t.waits {
		topics[topic] = true
	}
	return topics
}

// forgetAllBut forgets the waits of the topics that have no row in rows
// and are not in kept.
func (t *topicBackoff) forgetAllBut(rows []outboxRow, kept []any) {
	t.mu.Lock()
	defer t.mu.Unlock()
	now := time.Now()
	for topic, f := range t.forgotten {
		if now.Sub(f.at) > t.forgottenFor() {
			delete(t.forgotten, topic)
		}
	}
	if len(t.waits) == len(kept) {
		return
	}
	present := make(map[string]bool, len(kept))
	for _, topic := range kept {
		present[topic.(string)] = true
	}
	for _, r := range rows {
		present[r.Topic] = true
	}
	for topic, w := range t.waits {
		if !present[topic] {
			delete(t.waits, topic)
			if t.forgotten == nil {
				t.forgotten = map[string]forgottenWait{}
			}
			t.forgotten[topic] = forgottenWait{wait: w.wait, at: now}
		}
	}
}

// next returns how long until the first waiting topic may be tried, and
// whether one waits.
func (t *topicBackoff) next(now time.Time) (time.Duration, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	var first time.Time
	for _, w := range t.waits {
		if first.IsZero() || w.until.Before(first) {
			first = w.until
		}
	}
	return max(first.Sub(now), 0), !first.IsZero()
}

// WaitStopped returns nil once no relay of the Outbox runs: the one its
// RouterPlugin started has stopped (within a second of the router closing,
// its round in progress cancelled: those messages are sent again later; a
// Publish call in progress, which takes no context, is waited for, and so is
// a database statement in progress, for up to 5 s, so that the round rolls
// its transaction back before anything else reads its rows) and no
// Run call is in progress; or the cause of ctx's end, if it ends
// first. router.Run does not wait for a plugin's goroutine: call it after
// router.Run returned and before closing OutboxConfig.Publisher and the
// database. It returns at once when no relay runs. Safe for concurrent
// use.
func (o *Outbox) WaitStopped(ctx context.Context) error { return o.running.wait(ctx) }

// RouterPlugin checks the outbox tables (Verify, bounded by VerifyTimeout)
// and then runs the relay (Run) for as long as the router runs: add it with
// router.AddPlugin(ob.RouterPlugin), and router.Run returns Verify's error
// (errors.Is matches ErrTableNotFound) instead of starting handlers whose
// every output would fail. The relay starts once the router is running
// (however long its start takes: see RouterPluginStartTimeout) and
// stops within a second of the router closing, cancelling a round in
// progress (whose messages are sent again later; a database statement in
// progress is let finish, for up to 5 s, so that the round rolls back
// itself: see WaitStopped). Router plugins run once,
// in router.Run, before its handlers start (a Watermill convention). Without
// an OutboxConfig.Logger, the relay logs to the router's logger from then
// on.
func (o *Outbox) RouterPlugin(r *message.Router) error {
	ctx, cancel := context.WithTimeout(context.Background(), VerifyTimeout)
	defer cancel()
	if err := o.Verify(ctx); err != nil {
		return err
	}
	o.logger.adoptRouters(r)
	runWhileRouterRuns(r, &o.running, o.logger.get(), "Inbox outbox relay", func(ctx context.Context) { _ = o.Run(ctx) })
	return nil
}

// Verify checks that the outbox table and its dead-letter table exist, keep
// what commits (an error wrapping ErrIncompatibleTable with the fix for a
// MySQL/MariaDB table not on InnoDB, an UNLOGGED PostgreSQL table, an id
// narrower than bigint) and that the relay can read the outbox: an error
// wrapping ErrTableNotFound (run InitializeSchema, or apply SchemaSQL) or
// the driver's error, also
// when the database user lacks a privilege the relay needs or the server
// its syntax (FOR UPDATE SKIP LOCKED: MySQL 8.0.4+, MariaDB 10.6+;
// JSON_TABLE on MySQL/MariaDB). It reads the catalog and runs each kind of
// the relay's statements on no row; on PostgreSQL in one transaction that
// it rolls back, elsewhere each on its own, changing nothing. First it
// checks that the dialect is for the database server behind the DB (an
// error wrapping ErrDialectMismatch that names both), as Inbox.Verify does.
func (o *Outbox) Verify(ctx context.Context) error {
	if err := o.checkServer(ctx); err != nil {
		return err
	}
	target, err := o.pinTarget(ctx)
	if err != nil {
		return err
	}
	err = withReadTx(ctx, o.cfg.DB, o.dialect, func(q sqlx.QueryerContext) error {
		for i, t := range []qualifiedName{target.table, target.dead} {
			if _, err := o.dialect.checkTable(ctx, q, t); errors.Is(err, ErrTableNotFound) {
				what := "outbox table"
				if i == 1 {
					what = "the dead-letter table of outbox table " + strconv.Quote(target.table.String()) + ","
				}
				return fmt.Errorf("%w: %s %q does not exist: run Outbox.InitializeSchema, or apply Outbox.SchemaSQL"+
					" with your migrations", ErrTableNotFound, what, t.String())
			}
		}
		if err := checkOutboxDurable(ctx, q, o.dialect, target.table, target.dead); err != nil {
			return err
		}
		if o.dialect.server() == serverPostgreSQL {
			if err := checkOutboxIDCache(ctx, q, target.table.quoted(o.dialect)); err != nil {
				return err
			}
		}
		rows, err := q.QueryxContext(ctx, target.sql.probe)
		if err != nil {
			return fmt.Errorf("inbox: outbox table %q cannot be read by the relay (compare with Outbox.SchemaSQL): %w", target.table, err)
		}
		if err := rows.Close(); err != nil {
			return err
		}
		for _, stmt := range target.sql.probeStatements {
			rows, err := q.QueryxContext(ctx, stmt)
			if err == nil {
				err = rows.Close()
			}
			if err != nil {
				return fmt.Errorf("inbox: the outbox relay cannot run its statements on table %q (it needs SELECT, INSERT,"+
					" UPDATE and DELETE on it and SELECT and INSERT on its dead-letter table, and FOR UPDATE SKIP LOCKED: MySQL 8.0.4+,"+
					" MariaDB 10.6+, which also have the JSON_TABLE it uses): %s: %w", o.configured.table, stmt, err)
			}
		}
		return nil
	})
	return poolerHint(err)
}

// checkOutboxDurable refuses, with ErrIncompatibleTable and the statement
// that fixes it, an outbox table or dead-letter table (made by hand, or
// altered) that does not keep what its transactions commit, as the inbox
// table's check refuses them (Dialect.outboxDurability: a MySQL/MariaDB
// engine other than InnoDB, an UNLOGGED PostgreSQL table or one whose
// row-level security applies to the session's role, an outbox id narrower
// than 64 bits). tables[0] is the outbox table, the rest
// dead-letter tables.
func checkOutboxDurable(ctx context.Context, q sqlx.QueryerContext, d Dialect, tables ...qualifiedName) error {
	for i, t := range tables {
		problem, fix, err := d.outboxDurability(ctx, q, t, i == 0)
		if err != nil {
			return fmt.Errorf("inbox: outbox table %q: read its kind: %w", t, err)
		}
		if problem != "" {
			return fmt.Errorf("%w: outbox table %q %s; fix: %s", ErrIncompatibleTable, t.String(), problem, fix)
		}
	}
	return nil
}

// checkOutboxIDCache refuses, with ErrIncompatibleTable, a PostgreSQL
// outbox table (quoted) whose id column takes its values from a sequence
// that hands each session a cache of several values (ALTER TABLE … ALTER
// COLUMN id SET CACHE n, a tuning for tables that take many inserts): each
// pooled connection then draws ids from a range of its own, so one writer's
// later transaction can take a smaller id than its earlier one, and the
// relay, which sends in id order, sent them the other way round. The
// sequence is the identity's, the one a serial column owns, or the one its
// default calls (a sequence of its own, not owned by the column, named as
// a regclass or as text: nextval('s'::text) records no dependency); the
// error gives the statement that fixes it for each. A sequence a trigger
// or a function picks is not seen.
func checkOutboxIDCache(ctx context.Context, q sqlx.QueryerContext, table string) error {
	var seqs []struct {
		Cache    int64  `db:"cache"`
		Sequence string `db:"sequence"`
		Identity bool   `db:"identity"`
	}
	err := sqlx.SelectContext(ctx, q, &seqs, `SELECT s.seqcache AS cache, s.seqrelid::regclass::text AS sequence,
			a.attidentity <> '' AS identity
		FROM pg_attribute a JOIN pg_sequence s ON s.seqrelid IN (
			SELECT objid FROM pg_depend WHERE classid = 'pg_class'::regclass AND refclassid = 'pg_class'::regclass
				AND refobjid = a.attrelid AND refobjsubid = a.attnum AND deptype IN ('a', 'i')
			UNION
			SELECT dep.refobjid FROM pg_attrdef d JOIN pg_depend dep ON dep.classid = 'pg_attrdef'::regclass
				AND dep.objid = d.oid AND dep.refclassid = 'pg_class'::regclass
			WHERE d.adrelid = a.attrelid AND d.adnum = a.attnum
			UNION
			SELECT to_regclass(substring(pg_get_expr(d.adbin, d.adrelid) from 'nextval\(\(?''([^'']+)'''))::oid
			FROM pg_attrdef d WHERE d.adrelid = a.attrelid AND d.adnum = a.attnum)
		WHERE a.attrelid = to_regclass($1) AND a.attname = 'id' AND NOT a.attisdropped AND s.seqcache > 1`, table)
	if err != nil {
		return fmt.Errorf("inbox: outbox table %s: read its id sequence: %w", table, err)
	}
	if len(seqs) == 0 {
		return nil
	}
	fix := "ALTER SEQUENCE " + seqs[0].Sequence + " CACHE 1"
	if seqs[0].Identity {
		fix = "ALTER TABLE " + table + " ALTER COLUMN id SET CACHE 1"
	}
	return fmt.Errorf("%w: outbox table %s: its id sequence %s caches %d values per session, so that one writer's later"+
		" message can take a smaller id than its earlier one, and the relay sends in id order: %s",
		ErrIncompatibleTable, table, seqs[0].Sequence, seqs[0].Cache, fix)
}

type outboxRow struct {
	ID       int64  `db:"id"`
	Topic    string `db:"topic"`
	UUID     string `db:"uuid"`
	Payload  []byte `db:"payload"`
	Metadata []byte `db:"metadata"`
	Attempts int    `db:"attempts"`
	// IdleTimeouts is the sum of the session's idle-transaction timeouts,
	// read by the round's first read when asked (outboxSQL.selectBatch).
	IdleTimeouts sql.NullInt64 `db:"idle_timeouts"`
}

// outboxBatch is what a round decided for the rows it read.
type outboxBatch struct {
	sent    []int64             // published: delete
	failed  map[int64]error     // refused: count the attempt
	bury    map[int64]error     // refused for the last time while the broker accepts its topic
	rows    map[int64]outboxRow // by id
	skipped int                 // rows left untouched: their topic waits for its next try
	// refusals holds the refusals of the messages that wait for evidence
	// (publishTopic).
	refusals map[int64]error
	// errs are the reads of publishTopic's evidence that failed.
	errs []error
	// kept are the messages record could not set aside (the dead-letter
	// table refused them, or holds their id): first in line still.
	kept []int64
	// accepted are the topics the broker took, whose waits settleTopics
	// ends; refused, those whose waits publish started (doubled).
	accepted, refused []string
}

// settleTopics ends the waits of the topics the broker took in b, and has
// the topics of the messages record could not set aside wait as refused
// ones do, their waits doubling: such a topic counted as taken (a message
// behind the refused one went), and the next round read it again at once,
// each round a publish and an attempt (hundreds a second at BatchSize 1).
func (b *outboxBatch) settleTopics(topics *topicBackoff) {
	if topics == nil {
		return
	}
	kept := make(map[string]bool, len(b.kept))
	for _, id := range b.kept {
		kept[b.rows[id].Topic] = true
	}
	for _, topic := range b.refused {
		delete(kept, topic) // its wait doubled once already this round
	}
	for _, topic := range b.accepted {
		if !kept[topic] {
			topics.accepted(topic)
		}
	}
	now := time.Now()
	for topic := range kept {
		topics.refused(topic, now)
	}
}

// RelayOnce runs one relay round now, once the round of this Outbox in
// progress (Run's) has ended: read up to BatchSize messages (fewer for a
// while after a read that a statement timeout stopped: see
// OutboxConfig.BatchSize), publish them, delete the rows of those the
// broker accepted, count a failed attempt for the others (setting aside
// those that used their last one), and report the outcome to OnRound. On
// PostgreSQL and MySQL/MariaDB it all happens in one transaction that
// locks the rows it read (FOR UPDATE SKIP LOCKED), so a relay that dies
// before the commit leaves them to be sent again; on SQLite the rows are
// read without a lock and deleted in a short transaction after the
// publishes. If ctx ends while it waits for its turn, it returns ctx's
// error in OutboxRound.Err, having done nothing; if it ends during the
// round, the round's database statement in progress is let finish, for up
// to 5 s past ctx's end, and the round rolls back (so that the next round
// finds no row still locked by it), and returns ctx's error.
func (o *Outbox) RelayOnce(ctx context.Context) OutboxRound {
	return o.relayOnce(ctx, nil).OutboxRound
}

// relayRound is a round's outcome with what Run needs beside it: the rows
// it read, and how many of them it left for their topic's next try.
type relayRound struct {
	OutboxRound
	read, skipped int
	// limit is how many rows the round's read asked for (readLimit).
	limit int
	// unrecorded: the round published, then failed to record it.
	unrecorded bool
}

// relayOnce is RelayOnce, skipping the topics that wait in topics (nil:
// none) and recording in it which topics the broker refused.
func (o *Outbox) relayOnce(ctx context.Context, topics *topicBackoff) relayRound {
	select { // one round of this Outbox at a time (see Run)
	case o.relaying <- struct{}{}:
	default:
		select {
		case o.relaying <- struct{}{}:
		case <-ctx.Done():
			return relayRound{OutboxRound: OutboxRound{Err: fmt.Errorf("inbox: outbox relay: waiting for the round in progress: %w", ctx.Err())}}
		}
	}
	turn := true
	endTurn := func() {
		if turn {
			turn = false
			<-o.relaying
		}
	}
	defer endTurn()
	start := time.Now()
	round := o.relay(ctx, topics)
	round.Err = poolerHint(round.Err) // pgx's statement cache behind a transaction-mode pooler: say the fix
	round.Duration = time.Since(start)
	endTurn() // before OnRound, which may call RelayOnce
	if round.Err != nil && ctx.Err() == nil {
		o.logger.get().Error("Inbox outbox relay round failed", round.Err, watermill.LogFields{
			"relayed": round.Relayed, "failed": round.Failed, "dead_lettered": round.DeadLettered,
		})
	}
	if o.cfg.OnRound != nil && (round.Relayed+round.Failed+round.DeadLettered > 0 || round.Err != nil) {
		o.callOnRound(round.OutboxRound)
	}
	return round
}

// callOnRound calls OnRound with r. A panic in it is logged, not
// propagated: under RouterPlugin the relay runs on a goroutine of its own,
// where a panic ended the whole process (every handler in flight with it),
// and again at every start while outputs were waiting; the round's outcome
// is final either way.
func (o *Outbox) callOnRound(r OutboxRound) {
	defer func() {
		if p := recover(); p != nil {
			o.logger.get().Error("Inbox outbox OnRound panicked", fmt.Errorf("panic: %v", p), watermill.LogFields{
				"relayed": r.Relayed, "failed": r.Failed, "dead_lettered": r.DeadLettered,
			})
		}
	}()
	o.cfg.OnRound(r)
}

func (o *Outbox) relay(ctx context.Context, topics *topicBackoff) (round relayRound) {
	// The server and its sessions, once (Verify checks them too; Run
	// without it met MySQL sessions with autocommit off as a BEGIN that
	// failed with 1568 every round).
	if err := o.checkServer(ctx); err != nil {
		return relayRound{OutboxRound: OutboxRound{Err: fmt.Errorf("inbox: outbox relay: %w", err)}}
	}
	if _, err := o.pinTarget(ctx); err != nil {
		return relayRound{OutboxRound: OutboxRound{Err: fmt.Errorf("inbox: outbox relay: %w", err)}}
	}
	if o.pinned.Load() == nil {
		return relayRound{OutboxRound: OutboxRound{Err: fmt.Errorf("inbox: outbox relay: %w: outbox table %s is not on the search_path:"+
			" run Outbox.InitializeSchema, or apply Outbox.SchemaSQL with your migrations", ErrTableNotFound, o.configured.table)}}
	}
	// The round's statements run on sctx, which ctx's end does not cut
	// short until relayStopGrace later: cut mid-statement, database/sql
	// rolled the transaction back on a goroutine of its own and the
	// driver dropped the connection, so the round returned, and handed
	// its turn over, while the server still held its row locks; the next
	// round's SKIP LOCKED read skipped a transaction's first message and
	// sent its second one first. The rollback below (deferred) is then the
	// round's own, done before the turn passes. ctx is checked between the
	// statements, and the broker's publish runs on it.
	sctx, cancelStatements := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelStatements() // registered first: runs after the rollback
	stopGrace := context.AfterFunc(ctx, func() { time.AfterFunc(relayStopGrace, cancelStatements) })
	defer stopGrace()
	db := o.cfg.DB
	if topics != nil {
		o.checkFloorCandidate(sctx)
	}
	var read sqlx.QueryerContext = db
	var tx *sqlx.Tx
	// idleTimeouts: the round reads the session's idle-transaction
	// timeouts (MariaDB); timeoutsOff: it turned them off, and must put
	// them back before the session goes back to the pool.
	idleTimeouts := o.target().sql.locks && o.target().sql.idleTimeoutsOff != "" && !o.noIdleTimeoutVars.Load()
	timeoutsOff := false
	if o.target().sql.locks {
		// READ COMMITTED: on MySQL/MariaDB the locking read then takes no
		// gap locks, which would hold back the handlers' outbox inserts.
		begin := db.BeginTxx
		if idleTimeouts {
			// On a connection of the round's own, so that the timeouts are
			// put back on that session whatever ends the round: when ctx
			// ends, database/sql rolls the transaction back at once, on a
			// goroutine of its own, and MySQL's driver keeps the session for
			// the pool (a later handler's transaction would have run without
			// the timeouts). Deferred first, so that it runs after the
			// rollback.
			conn, err := db.Connx(ctx)
			if err != nil {
				return relayRound{OutboxRound: OutboxRound{Err: fmt.Errorf("inbox: outbox relay: begin: %w", err)}}
			}
			defer func() {
				if timeoutsOff {
					bctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
					defer cancel()
					if _, err := conn.ExecContext(bctx, o.target().sql.idleTimeoutsBack); err != nil {
						// The session cannot be trusted: out of the pool.
						_ = conn.Raw(func(any) error { return driver.ErrBadConn })
					}
				}
				conn.Close()
			}()
			begin = conn.BeginTxx
		}
		var err error
		if tx, err = begin(sctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted}); err != nil {
			return relayRound{OutboxRound: OutboxRound{Err: fmt.Errorf("inbox: outbox relay: begin: %w", err)}}
		}
		defer tx.Rollback() //nolint:errcheck // no-op after Commit
		read = tx
	}
	// The rows of the topics that wait for their next try are left out of
	// the read, so that a topic the broker refuses, however many rows it
	// has at the head of the table, leaves the batch to the others.
	var waiting []any
	var skipArgs []any // waiting as the read's one bind parameter: a JSON array
	if topics != nil {
		waiting = topics.waiting(time.Now())
		if len(waiting) > 0 {
			list, err := json.Marshal(waiting)
			if err != nil {
				return relayRound{OutboxRound: OutboxRound{Err: fmt.Errorf("inbox: outbox relay: list the waiting topics: %w", err)}}
			}
			skipArgs = []any{asciiJSON(list)}
		}
	}
	if ctx.Err() != nil {
		return relayRound{OutboxRound: OutboxRound{Err: fmt.Errorf("inbox: outbox relay: %w", ctx.Err())}}
	}
	// While topics wait, the read starts at the floor below which only
	// their rows lie (see outboxFloor), not at the head of the table.
	var floor floorRead
	if topics != nil {
		floor = o.floorFor(sctx, read, tx, waiting, topics.all())
		floor = o.probeFloor(sctx, read, tx, floor, skipArgs)
	}
	readArgs := skipArgs
	if floor.from > 0 {
		readArgs = append([]any{floor.from}, skipArgs...)
	}
	var rows []outboxRow
	limit := o.readLimitNow()
	round.limit = limit
	err := sqlx.SelectContext(sctx, read, &rows, db.Rebind(o.target().sql.selectBatch(limit, floor.from > 0, len(skipArgs) > 0, idleTimeouts)), readArgs...)
	if err != nil && idleTimeouts && hasMySQLNumber(err, erUnknownSystemVariable) {
		// MySQL: no idle-transaction timeouts to turn off. (The failed
		// statement leaves MySQL's transaction as it was.)
		o.noIdleTimeoutVars.Store(true)
		rows, idleTimeouts = nil, false
		err = sqlx.SelectContext(sctx, read, &rows, db.Rebind(o.target().sql.selectBatch(limit, floor.from > 0, len(skipArgs) > 0, false)), readArgs...)
	}
	if err != nil {
		if ctx.Err() == nil && isStatementTimeout(err) {
			o.readTimedOutAt(limit)
		}
		if o.tableMissing(sctx, err, o.target(), read, nil) {
			// (PostgreSQL's look-up above tells a missing table first.)
			err = fmt.Errorf("%w: outbox table %s does not exist: run Outbox.InitializeSchema, or apply Outbox.SchemaSQL"+
				" with your migrations: %w", ErrTableNotFound, o.target().table, err)
		}
		return relayRound{OutboxRound: OutboxRound{Err: fmt.Errorf("inbox: outbox relay: read %d rows: %w", limit, err)}}
	}
	if topics != nil && len(rows) < limit {
		// The read saw every row of the topics it did not leave out: a
		// refused topic with none left (sent by another relay instance,
		// deleted by hand) has nothing to wait for.
		topics.forgetAllBut(rows, waiting)
	}
	var idleSet bool // the session has idle-transaction timeouts (read with the batch)
	if len(rows) > 0 {
		idleSet = rows[0].IdleTimeouts.Int64 > 0
	}
	if len(rows) > 0 && o.target().sql.visibleUpTo != nil {
		var err error
		if rows, err = o.completeBatch(sctx, read, rows, floor.from, skipArgs); err != nil {
			if ctx.Err() == nil && isStatementTimeout(err) {
				o.readTimedOutAt(limit)
			}
			return relayRound{OutboxRound: OutboxRound{Err: fmt.Errorf("inbox: outbox relay: read again %d rows under a lock: %w", limit, err)}}
		}
	} else if len(rows) > 0 && o.target().sql.stillThere != nil {
		var err error
		if rows, err = o.keepExisting(sctx, read, rows); err != nil {
			if ctx.Err() == nil && isStatementTimeout(err) {
				o.readTimedOutAt(limit) // its locking read of the rows also times out
			}
			return relayRound{OutboxRound: OutboxRound{Err: fmt.Errorf("inbox: outbox relay: read again %d rows under a lock: %w", limit, err)}}
		}
	}
	if len(rows) == 0 {
		return round
	}
	// The round's transaction idles while it publishes: the session's
	// idle-transaction timeouts (MariaDB) are off until just before the
	// commit, or after the rollback (deferred above), and then put back as
	// they were.
	if idleTimeouts && idleSet {
		timeoutsOff = true // even when the SET fails: it may have been applied
		if _, err := tx.ExecContext(sctx, o.target().sql.idleTimeoutsOff); err != nil {
			return relayRound{OutboxRound: OutboxRound{Err: fmt.Errorf("inbox: outbox relay: turn the session's idle-transaction timeouts off while it publishes: %w", err)}}
		}
	}
	round.read = len(rows)
	reads := walkReads{
		next: func(topic string, after int64, seen []int64) (r outboxRow, ok bool, err error) {
			err = o.readInWalk(sctx, tx, func() error {
				var rows []outboxRow
				if err := sqlx.SelectContext(sctx, read, &rows, db.Rebind(o.target().sql.nextOfTopic), after, topic); err != nil || len(rows) == 0 {
					return err
				}
				if o.target().sql.stillThere != nil {
					var err error
					if rows, err = o.keepExisting(sctx, read, rows); err != nil || len(rows) == 0 {
						return err
					}
				}
				if o.target().sql.locks {
					// A row of the topic below this one that the walk does not
					// know committed after the batch's read: its writer's
					// later message must not go before it.
					var ids []int64
					if err := sqlx.SelectContext(sctx, read, &ids, db.Rebind(o.target().sql.topicIDsBelow(len(seen)+1)),
						floor.from, rows[0].ID, topic); err != nil {
						return err
					}
					for _, id := range ids {
						if !slices.Contains(seen, id) {
							return nil
						}
					}
				}
				r, ok = rows[0], true
				return nil
			})
			return r, ok && err == nil, err
		},
		deadTaken: func(id int64) (taken bool, err error) {
			err = o.readInWalk(sctx, tx, func() error {
				var ids []int64
				if err := sqlx.SelectContext(sctx, read, &ids, db.Rebind(o.target().sql.deadHas), id); err != nil {
					return err
				}
				taken = len(ids) > 0
				return nil
			})
			return taken, err
		},
	}
	if ctx.Err() != nil {
		return relayRound{OutboxRound: OutboxRound{Err: fmt.Errorf("inbox: outbox relay: %w", ctx.Err())}}
	}
	b := o.publish(ctx, rows, topics, reads)
	defer func() { b.settleTopics(topics) }() // after record, whatever the round's end
	if ctx.Err() != nil {
		// Stopped: what the broker said may be the stop's doing (a
		// publish cut short), so nothing of it is recorded; the rows go
		// again (at least once).
		return unrecorded(round, b, fmt.Errorf("inbox: outbox relay: stopped before recording its publishes: %w", ctx.Err()))
	}
	round.Failed, round.skipped = len(b.failed)+len(b.bury), b.skipped
	if tx == nil {
		// SQLite: queued behind this process's other writers (see
		// writerQueue), not polling for the write lock against them.
		place, err := sqliteWriterQueue(db.DB).enter(ctx)
		if err != nil {
			return unrecorded(round, b, fmt.Errorf("inbox: outbox relay: begin: %w", err))
		}
		defer place.leave()
		if tx, err = db.BeginTxx(ctx, nil); err != nil {
			return unrecorded(round, b, fmt.Errorf("inbox: outbox relay: begin: %w", err))
		}
		defer tx.Rollback() //nolint:errcheck // no-op after Commit
	}
	if err := o.record(sctx, tx, &b); err != nil {
		if ctx.Err() == nil && isStatementTimeout(err) {
			// The DELETE of large rows outlasts the statement timeout as
			// their read does: the round's messages go again, and the
			// next rounds read, and so delete, fewer rows (they failed
			// after their publishes, every round, before).
			o.readTimedOutAt(round.limit)
		}
		return unrecorded(round, b, err)
	}
	if timeoutsOff {
		if _, err := tx.ExecContext(sctx, o.target().sql.idleTimeoutsBack); err != nil {
			return unrecorded(round, b, fmt.Errorf("inbox: outbox relay: put the session's idle-transaction timeouts back: %w", err))
		}
		timeoutsOff = false
	}
	if err := tx.Commit(); err != nil {
		return unrecorded(round, b, fmt.Errorf("inbox: outbox relay: commit: %w", err))
	}
	round.Relayed, round.DeadLettered = len(b.sent), len(b.bury)
	for id, err := range b.bury {
		r := b.rows[id]
		o.logger.get().Error("Inbox outbox message set aside in the dead-letter table after its last attempt", err, watermill.LogFields{
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
	if len(b.errs) > 0 {
		round.Err = errors.Join(round.Err, fmt.Errorf("inbox: outbox relay: %w", errors.Join(b.errs...)))
	}
	return round
}

// relayStopGrace is how long a relay round's statement in progress may run
// on once the round's context has ended (a router's shutdown), so that the
// round ends its transaction itself before the next round of its Outbox
// starts (see relay).
const relayStopGrace = 5 * time.Second

// readLimitHold is how long the relay reads fewer rows after a read its
// statement timeout stopped, before it reads twice as many again.
const readLimitHold = time.Minute

// readLimitNow returns how many rows the next round reads: BatchSize, or
// less after a read stopped by a statement timeout (readTimedOutAt), twice
// as many for each round once readLimitHold has passed since.
func (o *Outbox) readLimitNow() int {
	limit := o.readLimit.Load()
	if limit == 0 {
		return o.cfg.BatchSize
	}
	if time.Since(time.Unix(0, o.readTimedOut.Load())) < readLimitHold {
		return int(limit)
	}
	next := min(2*limit, int64(o.cfg.BatchSize))
	stored := next
	if next == int64(o.cfg.BatchSize) {
		stored = 0 // back to BatchSize
	}
	o.readLimit.CompareAndSwap(limit, stored)
	return int(next)
}

// readTimedOutAt records that a read of limit rows was stopped by the
// database's statement timeout: the next rounds read half as many, down to
// one (a relay that read BatchSize rows of large messages failed every
// round, and sent nothing).
func (o *Outbox) readTimedOutAt(limit int) {
	o.readTimedOut.Store(time.Now().UnixNano())
	half := int64(max(limit/2, 1))
	if o.readLimit.Swap(half) != half {
		o.logger.get().Info("Inbox outbox relay: a read timed out (the database's statement timeout); reading fewer rows per round",
			watermill.LogFields{"rows": half, "batch_size": o.cfg.BatchSize})
	}
}

// isStatementTimeout reports whether err is the database stopping a
// statement for its time limit: PostgreSQL's 57014 (statement_timeout;
// also a cancel, which the caller tells apart by its context), MariaDB's
// 1969 (max_statement_time), MySQL's 3024 (max_execution_time).
func isStatementTimeout(err error) bool {
	return hasSQLState(err, "57014") || hasMySQLNumber(err, 1969) || hasMySQLNumber(err, 3024)
}

// unrecorded is the outcome of a round whose publishes the database did
// not record (err): the messages the broker took are still in the table and
// go again in a later round (at least once). Run then waits as after a
// database error, so that a database that keeps failing after the
// publishes does not have the same messages published round after round.
func unrecorded(round relayRound, b outboxBatch, err error) relayRound {
	if len(b.errs) > 0 {
		err = errors.Join(err, fmt.Errorf("inbox: outbox relay: %w", errors.Join(b.errs...)))
	}
	return relayRound{OutboxRound: OutboxRound{Failed: round.Failed, Err: err}, unrecorded: true}
}

// readInWalk runs read, one of publishTopic's reads, in tx (nil on SQLite).
// On PostgreSQL it runs under a savepoint, rolled back to when read fails:
// a failed statement (a statement_timeout, say) ends the transaction there,
// which would fail the round after its publishes, and every message it
// published would go again.
func (o *Outbox) readInWalk(ctx context.Context, tx *sqlx.Tx, read func() error) error {
	if tx == nil || o.dialect.server() != serverPostgreSQL {
		return read()
	}
	if _, err := tx.ExecContext(ctx, "SAVEPOINT inbox_outbox_walk"); err != nil {
		return err
	}
	if err := read(); err != nil {
		if _, rerr := tx.ExecContext(ctx, "ROLLBACK TO SAVEPOINT inbox_outbox_walk"); rerr != nil {
			return errors.Join(err, rerr)
		}
		return err
	}
	_, err := tx.ExecContext(ctx, "RELEASE SAVEPOINT inbox_outbox_walk")
	return err
}

// completeBatch runs after the batch's locking read (rows, in id order,
// read from the floor from; skipArgs its waiting topics): it reads from a
// snapshot the rows from from up to the batch's last (visibleUpTo), keeps
// the batch's rows among them (a row another relay deleted while the
// batch's read ran can come back from it on MariaDB), and locks and adds,
// in id order, the others that are free: rows the batch's read skipped, of
// a transaction that committed during it (see mysqlVisibleUpTo). The rows
// another relay holds stay its own.
func (o *Outbox) completeBatch(ctx context.Context, q sqlx.QueryerContext, rows []outboxRow, from int64, skipArgs []any) ([]outboxRow, error) {
	stmts := o.target().sql
	var visible []int64
	args := append([]any{from, rows[len(rows)-1].ID}, skipArgs...)
	if err := sqlx.SelectContext(ctx, q, &visible, o.cfg.DB.Rebind(stmts.visibleUpTo(len(skipArgs) > 0)), args...); err != nil {
		return nil, err
	}
	read := make(map[int64]bool, len(rows))
	for _, r := range rows {
		read[r.ID] = true
	}
	there := make(map[int64]bool, len(visible))
	var skipped []int64
	for _, id := range visible {
		there[id] = true
		if !read[id] {
			skipped = append(skipped, id)
		}
	}
	kept := rows[:0]
	for _, r := range rows {
		if there[r.ID] {
			kept = append(kept, r)
		}
	}
	if len(skipped) == 0 {
		return kept, nil
	}
	var free []int64
	if err := sqlx.SelectContext(ctx, q, &free, stmts.stillThere(skipped)); err != nil {
		return nil, err
	}
	if len(free) == 0 {
		return kept, nil
	}
	var more []outboxRow
	if err := sqlx.SelectContext(ctx, q, &more, stmts.rowsByID(free)); err != nil {
		return nil, err
	}
	kept = append(kept, more...)
	slices.SortFunc(kept, func(a, b outboxRow) int { return cmp.Compare(a.ID, b.ID) })
	return kept, nil
}

// keepExisting returns the rows that the locking read stillThere finds.
func (o *Outbox) keepExisting(ctx context.Context, q sqlx.QueryerContext, rows []outboxRow) ([]outboxRow, error) {
	ids := make([]int64, len(rows))
	for i, r := range rows {
		ids[i] = r.ID
	}
	var there []int64
	if err := sqlx.SelectContext(ctx, q, &there, o.target().sql.stillThere(ids)); err != nil {
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
// in id order: first all at once, and when that fails one by one, as
// publishTopic says, with reads for its walk.
//
// With topics (Run's), a topic that waits for its next try is skipped (its
// rows stay, untouched), and a topic whose first message in line the
// broker refused is told to wait. Once ctx has ended (the relay stopping)
// the topics not yet published are left untouched too: the round cannot
// record what it sends any more, and the publisher may be closing.
func (o *Outbox) publish(ctx context.Context, rows []outboxRow, topics *topicBackoff, reads walkReads) outboxBatch {
	b := outboxBatch{failed: map[int64]error{}, bury: map[int64]error{}, rows: make(map[int64]outboxRow, len(rows))}
	var order []string // the topics, in the order of their first row
	byTopic := map[string][]outboxRow{}
	for _, r := range rows {
		b.rows[r.ID] = r
		if _, ok := byTopic[r.Topic]; !ok {
			order = append(order, r.Topic)
		}
		byTopic[r.Topic] = append(byTopic[r.Topic], r)
	}
	now := time.Now()
	var due []string // the topics published to in this round
	for _, topic := range order {
		if topics != nil && topics.skip(topic, now) || ctx.Err() != nil {
			b.skipped += len(byTopic[topic])
			continue
		}
		due = append(due, topic)
	}
	// Each topic's call or walk on its own batch, up to TopicConcurrency
	// at once (the walks' reads share the round's transaction: one at a
	// time), then merged in the order of the topics' first rows.
	outcomes := make([]outboxBatch, len(due))
	each := make([]bool, len(due))
	ran := make([]bool, len(due)) // its call or walk returned
	run := func(i int, reads walkReads) {
		outcomes[i] = outboxBatch{failed: map[int64]error{}, bury: map[int64]error{}, rows: map[int64]outboxRow{}}
		if ctx.Err() != nil {
			outcomes[i].skipped = len(byTopic[due[i]])
			ran[i] = true
			return
		}
		each[i] = o.publishTopic(ctx, &outcomes[i], due[i], byTopic[due[i]], reads)
		ran[i] = true
	}
	if len(due) > 0 {
		// On workers of their own, one topic included: a publisher that
		// ends its goroutine (runtime.Goexit: t.FailNow in a test's fake)
		// ended Run's own when it was called there, and no round ran
		// again. Every topic is queued before the workers start: a worker
		// whose goroutine so ended takes none more, and nothing waits for
		// it.
		workers, walk := min(max(o.cfg.TopicConcurrency, 1), len(due)), reads
		if workers > 1 {
			walk = reads.oneAtATime()
		}
		next := make(chan int, len(due))
		for i := range due {
			next <- i
		}
		close(next)
		var wg sync.WaitGroup
		for range workers {
			wg.Go(func() {
				for i := range next {
					run(i, walk)
				}
			})
		}
		wg.Wait()
		for i := range due {
			if !ran[i] {
				// Its publish never returned (its goroutine ended in it),
				// or no worker was left to take it: nothing is known of
				// its messages, which go again next round (at least once).
				outcomes[i] = outboxBatch{skipped: len(byTopic[due[i]])}
			}
		}
	}
	for i, topic := range due {
		t := &outcomes[i]
		b.merge(t)
		if topics != nil && t.skipped == 0 {
			// A topic waits for its next try when the broker refused its
			// first message in line. A call whose publisher told each
			// message's outcome (PublishError) and that published some
			// took the topic: the refused messages go again next round,
			// beside the ones written since (their partitions' turn).
			if len(t.failed) > 0 && (len(t.sent) == 0 || !each[i]) {
				topics.refused(topic, time.Now())
				b.refused = append(b.refused, topic)
			} else {
				b.accepted = append(b.accepted, topic) // once recorded: see settleTopics
			}
		}
	}
	return b
}

// merge adds t, the outcome of one topic's publishes, to b.
func (b *outboxBatch) merge(t *outboxBatch) {
	b.sent = append(b.sent, t.sent...)
	maps.Copy(b.failed, t.failed)
	maps.Copy(b.bury, t.bury)
	maps.Copy(b.rows, t.rows)
	if len(t.refusals) > 0 {
		if b.refusals == nil {
			b.refusals = map[int64]error{}
		}
		maps.Copy(b.refusals, t.refusals)
	}
	b.errs = append(b.errs, t.errs...)
	b.skipped += t.skipped
}

// maxWaitingForEvidence bounds how many messages refused on their last
// attempt one walk of publishTopic holds while it looks for a message
// behind them that the broker accepts. A broker that is down and refuses
// with errors that do not wrap ErrBrokerUnavailable uses up the attempts
// of one more message every MaxAttempts rounds; the bound keeps each
// round's walk to at most this many publishes beside the first call and
// the one that ends the walk, however long it is down.
const maxWaitingForEvidence = 8

// walkReads are the reads of publishTopic's walk; a nil one reads nothing.
type walkReads struct {
	// next returns the message of topic that follows id after, if there
	// is one within the next outboxWalkWindow rows (locked, as the round's
	// read locks its rows). seen are the ids of the topic's rows the walk
	// knows: the round's batch's and those next returned before. Where
	// ids are taken before their transactions commit (PostgreSQL,
	// MySQL/MariaDB), a row of the topic may have committed after the
	// batch was read with an id below the one next finds, of a writer
	// whose next transaction wrote that one; next then returns no message
	// (the walk ends, and the next round reads both in id order), so that
	// the later one does not go first.
	next func(topic string, after int64, seen []int64) (outboxRow, bool, error)
	// deadTaken reports whether the dead-letter table holds id already.
	deadTaken func(id int64) (bool, error)
}

// oneAtATime returns r with its reads made one at a time, for the walks of
// several topics at once: they read on the round's one transaction, which
// is not safe for concurrent use (a statement and the reading of its rows,
// its savepoint).
func (r walkReads) oneAtATime() walkReads {
	var mu sync.Mutex
	shared := walkReads{}
	if next := r.next; next != nil {
		shared.next = func(topic string, after int64, seen []int64) (outboxRow, bool, error) {
			mu.Lock()
			defer mu.Unlock()
			return next(topic, after, seen)
		}
	}
	if deadTaken := r.deadTaken; deadTaken != nil {
		shared.deadTaken = func(id int64) (bool, error) {
			mu.Lock()
			defer mu.Unlock()
			return deadTaken(id)
		}
	}
	return shared
}

// publishTopic publishes group, the messages of topic in id order, and
// records the outcome in b: first all at once, and when that fails one by
// one, in order, up to the first message the broker refuses with attempts
// left, which stays first in line with the rest of its topic behind it.
//
// A message refused on its last attempt is set aside when the refusal
// wraps ErrMessageRejected (the publisher knows the message itself is
// refused). Any other refusal on the last attempt waits for evidence: the
// walk goes on, and once a message behind it is accepted (the broker takes
// the topic, so the refused messages are the problem) every message before
// that one still waiting is set aside; the accepted one counts as sent and
// the rest of the topic waits for the next round. Several refused messages
// in a row are so set aside together, each after its own MaxAttempts: the
// one behind a waiting message has its attempts counted as it is tried, up
// to maxWaitingForEvidence waiting at once (more in a row hold the topic
// back, visibly: failed attempts, the oldest message's age). When
// the group ends while messages wait, next reads the topic's following
// message (a round of BatchSize 1 has no other). A refusal that wraps
// ErrBrokerUnavailable (the broker's state, not the message's) ends the
// walk and uses no attempt. Nothing is sent before a message in front of it
// is sent or set aside, so the topic's order holds.
//
// When the first call fails with a PublishError that tells each message's
// outcome, the messages it acked are sent and the walk takes the refused
// ones with their own refusals; each then reports true. A refusal that
// wraps ErrBrokerUnavailable still ends the walk there: the relay does not
// know partitions, so a message behind it may be of its partition, refused
// for another reason (another produce request of the call, a leader
// election while the message was tried alone) and accepted alone, ahead
// of it.
func (o *Outbox) publishTopic(ctx context.Context, b *outboxBatch, topic string, group []outboxRow, reads walkReads) (each bool) {
	msgs, err := decodeOutboxRows(group)
	if err == nil {
		err = o.publishCall(topic, msgs)
	}
	if err == nil {
		for _, r := range group {
			b.sent = append(b.sent, r.ID)
		}
		return false
	}
	var known []error // each message's refusal, when the publisher told them
	callEnd := group[len(group)-1].ID
	seen := make([]int64, len(group), len(group)+1) // the topic's rows the walk knows (reads.next)
	for i, r := range group {
		seen[i] = r.ID
	}
	if errs, ok := perMessageErrors(err, len(group)); ok {
		// The acked ones are sent, whatever their place; the refused
		// ones, in order, are walked as a failed call's group is.
		each = true
		var refused []outboxRow
		for i, r := range group {
			if errs[i] == nil {
				b.sent = append(b.sent, r.ID)
				continue
			}
			refused = append(refused, r)
			known = append(known, errs[i])
		}
		group = refused
	}
	// One by one, to find the messages the broker refuses. Those sent
	// before them in the failed call go again: at least once. A group of
	// one has had its try. A message whose refusal the publisher told
	// (known) is tried alone again when others were refused beside it,
	// unless its refusal wraps ErrBrokerUnavailable (the broker's state, as
	// a whole partition down: trying again now would only wait for the
	// publisher's retries once more, a call refused whole included): the broker may have refused it for
	// another message of its request (a Kafka partition's batch is written
	// or refused whole), and alone it answers for itself. The read of the
	// messages behind starts after the whole call's (its acked messages
	// are not evidence, nor sent again).
	var waiting []outboxRow // refused on their last attempt: evidence wanted
	wait := func() {
		for _, w := range waiting {
			b.failed[w.ID] = fmt.Errorf("%w (its attempts are used up: it is set aside once a message behind it on its topic is accepted)", b.refusals[w.ID])
		}
	}
	for i := 0; ; i++ {
		if ctx.Err() != nil {
			// The relay is stopping: the round records nothing of what it
			// sends now, so each publish would only be sent again, and the
			// stop waited for the whole walk, one broker round trip a
			// message (BatchSize of them behind a slow broker).
			wait()
			return each
		}
		if i == len(group) {
			if len(waiting) == 0 || reads.next == nil {
				break
			}
			after := max(group[i-1].ID, callEnd)
			r, ok, err := reads.next(topic, after, seen)
			if err != nil {
				b.errs = append(b.errs, fmt.Errorf("read the message after outbox id %d of %q: %w", after, topic, err))
			}
			if !ok {
				break
			}
			b.rows[r.ID] = r
			group = append(group, r)
			seen = append(seen, r.ID)
		}
		r := group[i]
		switch {
		case i < len(known):
			err = known[i]
			if len(known) > 1 && !errors.Is(err, ErrBrokerUnavailable) {
				err = o.publishOne(r)
			}
		case i > 0 || len(group) > 1:
			// A call refused whole with no word of each message, even as
			// the broker's state, has its first message tried alone once:
			// the call may have been refused for its size (a broker whose
			// deadline a large batch outlasts), and a round that sent the
			// same call again and again never moved. While the broker is
			// down that is a second publish per round.
			err = o.publishOne(r)
		}
		if err == nil {
			b.sent = append(b.sent, r.ID)
			if len(waiting) == 0 {
				continue
			}
			// The broker takes the topic: the messages refused before
			// this one are the problem. The rest of the topic waits for
			// the next round, in order.
			for _, w := range waiting {
				b.bury[w.ID] = b.refusals[w.ID]
			}
			return each
		}
		last := r.Attempts+1 >= o.cfg.MaxAttempts
		if last && !errors.Is(err, ErrBrokerUnavailable) {
			err = o.settable(b, r, err, reads)
		}
		switch {
		case i < len(known) && !last && errors.Is(err, ErrMessageRejected) && !errors.Is(err, ErrBrokerUnavailable):
			// The publisher told each message's outcome and says this one
			// is refused for what it is (tried alone when others were
			// refused beside it), with attempts left: it stays, its
			// attempt counted, and the walk goes on with the call's other
			// refused messages, which may be of other partitions (a
			// message refused beside another partition's bad one waited
			// for that one's MaxAttempts rounds).
			b.failed[r.ID] = err
		case errors.Is(err, ErrBrokerUnavailable) || !last || errors.Is(err, errNotSettable):
			// The broker's state, attempts left, or a message that cannot
			// be set aside: it stays first in line (behind those that wait
			// for evidence), and nothing behind it is sent.
			b.failed[r.ID] = err
			wait()
			return each
		case errors.Is(err, ErrMessageRejected):
			// The publisher says the message itself is refused, for good:
			// set aside, and the topic goes on in this round.
			b.bury[r.ID] = err
		default:
			if b.refusals == nil {
				b.refusals = map[int64]error{}
			}
			b.refusals[r.ID] = err
			waiting = append(waiting, r)
			if len(waiting) == maxWaitingForEvidence {
				wait()
				return each
			}
		}
	}
	wait() // no evidence: they stay first in line
	return each
}

// perMessageErrors returns the errors of a call's n messages one by one,
// when err carries them (a PublishError with n entries, at least one not
// nil), and whether it does.
func perMessageErrors(err error, n int) ([]error, bool) {
	var pe *PublishError
	if !errors.As(err, &pe) || pe == nil || len(pe.MessageErrors) != n {
		return nil, false
	}
	errs := make([]error, n)
	refused := false
	for i, e := range pe.MessageErrors {
		if e == nil || isNilPointer(e) { // a typed nil pointer says acked too
			continue
		}
		errs[i], refused = readOnce(e), true
	}
	return errs, refused
}

// readOnce returns err with the text its Error method gives now, and
// asks it, once and under recover, every question the relay asks of a
// refusal later (errors.Is ErrBrokerUnavailable and ErrMessageRejected,
// errors.As *PublishError), so that a method of its that panics (a nil
// detail it reads: Error, Unwrap, Is or As) does so here. The error is the
// publisher's, and such a panic later, where nothing recovers it (the walk,
// the relay's record, its round's error), ended the round, and under Run
// or RouterPlugin the process, again at every start while the message
// stayed first in line. An error that panics so is kept as its text alone,
// a refusal of no kind (it uses an attempt); otherwise errors.Is and As
// still see err.
func readOnce(err error) error {
	text, textPanic := func() (text string, p any) {
		defer func() { p = recover() }()
		return err.Error(), nil
	}()
	if textPanic != nil {
		text = fmt.Sprintf("the publisher's error (%T) panicked in its Error method: %v", err, textPanic)
	}
	askPanic := func() (p any) {
		defer func() { p = recover() }()
		var pe *PublishError
		_, _, _ = errors.Is(err, ErrBrokerUnavailable), errors.Is(err, ErrMessageRejected), errors.As(err, &pe)
		return nil
	}()
	if askPanic != nil {
		return fmt.Errorf("%s (the publisher's error, %T, panicked when its chain was read: %v)", text, err, askPanic)
	}
	return textOf{err: err, text: text}
}

// textOf is an error with a text of its own, wrapping err.
type textOf struct {
	err  error
	text string
}

func (e textOf) Error() string { return e.text }
func (e textOf) Unwrap() error { return e.err }

// errNotSettable marks the refusal of a message that cannot be set aside
// now: its id is in the dead-letter table already, or the read that tells
// failed.
var errNotSettable = errors.New("not set aside")

// settable returns err, the refusal of r on its last attempt, as it is when
// r can be set aside, and wrapped with errNotSettable when the dead-letter
// table holds r's id already (the outbox's ids started again) or the read
// that tells failed (recorded in b.errs). Checked before the walk sends
// anything behind r: a message sent past one that then stays would break
// its topic's order.
func (o *Outbox) settable(b *outboxBatch, r outboxRow, err error, reads walkReads) error {
	if reads.deadTaken == nil {
		return err
	}
	taken, rerr := reads.deadTaken(r.ID)
	switch {
	case rerr != nil:
		b.errs = append(b.errs, fmt.Errorf("read whether %s holds outbox id %d: %w", o.target().dead, r.ID, rerr))
		return fmt.Errorf("%w; %w: the dead-letter table could not be read", err, errNotSettable)
	case taken:
		return fmt.Errorf("%w; %w: %s already holds outbox id %d (did the outbox's ids start again?)", err, errNotSettable, o.target().dead, r.ID)
	}
	return err
}

// publishOne publishes one row to its topic. A PublishError whose one
// entry refuses it gives its refusal: that entry's error, whose kind
// (ErrBrokerUnavailable, ErrMessageRejected) the call's own error need not
// repeat, as it need not for a call of several.
func (o *Outbox) publishOne(r outboxRow) error {
	msgs, err := decodeOutboxRows([]outboxRow{r})
	if err != nil {
		return err
	}
	err = o.publishCall(r.Topic, msgs)
	if errs, ok := perMessageErrors(err, 1); ok {
		return errs[0]
	}
	return err
}

// publishCall calls the publisher, turning a panic in it, or in a method
// of the error it returns (readOnce: a typed nil pointer whose Error method
// reads its receiver, an Unwrap that reads a nil detail), into an error: a
// panic on the relay's goroutine, which RouterPlugin starts, would end the
// whole process, handlers included, and again at every start while the
// message stays first in line. Counted as a refusal of the messages (an
// attempt each).
func (o *Outbox) publishCall(topic string, msgs []*message.Message) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("inbox: outbox relay: the publisher panicked publishing to %q: %v", topic, p)
		}
	}()
	if err = o.cfg.Publisher.Publish(topic, msgs...); err != nil {
		return readOnce(err)
	}
	return nil
}

// decodeOutboxRows returns the messages of rows, with their UUIDs, payloads
// and metadata as they were written.
func decodeOutboxRows(rows []outboxRow) ([]*message.Message, error) {
	msgs := make([]*message.Message, len(rows))
	for i, r := range rows {
		md, nilPayload, err := decodeOutboxMetadata(r.Metadata)
		if err != nil {
			return nil, fmt.Errorf("metadata of message %s (outbox id %d): %w", r.UUID, r.ID, err)
		}
		// A copy: a publisher that transforms a payload in place (an
		// encrypting decorator) changed the row's bytes, which the walk
		// sends again one by one after a failed call.
		payload := message.Payload(bytes.Clone(r.Payload))
		switch {
		case nilPayload:
			payload = nil // a tombstone stays one
		case payload == nil:
			payload = message.Payload{} // an empty blob, which a driver may read as nil (modernc.org/sqlite)
		}
		m := message.NewMessage(r.UUID, payload)
		m.Metadata = md
		msgs[i] = m
	}
	return msgs, nil
}

// asciiJSON returns the JSON text b with every character outside ASCII
// written as \uXXXX (a surrogate pair beyond the BMP), which every JSON
// reader decodes as the character: a connection whose character set lacks
// 4-byte characters (MySQL's utf8mb3, charset=utf8) broke them on the way,
// and the server refused the whole list.
func asciiJSON(b []byte) string {
	var out strings.Builder
	out.Grow(len(b))
	for _, r := range string(b) {
		switch {
		case r < utf8.RuneSelf:
			out.WriteRune(r)
		case r > 0xFFFF:
			hi, lo := utf16.EncodeRune(r)
			fmt.Fprintf(&out, "\\u%04x\\u%04x", hi, lo)
		default:
			fmt.Fprintf(&out, "\\u%04x", r)
		}
	}
	return out.String()
}

// maxLastError bounds, in bytes, the refusal text that the relay stores in
// a row's last_error.
const maxLastError = 4096

// noteRefusal runs stmt (outboxSQL.failed, waited or bury) with reason as
// its last error, then args. A last_error column narrower than the text
// (varchar(255) from a migration tool: PostgreSQL's 22001, MySQL/MariaDB's
// 1406 in strict mode) gets it cut to shortLastError bytes, or NULL: the
// failed UPDATE failed the round after its publishes, every round, so that
// the accepted messages were sent again and again and the refused one never
// used an attempt; in the dead-letter table, the message was never set
// aside. On PostgreSQL each try runs under a savepoint (a failed statement
// aborts the transaction).
func (o *Outbox) noteRefusal(ctx context.Context, tx *sqlx.Tx, stmt string, reason error, args []any) (res sql.Result, err error) {
	for _, text := range []any{lastErrorText(reason), lastErrorTextCut(reason, shortLastError), nil} {
		err = o.readInWalk(ctx, tx, func() (err error) {
			res, err = tx.ExecContext(ctx, tx.Rebind(stmt), append([]any{text}, args...)...)
			return err
		})
		if err == nil || !(hasSQLState(err, "22001") || hasMySQLNumber(err, 1406)) {
			return res, err
		}
	}
	return res, err
}

// shortLastError is the length, in bytes, a last error is cut to when the
// last_error column refuses the whole text.
const shortLastError = 200

// lastErrorText returns err's text as the relay stores it in last_error:
// printable ASCII, newlines and tabs, with every other byte or rune written
// as a Go escape
// (\x00, \u00e9, \xff for a byte that is not UTF-8), and cut at
// maxLastError bytes. A refusal's text is the publisher's or the broker's,
// and may quote anything (a webhook's response body, a payload): a NUL or
// bytes that are not UTF-8 are refused by PostgreSQL (22021), and by
// MySQL/MariaDB in strict mode (1366) as is any character that the
// column's character set lacks (a latin1 column, say),
// and MariaDB's text holds 65,535 bytes (1406). Such a refusal failed the
// round after its publishes, so the message never used an attempt nor was
// set aside, and every message of the round was sent again in every round.
func lastErrorText(err error) string { return lastErrorTextCut(err, maxLastError) }

// lastErrorTextCut is lastErrorText cut at max bytes.
func lastErrorTextCut(err error, maxLastError int) string {
	// cutRoom is kept free for the note that says where the text was cut.
	const cutRoom = 64
	s := err.Error()
	var b strings.Builder
	fit, fitAt := 0, 0 // how much of b, and of s, fits with the note
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		var piece string
		switch {
		case r == utf8.RuneError && size == 1:
			piece = fmt.Sprintf(`\x%02x`, s[i])
		case r == '\n' || r == '\t' || (r >= ' ' && r < 0x7f):
			piece = s[i : i+size]
		default:
			piece = strings.Trim(strconv.QuoteRuneToASCII(r), "'")
		}
		if b.Len()+len(piece) > maxLastError {
			return b.String()[:fit] + fmt.Sprintf(" ... (cut at byte %d of %d)", fitAt, len(s))
		}
		b.WriteString(piece)
		i += size
		if b.Len() <= maxLastError-cutRoom {
			fit, fitAt = b.Len(), i
		}
	}
	return b.String()
}

// record deletes the sent rows, counts the failed attempts and moves the
// rows set aside to the dead-letter table, in tx.
func (o *Outbox) record(ctx context.Context, tx *sqlx.Tx, b *outboxBatch) error {
	stmts := o.target().sql
	// key is the bind parameters that find the row of id: its id, and its
	// uuid where the statements check it too (byUUID).
	key := func(id int64) []any {
		if stmts.byUUID {
			return []any{id, b.rows[id].UUID}
		}
		return []any{id}
	}
	deleteRows := func(ids []int64) error {
		if !stmts.byUUID {
			_, err := tx.ExecContext(ctx, stmts.deleteIDs(ids))
			return err
		}
		args := make([]any, 0, 2*len(ids))
		for _, id := range ids {
			args = append(args, key(id)...)
		}
		_, err := tx.ExecContext(ctx, tx.Rebind(stmts.deleteKeyed(ids)), args...)
		return err
	}
	for start := 0; start < len(b.sent); start += outboxInsertChunk {
		ids := b.sent[start:min(len(b.sent), start+outboxInsertChunk)]
		if err := deleteRows(ids); err != nil {
			return fmt.Errorf("inbox: outbox relay: delete %d relayed rows: %w", len(ids), err)
		}
	}
	for id, perr := range b.failed {
		stmt := stmts.failed
		if errors.Is(perr, ErrBrokerUnavailable) {
			stmt = stmts.waited // the broker's state: no attempt used
		}
		if _, err := o.noteRefusal(ctx, tx, stmt, perr, key(id)); err != nil {
			return fmt.Errorf("inbox: outbox relay: count a failed attempt: %w", err)
		}
	}
	// keep leaves a message that could not be set aside first in line, its
	// reason as its last error and an attempt counted.
	keep := func(id int64, reason error) error {
		delete(b.bury, id)
		b.failed[id] = reason
		b.kept = append(b.kept, id)
		if _, err := o.noteRefusal(ctx, tx, stmts.failed, reason, key(id)); err != nil {
			return fmt.Errorf("inbox: outbox relay: count a failed attempt: %w", err)
		}
		return nil
	}
	for id, perr := range b.bury {
		res, err := o.noteRefusal(ctx, tx, stmts.bury, perr, append(key(id), id))
		if err != nil && ctx.Err() == nil {
			// The dead-letter table refuses the row (a column added to it
			// by hand that is NOT NULL, a CHECK, a narrower type): failing
			// the round sent its other messages again in every round, and
			// moved nothing past this one. It stays first in line, with the
			// reason as its last error, and the round records the rest (on
			// PostgreSQL the INSERT ran under a savepoint, rolled back to).
			if err := keep(id, fmt.Errorf("%w; %w: moving it to %s failed: %w", perr, errNotSettable, o.target().dead, err)); err != nil {
				return err
			}
			continue
		}
		if err != nil {
			return fmt.Errorf("inbox: outbox relay: set aside outbox id %d: %w", id, err)
		}
		if n, err := res.RowsAffected(); err != nil {
			return fmt.Errorf("inbox: outbox relay: set aside outbox id %d: %w", id, err)
		} else if n == 0 {
			var ids []int64
			if err := sqlx.SelectContext(ctx, tx, &ids, tx.Rebind(o.target().sql.deadHas), id); err != nil {
				return fmt.Errorf("inbox: outbox relay: set aside outbox id %d: %w", id, err)
			}
			if len(ids) == 0 {
				// The row left the table during the round (an operator,
				// another relay on SQLite, which reads without locks):
				// nothing to set aside.
				delete(b.bury, id)
				continue
			}
			// The dead-letter table holds a row of this id already: the
			// outbox's ids started again (TRUNCATE … RESTART IDENTITY, a
			// restored table) after the walk checked. Failing the round
			// would send its other messages again in every round; the
			// message stays first in line instead, with the reason as its
			// last error.
			if err := keep(id, fmt.Errorf("%w; %w: %s already holds outbox id %d (did the outbox's ids start again?)", perr, errNotSettable, o.target().dead, id)); err != nil {
				return err
			}
			continue
		}
		if err := deleteRows([]int64{id}); err != nil {
			return fmt.Errorf("inbox: outbox relay: set aside outbox id %d: %w", id, err)
		}
	}
	return nil
}
