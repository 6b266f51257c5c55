package pgxinbox_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// The handler's transaction is a real pgx.Tx: nested transactions
// (savepoints) commit or roll back inside it, and CopyFrom, SendBatch and
// LargeObjects write in it; all of it commits with the inbox row, or none
// of it when the handler fails.
func TestPgxTx_HandlerUsesPgxFeatures(t *testing.T) {
	forEachDialect(t, func(t *testing.T, d inbox.Dialect) {
		pool := testdb.OpenPgxPool(t, "")
		f := newFixture(t, pool)
		ib := f.newInbox(pgxinbox.Config{Dialect: d})
		var mu sync.Mutex
		oids := map[string]uint32{}
		t.Cleanup(func() {
			for _, oid := range oids {
				pool.Exec(context.Background(), "SELECT lo_unlink($1) FROM pg_largeobject_metadata WHERE oid = $1", oid)
			}
		})
		rec := &recorder{}
		in := consume(t, ib, func(msg *message.Message) error {
			ctx := msg.Context()
			tx, ok := pgxinbox.TxFromContext(ctx)
			if !ok {
				return errors.New("no pgx transaction")
			}
			insert := "INSERT INTO " + f.effect + " (message_id) VALUES ($1)"
			// A savepoint rolled back: its row is gone, the transaction goes on.
			sp, err := tx.Begin(ctx)
			if err != nil {
				return err
			}
			if _, err := sp.Exec(ctx, insert, msg.UUID+"/rolled-back-savepoint"); err != nil {
				return err
			}
			if err := sp.Rollback(ctx); err != nil {
				return err
			}
			// A savepoint released: its row commits with the inbox row.
			sp, err = tx.Begin(ctx)
			if err != nil {
				return err
			}
			if _, err := sp.Exec(ctx, insert, msg.UUID+"/savepoint"); err != nil {
				return err
			}
			if err := sp.Commit(ctx); err != nil {
				return err
			}
			if _, err := tx.CopyFrom(ctx, pgx.Identifier{f.effect}, []string{"message_id"},
				pgx.CopyFromRows([][]any{{msg.UUID + "/copy-1"}, {msg.UUID + "/copy-2"}})); err != nil {
				return err
			}
			b := &pgx.Batch{}
			b.Queue(insert, msg.UUID+"/batch-1")
			b.Queue(insert, msg.UUID+"/batch-2")
			if err := tx.SendBatch(ctx, b).Close(); err != nil {
				return err
			}
			los := tx.LargeObjects()
			oid, err := los.Create(ctx, 0)
			if err != nil {
				return err
			}
			mu.Lock()
			oids[msg.Metadata.Get("delivery")] = oid
			mu.Unlock()
			lo, err := los.Open(ctx, oid, pgx.LargeObjectModeWrite)
			if err != nil {
				return err
			}
			if _, err := lo.Write([]byte("invoice " + msg.UUID)); err != nil {
				return err
			}
			if err := lo.Close(); err != nil {
				return err
			}
			if msg.Metadata.Get("delivery") == "fail" {
				return errors.New("declined")
			}
			return nil
		}, rec.Middleware)
		msg := message.NewMessage(watermill.NewUUID(), nil)
		if in.deliver(t, labelled(msg, "fail")) {
			t.Fatal("acked a failed try")
		}
		f.expectRows(0, 0)
		if !in.deliver(t, labelled(msg, "ok")) {
			t.Fatalf("nacked: %v", rec.last())
		}
		f.expectRows(5, 1) // savepoint, 2 copied, 2 batched
		var n int
		if err := pool.QueryRow(context.Background(), "SELECT count(*) FROM "+f.effect+" WHERE message_id LIKE '%/rolled-back-savepoint'").Scan(&n); err != nil || n != 0 {
			t.Errorf("rolled-back savepoint rows %d (%v), want 0", n, err)
		}
		for label, want := range map[string]bool{"fail": false, "ok": true} {
			var content []byte
			err := pool.QueryRow(context.Background(), "SELECT lo_get($1)", oids[label]).Scan(&content)
			if got := err == nil; got != want {
				t.Errorf("%s: large object %d exists %v (%v), want %v", label, oids[label], got, err, want)
			}
			if want && string(content) != fmt.Sprintf("invoice %s", msg.UUID) {
				t.Errorf("large object content %q", content)
			}
		}
		expectNoConnHeld(t, pool)
	})
}
