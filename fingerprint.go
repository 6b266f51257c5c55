package inbox

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox/internal/backend"
)

// The states of Inbox.fingerprints.
const (
	fingerprintsUnresolved int32 = iota
	fingerprintsOff
	fingerprintsOn
)

// fingerprintSize is how many bytes of the content's SHA-256 the claim
// stores: 128 bits, so that two different contents of one id match by
// chance with a probability of about 2^-128.
const fingerprintSize = 16

// fingerprintNote is the line SchemaSQL prints about the fingerprint column.
const fingerprintNote = "-- fingerprint: first 16 bytes of the SHA-256 of the content (Config.ReusedIDs), NULL matching any.\n"

// payloadOf is Config.Fingerprint's default: the payload.
func payloadOf(msg *message.Message) []byte { return msg.Payload }

// fingerprintsOn reports whether claims store and duplicates compare
// fingerprints. Resolved before the first claim (resolveFingerprints).
func (ib *Inbox) fingerprintsOn() bool { return ib.fingerprints.Load() == fingerprintsOn }

// ReusedIDsDetected reports whether the inbox detects reused message ids
// (Config.ReusedIDs): true once a check of the table (Verify,
// InitializeSchema, RouterPlugin or the first claim) found its fingerprint
// column and ReusedIDs is not ReusedIDsOff; false before that check, and
// for good (until the process starts again) when the column is missing. It
// is safe for concurrent use.
func (ib *Inbox) ReusedIDsDetected() bool { return ib.fingerprintsOn() }

// claimQuery returns the claim statement: with the fingerprint once the
// fingerprints are on.
func (ib *Inbox) claimQuery() string {
	if ib.fingerprintsOn() {
		return ib.claimFingerprintSQL
	}
	return ib.claimSQL
}

// contentFingerprint returns the fingerprint the claim of msg stores, or
// nil when the fingerprints are off.
func (ib *Inbox) contentFingerprint(msg *message.Message) []byte {
	if !ib.fingerprintsOn() {
		return nil
	}
	sum := sha256.Sum256(ib.fingerprintOf(msg))
	return sum[:fingerprintSize]
}

// changedFingerprints remembers, for the keys whose delivery failed after
// the handler changed what the fingerprint is taken of (decoded
// msg.Payload in place), the fingerprint the claim stored and the one of
// the message as the handler left it (deliveryFingerprint): the
// changedFingerprintsSize latest. While it is empty a claim pays one atomic
// load for it. The zero value is ready; safe for concurrent use.
type changedFingerprints struct {
	n    atomic.Int64
	mu   sync.Mutex
	ring keyRing[changedFingerprint]
}

// changedFingerprint is a failed delivery's claimed fingerprint and the one
// of its message as the handler left it.
type changedFingerprint struct{ claimed, changed [fingerprintSize]byte }

// changedFingerprintsSize is how many keys changedFingerprints remembers.
const changedFingerprintsSize = 4096

// claimed returns the fingerprint the key's failed delivery claimed with
// when fp is the one of its message as the handler left it.
func (c *changedFingerprints) claimed(consumer, id string, fp []byte) ([]byte, bool) {
	if c.n.Load() == 0 {
		return nil, false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.ring.get(recentKey{consumer, id})
	if !ok || !bytes.Equal(e.changed[:], fp) {
		return nil, false
	}
	return bytes.Clone(e.claimed[:]), true
}

// remember records a failed delivery's claimed and changed fingerprints.
func (c *changedFingerprints) remember(consumer, id string, claimed, changed []byte) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.ring.put(recentKey{consumer, id}, changedFingerprint{claimed: [fingerprintSize]byte(claimed), changed: [fingerprintSize]byte(changed)},
		changedFingerprintsSize)
	c.n.Store(int64(len(c.ring.byKey)))
}

// deliveryFingerprint returns the fingerprint d's claim stores: the one of
// its message, unless this inbox saw a delivery of the key fail after the
// handler changed its message into this very content: then the one that
// delivery claimed with. A handler that decoded msg.Payload in place and
// failed is run again with the changed message: by a Retry middleware
// (outside the inbox, as it must be) with the same *message.Message, by
// watermill-kafka's nack with a copy of it. The attempt that committed
// stored the fingerprint of what the handler made of the payload, and the
// broker's redelivery of the message as it was sent was refused as a
// reused id. Content that is neither (a producer that reused the id) is
// compared as its own.
func (ib *Inbox) deliveryFingerprint(d *delivery) []byte {
	d.userCode = "Config.Fingerprint"
	fp := ib.contentFingerprint(d.msg)
	d.userCode = ""
	if fp == nil {
		return nil
	}
	if claimed, ok := ib.changedFingerprints.claimed(d.consumer, d.id, fp); ok {
		return claimed
	}
	return fp
}

// rememberChangedFingerprint records, for a delivery that failed, the
// fingerprint it claimed with when the handler changed what the
// fingerprint is taken of (deliveryFingerprint). Config.Fingerprint is
// user code: a panic in it here records nothing.
func (d *delivery) rememberChangedFingerprint() {
	if d.fingerprint == nil {
		return
	}
	defer func() { _ = recover() }()
	if now := d.ib.contentFingerprint(d.msg); now != nil && !bytes.Equal(now, d.fingerprint) {
		d.ib.changedFingerprints.remember(d.consumer, d.id, d.fingerprint, now)
	}
}

// fingerprintNotGrantedError is the error of a fingerprint column that the
// database user may not read and write as the claims do (err: the refusal,
// or nil when the catalog told): the inbox does not start its check, nor
// skip it, until it may. It wraps ErrIncompatibleTable, as a fingerprint
// column of a wrong type does: per message transient, nacked after a wait.
func (ib *Inbox) fingerprintNotGrantedError(err error) error {
	grant := "SELECT (fingerprint), INSERT (fingerprint)"
	if ib.dialect.server() == serverMySQL {
		grant += ", UPDATE (fingerprint)" // its claim's ON DUPLICATE KEY UPDATE reads and writes it
	}
	msg := fmt.Errorf("%w: the database user may not read and write %s.fingerprint (a column-level GRANT made before the"+
		" column was added does not cover it): GRANT %s ON %s TO <the service's user or role>; or set Config.ReusedIDs to"+
		" ReusedIDsOff", ErrIncompatibleTable, ib.table, grant, ib.table.quoted(ib.dialect))
	if err != nil {
		return fmt.Errorf("%w: %w", msg, err)
	}
	return msg
}

// hiddenNote is what the log of a missing fingerprint column adds on
// MySQL/MariaDB, which hide from information_schema a column the database
// user has no privilege on (a column-level GRANT made before the column was
// added), and then refuse a read of it as they refuse a read of a column
// that does not exist: the inbox cannot tell the two apart.
func hiddenNote(d Dialect) string {
	if d.server() != serverMySQL {
		return ""
	}
	return " (or one the database user has no privilege on, which MySQL/MariaDB hide: grant SELECT, INSERT and UPDATE on it)"
}

// fingerprintNotGranted follows the fingerprint column's type, in what
// fingerprintColumnSQL reads, when the session's user may not read and
// write it (PostgreSQL; MySQL/MariaDB tell it by the write probe of Verify,
// verifyWritable, and hide from information_schema a column the user has no
// privilege on at all, which the inbox then takes for missing).
const fingerprintNotGranted = " not granted"

// resolveFingerprints decides, once, before the inbox's first claim and
// after the table check, whether the table has the fingerprint column:
// with it the fingerprints are on for good; without it they are off for
// good (until the process starts again) and the inbox logs, once, the
// statement that adds the column. With ReusedIDsOff it does nothing. It
// reads the catalog only, in a short read-only transaction of its own.
func (ib *Inbox) resolveFingerprints(ctx context.Context) error {
	if ib.fingerprints.Load() != fingerprintsUnresolved {
		return nil
	}
	ib.claimMu.Lock()
	defer ib.claimMu.Unlock()
	if ib.fingerprints.Load() != fingerprintsUnresolved {
		return nil
	}
	types, err := ib.fingerprintColumnTypes(ctx, false)
	if err != nil {
		return poolerHint(fmt.Errorf("inbox: look for the fingerprint column of %s: %w", ib.table, err))
	}
	if len(types) > 0 {
		if _, notGranted := strings.CutSuffix(types[0], fingerprintNotGranted); notGranted {
			return ib.fingerprintNotGrantedError(nil) // not resolved: every check until it is granted says so
		}
		if fix, ok := ib.dialect.fingerprintColumnFits(ib.table, types[0]); !ok {
			// Not resolved: every check until it is fixed says so.
			return fmt.Errorf("%w: %s.fingerprint is %s, which does not store a 16-byte fingerprint as it is given;"+
				" fix it with: %s; or set Config.ReusedIDs to ReusedIDsOff", ErrIncompatibleTable, ib.table, types[0], fix)
		}
		ib.fingerprints.Store(fingerprintsOn)
		return nil
	}
	ib.fingerprints.Store(fingerprintsOff)
	ib.logger.get().Info("Inbox: the table has no fingerprint column"+hiddenNote(ib.dialect)+", so a message id reused for other content is skipped as a duplicate"+
		" (Config.ReusedIDs); add the column, and restart, to detect it: "+AddFingerprintColumnSQL(ib.dialect, ib.table.String()),
		watermill.LogFields{"table": ib.table.String(), "reused_ids": ib.reusedIDs.String()})
	return nil
}

// fingerprintColumnTypes reads the catalog for the table's fingerprint
// column and returns its type, or nothing without the column. With
// tableMustExist it first reads the table itself, so that a table that is
// gone is an error, not a missing column. It runs in a short read-only
// transaction, as every catalog read of the inbox: lib/pq's unnamed
// statement outside one can lose its server connection behind a
// transaction-mode pooler between Parse and Bind.
func (ib *Inbox) fingerprintColumnTypes(ctx context.Context, tableMustExist bool) ([]string, error) {
	query, args := ib.dialect.fingerprintColumnSQL(ib.table)
	var types []string
	err := withReadTx(ctx, ib.db, ib.dialect, func(q sqlx.QueryerContext) error {
		if tableMustExist {
			rows, err := q.QueryxContext(ctx, "SELECT 1 FROM "+ib.table.quoted(ib.dialect)+" WHERE 1 = 0")
			if err != nil {
				return err
			}
			if err := rows.Close(); err != nil {
				return err
			}
		}
		return sqlx.SelectContext(ctx, q, &types, ib.db.Rebind(query), args...)
	})
	return types, err
}

// recheckFingerprintColumn runs after a delivery whose claim, storing a
// fingerprint, failed and was rolled back, and returns the delivery's
// error. When the table's fingerprint column is gone (dropped while the
// process ran: a rolled-back migration), every such claim fails on it: the
// check turns off for good, as it does at startup without the column (an
// Error line says so), and the error becomes transient, wrapping
// ErrIncompatibleTable, so that a poison queue filter keeps the message
// and its redelivery is processed without the check. Otherwise, or when
// the catalog cannot be read, err is returned as it is. A transient err
// (a deadlock, a lost connection) reads nothing.
func (ib *Inbox) recheckFingerprintColumn(d *delivery, err error) error {
	if err == nil || IsTransient(err) {
		return err
	}
	gone := fmt.Errorf("inbox: %q/%q: %w: %s has no fingerprint column any more (dropped while the inbox ran),"+
		" so reused ids are not detected until the process starts again with it: %w", d.consumer, d.id, ErrIncompatibleTable, ib.table, err)
	if ib.fingerprints.Load() == fingerprintsOff {
		return &misconfiguredError{gone} // another delivery found it gone
	}
	// Not under claimMu: the read waits for a connection of the pool, and
	// deliveries that hold one may be waiting for claimMu. A table that is
	// gone (the read fails) is not a column that is.
	types, cerr := ib.fingerprintColumnTypes(d.sctx, true)
	if cerr != nil || len(types) > 0 {
		return err // the table is gone, or the column is there
	}
	ib.claimMu.Lock()
	defer ib.claimMu.Unlock()
	if ib.fingerprints.Load() == fingerprintsOff {
		return &misconfiguredError{gone}
	}
	ib.fingerprints.Store(fingerprintsOff)
	// The statements that store or read a fingerprint go: the next claims
	// prepare, and resolve the key lock's claim, without it.
	_ = closeStmts(&ib.claimStmt, &ib.fpStmt) // their error changes nothing here
	ib.forgetKeyLocking()
	ib.logger.get().Error("Inbox: the table's fingerprint column is gone; a message id reused for other content is skipped as a duplicate"+
		" from now on (Config.ReusedIDs); add the column back, and restart, to detect it: "+AddFingerprintColumnSQL(ib.dialect, ib.table.String()),
		err, watermill.LogFields{"table": ib.table.String(), "reused_ids": ib.reusedIDs.String()})
	return &misconfiguredError{gone}
}

// AddFingerprintColumnSQL returns the statement that adds the fingerprint
// column (Config.ReusedIDs) to an inbox table made before it existed, for
// dialect d and table (as in Config.Table; not checked here). On every
// supported database it changes the catalog only and rewrites no row:
// PostgreSQL 11+ adds a column without a default without a rewrite, but
// waits for an ACCESS EXCLUSIVE lock, which queues behind every running
// transaction on the table and holds back every claim until granted (run
// it with a lock_timeout and retry); MariaDB 10.3+ and MySQL 8.0.12+ add a
// last nullable column in place (ALGORITHM=INSTANT); SQLite's ADD COLUMN
// edits the schema only. Rows written before it hold NULL and match any
// content. On PostgreSQLPartitioned it returns two statements, separated by
// ";\n": the column, then the claim function's overload that stores the
// fingerprint (CREATE OR REPLACE FUNCTION "<table>_claim"(text, text,
// bigint, bytea), as InitializeSchema makes it), without which each claim
// takes two statements, one round trip more.
func AddFingerprintColumnSQL(d Dialect, table string) string {
	t, err := parseTableName(table)
	if err != nil || d == nil {
		return ""
	}
	stmt := "ALTER TABLE " + t.quoted(d) + " ADD COLUMN " + strings.Join(strings.Fields(d.fingerprintColumn()), " ")
	if d.server() == serverMySQL {
		stmt += ", ALGORITHM=INSTANT"
	}
	if fn := d.claimFunctionSQL(t, true); fn != "" {
		stmt += ";\n" + fn
	}
	return stmt
}

// errReusedID is the error of a delivery refused under ReusedIDsRefuse.
func (d *delivery) errReusedID(stored []byte) error {
	return fmt.Errorf("inbox: %q/%q: %w: processed before with content of fingerprint %x, this delivery's is %x"+
		" (a producer reused the message id; Config.ReusedIDs)", d.consumer, d.id, ErrMessageIDReused, stored, d.fingerprint)
}

// checkReusedID runs when the claim found the key processed: it reads the
// stored fingerprint and compares it with the delivery's. A match, a row
// without a fingerprint (or with a value no claim writes), or fingerprints
// off: a duplicate (nil). Otherwise
// d.reused is set, and under ReusedIDsRefuse the error wraps
// ErrMessageIDReused; under ReusedIDsWarn the reuse is logged and the
// delivery stays a duplicate.
func (d *delivery) checkReusedID() error {
	if d.fingerprint == nil || d.ib.recentFingerprints.matches(d.consumer, d.id, d.fingerprint) {
		return nil
	}
	stored, err := d.tx.storedFingerprint(d.sctx, d.consumer, d.id)
	if errors.Is(err, backend.ErrKeyGone) {
		// A purge deleted the row after the claim saw it (PostgreSQL's
		// claim leaves a processed row unlocked): neither a duplicate, whose
		// content could not be compared, nor a reuse. Transient: the
		// redelivery's claim finds the key free and processes the message
		// as the new event it is after the purge.
		return fmt.Errorf("inbox: %q/%q: %w; redeliver to claim it again", d.consumer, d.id, errKeyPurged)
	}
	if isPrivilegeRefusal(err) {
		// A GRANT taken back while the inbox ran: the message is not at
		// fault (transient, as a claim refused so; it was poisoned).
		d.waitAfterEnd = &d.ib.refusedClaims
		return &misconfiguredError{fmt.Errorf("inbox: %q/%q: read the stored fingerprint: the database user lacks SELECT on"+
			" %s.fingerprint (GRANT SELECT (fingerprint) ON %s TO <the service's user or role>): %w",
			d.consumer, d.id, d.ib.table, d.ib.table.quoted(d.ib.dialect), err)}
	}
	if err != nil {
		return fmt.Errorf("inbox: %q/%q: read the stored fingerprint: %w", d.consumer, d.id, d.commitTimedOut(err))
	}
	// A value that is not 16 bytes was not written by a claim (NULL, or a
	// hand-made column's default, an empty string), nor are 16 zero bytes
	// (MySQL's binary(16) pads an empty default to them; a SHA-256 starts
	// so with a probability of 2^-128): it matches, as none does. But a
	// column whose type changed while the inbox ran (to text on
	// PostgreSQL, to a longer binary on MySQL/MariaDB) holds what the
	// claims wrote in another form, and every reused id would be skipped:
	// such a value is matched only while the column's type still fits.
	if len(stored) == 0 || len(stored) == fingerprintSize && allZero(stored) {
		return nil
	}
	if len(stored) != fingerprintSize {
		d.oddFingerprint = true // handle asks the catalog, once rolled back
		return errOddFingerprint
	}
	if bytes.Equal(stored, d.fingerprint) {
		d.ib.recentFingerprints.remember(d.consumer, d.id, stored)
		return nil
	}
	d.reused = true
	if d.ib.reusedIDs == ReusedIDsRefuse {
		return d.errReusedID(stored)
	}
	f := d.fields()
	f["stored_fingerprint"], f["fingerprint"] = fmt.Sprintf("%x", stored), fmt.Sprintf("%x", d.fingerprint)
	d.ib.logger.get().Info("Inbox: message id reused for other content; skipped as a duplicate (Config.ReusedIDs is ReusedIDsWarn)", f)
	return nil
}

// errOddFingerprint is checkReusedID's error for a stored fingerprint that
// is not 16 bytes, which handle replaces once the transaction is rolled
// back (settleOddFingerprint).
var errOddFingerprint = errors.New("inbox: the stored fingerprint is not 16 bytes")

// settleOddFingerprint decides, after the rollback, a duplicate whose
// stored fingerprint is not 16 bytes (checkReusedID), by reading the
// fingerprint column's type on a connection of its own: while it still fits,
// the value is a hand-made column's default and the delivery is the
// duplicate it was (nil); otherwise the error is transient and wraps
// ErrIncompatibleTable with the fix, and the delivery waits before it
// returns, as after a missing table: the duplicate cannot be told from a
// reused id until the column is fixed, so it is nacked, not skipped. New
// messages are claimed as before.
func (ib *Inbox) settleOddFingerprint(d *delivery) error {
	types, err := ib.fingerprintColumnTypes(d.sctx, false)
	if err != nil {
		return fmt.Errorf("inbox: %q/%q: %w; read the fingerprint column's type: %w", d.consumer, d.id, errOddFingerprint, poolerHint(err))
	}
	if len(types) > 0 {
		types[0], _ = strings.CutSuffix(types[0], fingerprintNotGranted) // its read just worked
		if fix, ok := ib.dialect.fingerprintColumnFits(ib.table, types[0]); !ok {
			d.waitAfterEnd = &ib.tableFailures
			return &misconfiguredError{fmt.Errorf("inbox: %q/%q: %w: %s.fingerprint is now %s, which does not store a 16-byte"+
				" fingerprint as it is given (changed while the inbox ran), so this duplicate cannot be told from a reused id;"+
				" fix it with: %s; or set Config.ReusedIDs to ReusedIDsOff", d.consumer, d.id, ErrIncompatibleTable, ib.table, types[0], fix)}
		}
	}
	// Still fits, or dropped meanwhile (recheckFingerprintColumn's case, at
	// the next claim): the duplicate it was.
	d.span.AddEvent("inbox.duplicate")
	d.duplicate = true
	return nil
}

// errKeyPurged is the error of a duplicate whose row a purge deleted
// between the claim and the read of its fingerprint; IsTransient reports it
// transient.
var errKeyPurged = fmt.Errorf("the key's row was purged while the delivery read its fingerprint (%w)", backend.ErrKeyGone)

// allZero reports whether b holds only zero bytes.
func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// recentFingerprintsSize is how many keys recentFingerprints remembers: at
// most a few hundred KiB per inbox (a UUID key and its fingerprint take
// about 100 bytes).
const recentFingerprintsSize = 4096

// recentFingerprints remembers the fingerprints of the keys this inbox
// committed last (the recentFingerprintsSize latest), so that a duplicate of
// one of them, redelivered to this process (an ack that was lost, offsets
// replayed from the last commit, a producer's retry into the same
// partition), is told a duplicate without the read of its stored
// fingerprint. Only a match is taken from it: a committed row's fingerprint
// never changes, and whatever the table holds now, content that matches
// what this inbox committed for the key is a duplicate of a processed
// message. A mismatch, or a key it does not hold, reads the stored
// fingerprint as before, so a stale entry (the row purged, the id claimed
// again elsewhere) never refuses a message. Safe for concurrent use.
type recentFingerprints struct {
	mu   sync.Mutex
	ring keyRing[[fingerprintSize]byte]
}

// recentKey is a claim's key.
type recentKey struct{ consumer, id string }

// matches reports whether the fingerprint remembered for the key is fp.
func (r *recentFingerprints) matches(consumer, id string, fp []byte) bool {
	r.mu.Lock()
	stored, ok := r.ring.get(recentKey{consumer, id})
	r.mu.Unlock()
	return ok && bytes.Equal(stored[:], fp)
}

// remember records fp, a fingerprint of fingerprintSize bytes, as the
// key's committed one, replacing the oldest key once full.
func (r *recentFingerprints) remember(consumer, id string, fp []byte) {
	r.mu.Lock()
	r.ring.put(recentKey{consumer, id}, [fingerprintSize]byte(fp), recentFingerprintsSize)
	r.mu.Unlock()
}

// keyRing holds a value for each of the latest keys put, at most the size
// its put is given: a map, and a ring of its keys in the order they came
// whose oldest is replaced once full. The zero value is ready; its owner
// locks it.
type keyRing[V any] struct {
	byKey map[recentKey]V
	order []recentKey
	next  int
}

func (r *keyRing[V]) get(k recentKey) (V, bool) {
	v, ok := r.byKey[k]
	return v, ok
}

// put sets k's value, forgetting the oldest key when size keys are held.
func (r *keyRing[V]) put(k recentKey, v V, size int) {
	if r.byKey == nil {
		r.byKey = make(map[recentKey]V, size)
		r.order = make([]recentKey, 0, size)
	}
	if _, ok := r.byKey[k]; !ok {
		if len(r.order) < size {
			r.order = append(r.order, k)
		} else {
			delete(r.byKey, r.order[r.next])
			r.order[r.next] = k
			r.next = (r.next + 1) % size
		}
	}
	r.byKey[k] = v
}
