package inbox_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// go-sql-driver/mysql's DSN option columnsWithAlias=true (an application
// that joins tables with the same column names asks for it, on the pool it
// shares with the inbox) names every result column "table.column". Every
// read the inbox scans into a struct by column name then fails with sqlx's
// "missing destination name TABLES.table_type in *struct {...}":
//   - the Inbox's table check, so every message is nacked with that error,
//     which is not transient: the default poison filter (!IsTransient)
//     poisons every message of the topic, and its replay fails the same way;
//   - Outbox.Verify passes, and every relay round fails on its read
//     ("missing destination name <table>.id"): nothing ever leaves;
//   - Stats and Purge fail (no row is ever purged).
//
// None of these says which setting is wrong. Either the inbox works on such
// a pool, or it refuses it at startup (Verify, ErrInvalidConfig) with an
// error that names columnsWithAlias, and a message meanwhile is nacked as
// transient, never poisoned.
func TestMySQLColumnsWithAliasIsRefusedOrWorks(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	plain := testdb.OpenMySQL(t, "")
	db := testdb.OpenMySQL(t, "columnsWithAlias=true")
	sfx := randomSuffix()
	table, outbox := "sess_inbox_"+sfx, "sess_outbox_"+sfx
	for _, tbl := range []string{table, outbox, outbox + "_dead"} {
		dropLater(t, plain, tbl)
	}
	made, err := inbox.New(inbox.Config{DB: plain, Table: table})
	if err != nil {
		t.Fatal(err)
	}
	if err := made.InitializeSchema(ctx); err != nil {
		t.Fatal(err)
	}
	madeOutbox, err := inbox.NewOutbox(inbox.OutboxConfig{DB: plain, Table: outbox, Publisher: newBrokerStub()})
	if err != nil {
		t.Fatal(err)
	}
	if err := madeOutbox.InitializeSchema(ctx); err != nil {
		t.Fatal(err)
	}
	refused := func(err error) bool {
		return errors.Is(err, inbox.ErrInvalidConfig) && strings.Contains(err.Error(), "columnsWithAlias")
	}

	t.Run("inbox", func(t *testing.T) {
		ib, err := inbox.New(inbox.Config{DB: db, Table: table})
		if err != nil {
			t.Fatal(err)
		}
		if err := ib.Verify(ctx); err != nil && !refused(err) {
			t.Errorf("Verify: %v; want nil, or ErrInvalidConfig naming columnsWithAlias", err)
		}
		fresh, err := inbox.New(inbox.Config{DB: db, Table: table}) // not verified: the first message checks
		if err != nil {
			t.Fatal(err)
		}
		var calls atomic.Int32
		rec := &recorder{}
		in := newFeed()
		runRouter(t, func(r *message.Router) {
			r.AddMiddleware(rec.Middleware, fresh.Middleware)
			r.AddConsumerHandler("billing", "orders", in, func(*message.Message) error {
				calls.Add(1)
				return nil
			})
		})
		if in.deliver(t, message.NewMessage(watermill.NewUUID(), []byte("order"))) {
			if calls.Load() != 1 {
				t.Errorf("acked with %d handler calls, want 1", calls.Load())
			}
			return
		}
		if err := rec.last(); !inbox.IsTransient(err) || !refused(err) {
			t.Errorf("nacked with %v (transient %v): want a transient ErrInvalidConfig naming columnsWithAlias"+
				" (a poison queue with the default filter takes every message otherwise)", err, inbox.IsTransient(err))
		}
	})

	t.Run("outbox", func(t *testing.T) {
		broker := newBrokerStub()
		ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Table: outbox, Publisher: broker})
		if err != nil {
			t.Fatal(err)
		}
		if err := ob.Verify(ctx); err != nil {
			if !refused(err) {
				t.Errorf("Outbox.Verify: %v; want nil, or ErrInvalidConfig naming columnsWithAlias", err)
			}
			return
		}
		sent := writeOutbox(t, plain, madeOutbox, "invoices", 2)
		round := ob.RelayOnce(ctx)
		if got := broker.uuids("invoices"); len(got) != len(sent) {
			t.Errorf("Outbox.Verify passed, and the relay round sent %d of %d messages: %v", len(got), len(sent), round.Err)
		}
	})

	t.Run("purge", func(t *testing.T) {
		_, err := inbox.Purge(ctx, inbox.PurgeConfig{DB: db, Table: table, OlderThan: time.Hour})
		if err != nil && !refused(err) {
			t.Errorf("Purge: %v; want nil, or ErrInvalidConfig naming columnsWithAlias", err)
		}
		_, err = inbox.Stats(ctx, db, nil, table)
		if err != nil && !refused(err) {
			t.Errorf("Stats: %v; want nil, or ErrInvalidConfig naming columnsWithAlias", err)
		}
	})
}
