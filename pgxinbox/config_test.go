package pgxinbox_test

import (
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// New refuses an invalid configuration with ErrInvalidConfig, before
// touching the database.
func TestConfig_InvalidIsRefused(t *testing.T) {
	t.Parallel()
	pool := testdb.OpenPgxPool(t, "")
	for _, tc := range []struct {
		name string
		cfg  pgxinbox.Config
		also error
	}{
		{"NilPool", pgxinbox.Config{}, nil},
		{"MySQLDialect", pgxinbox.Config{Pool: pool, Dialect: inbox.MySQL}, nil},
		{"SQLiteDialect", pgxinbox.Config{Pool: pool, Dialect: inbox.SQLite}, nil},
		{"UnknownIsoLevel", pgxinbox.Config{Pool: pool, IsoLevel: "snapshot"}, nil},
		{"PartitionedSerializable", pgxinbox.Config{Pool: pool, Dialect: inbox.PostgreSQLPartitioned, IsoLevel: pgx.Serializable}, nil},
		{"PartitionedRepeatableRead", pgxinbox.Config{Pool: pool, Dialect: inbox.PostgreSQLPartitioned, IsoLevel: pgx.RepeatableRead}, nil},
		{"InvalidTable", pgxinbox.Config{Pool: pool, Table: `inbox"; DROP TABLE x; --`}, inbox.ErrInvalidTableName},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ib, err := pgxinbox.New(tc.cfg)
			if !errors.Is(err, inbox.ErrInvalidConfig) || (tc.also != nil && !errors.Is(err, tc.also)) {
				t.Errorf("New: %v, want ErrInvalidConfig", err)
			}
			if ib != nil {
				t.Error("New returned an inbox with its error")
			}
		})
	}
}

// The message's transaction is read-write at every accepted isolation level:
// Config has no way to ask for READ ONLY, which could never hold a claim.
func TestConfig_TransactionIsReadWrite(t *testing.T) {
	t.Parallel()
	for _, level := range []pgx.TxIsoLevel{"", pgx.ReadCommitted, pgx.RepeatableRead, pgx.Serializable, pgx.ReadUncommitted} {
		t.Run("level="+string(level), func(t *testing.T) {
			t.Parallel()
			pool := testdb.OpenPgxPool(t, "")
			f := newFixture(t, pool)
			ib := f.newInbox(pgxinbox.Config{IsoLevel: level})
			var readOnly string
			in := consume(t, ib, func(msg *message.Message) error {
				tx, _ := pgxinbox.TxFromContext(msg.Context())
				if err := tx.QueryRow(msg.Context(), "SHOW transaction_read_only").Scan(&readOnly); err != nil {
					return err
				}
				return f.writeEffect(msg)
			})
			if !in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
				t.Fatal("nacked")
			}
			if readOnly != "off" {
				t.Errorf("transaction_read_only %q, want off", readOnly)
			}
			f.expectRows(1, 1)
		})
	}
}

// A closed pool fails the delivery with an error (a nack), writing nothing.
func TestConfig_ClosedPoolIsAnError(t *testing.T) {
	t.Parallel()
	pool := testdb.OpenPgxPool(t, "")
	f := newFixture(t, testdb.OpenPgxPool(t, ""))
	ib := f.newInbox(pgxinbox.Config{Pool: pool})
	pool.Close()
	rec := &recorder{}
	in := consume(t, ib, f.writeEffect, rec.Middleware)
	if in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
		t.Error("acked a message on a closed pool")
	}
	if rec.last() == nil {
		t.Error("no error on a closed pool")
	}
	f.expectRows(0, 0)
}
