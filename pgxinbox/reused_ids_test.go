package pgxinbox_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// purgeBeforeFingerprintRead is a pgx tracer that, once armed, runs purge
// right before a batch that reads a stored fingerprint is sent: a purge on
// another connection that commits between a duplicate's claim and that
// read.
type purgeBeforeFingerprintRead struct {
	armed atomic.Bool
	purge func()
}

func (p *purgeBeforeFingerprintRead) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}
func (p *purgeBeforeFingerprintRead) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {
}

func (p *purgeBeforeFingerprintRead) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	for _, q := range d.Batch.QueuedQueries {
		if strings.Contains(strings.ToLower(q.SQL), "select fingerprint") && p.armed.CompareAndSwap(true, false) {
			p.purge()
		}
	}
	return ctx
}
func (p *purgeBeforeFingerprintRead) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {
}
func (p *purgeBeforeFingerprintRead) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {
}

// A message whose id was processed with other content, delivered while a
// purge deletes that key's row: the claim finds the row and leaves it
// unlocked, the purge commits, and the read of the stored fingerprint finds
// nothing. The delivery is not acked as a duplicate (its content was never
// compared, and after the purge it is a new event): it is nacked with a
// transient error, and its redelivery is processed.
func TestReusedIDCheckNacksADuplicateWhoseRowIsPurgedMeanwhile(t *testing.T) {
	forEachDialect(t, func(t *testing.T, d inbox.Dialect) {
		tracer := &purgeBeforeFingerprintRead{}
		pool := openPool(t, "", "pgxinbox_purged_"+d.String(), func(c *pgxpool.Config) { c.ConnConfig.Tracer = tracer })
		f := newFixture(t, pool)
		rec := &recorder{}
		in := consume(t, f.newInbox(pgxinbox.Config{Dialect: d}), f.writeEffect, rec.Middleware)
		id := watermill.NewUUID()
		if !in.deliver(t, message.NewMessage(id, []byte("order 1"))) {
			t.Fatal(rec.last())
		}
		tracer.purge = func() { // on the delivery's goroutine
			if _, err := pool.Exec(context.Background(), "DELETE FROM "+f.table+" WHERE message_id = $1", id); err != nil {
				t.Error(err)
			}
		}
		tracer.armed.Store(true)
		if in.deliver(t, message.NewMessage(id, []byte("order 2"))) {
			t.Fatalf("acked as a duplicate of a row the purge deleted meanwhile: the event is lost (effects: %d)", f.effects())
		}
		if err := rec.last(); !inbox.IsTransient(err) || errors.Is(err, inbox.ErrMessageIDReused) {
			t.Errorf("nacked with %v, want a transient error, not ErrMessageIDReused", err)
		}
		if !in.deliver(t, message.NewMessage(id, []byte("order 2"))) || f.effects() != 2 {
			t.Errorf("redelivery after the purge: %v, effects %d, want processed (2)", rec.last(), f.effects())
		}
	})
}

// A fingerprint column dropped while the inbox runs (a rolled-back
// migration): the delivery whose claim stores a fingerprint is nacked with a
// transient error wrapping ErrIncompatibleTable, the check turns off, and
// the redelivery is processed.
func TestReusedIDCheckTurnsOffWhenItsColumnIsDroppedWhileRunning(t *testing.T) {
	forEachDialect(t, func(t *testing.T, d inbox.Dialect) {
		pool := openPool(t, "", "pgxinbox_dropped_"+d.String(), nil)
		f := newFixture(t, pool)
		ib := f.newInbox(pgxinbox.Config{Dialect: d})
		rec := &recorder{}
		in := consume(t, ib, f.writeEffect, rec.Middleware)
		if !in.deliver(t, message.NewMessage(watermill.NewUUID(), []byte("order 1"))) {
			t.Fatal(rec.last())
		}
		f.exec("ALTER TABLE " + f.table + " DROP COLUMN fingerprint")
		msg := message.NewMessage(watermill.NewUUID(), []byte("order 2"))
		if in.deliver(t, msg) {
			t.Fatal("acked a message whose claim stored a fingerprint in a dropped column")
		}
		if err := rec.last(); !inbox.IsTransient(err) || !errors.Is(err, inbox.ErrIncompatibleTable) {
			t.Errorf("nacked with %v, want a transient error wrapping ErrIncompatibleTable", err)
		}
		if !in.deliver(t, msg) || f.effects() != 2 {
			t.Errorf("redelivery: %v, effects %d, want processed (2)", rec.last(), f.effects())
		}
	})
}
