package pgxinbox_test

import (
	"context"
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/conformance"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// The contract's shared cases (internal/conformance) on the pgx backend, in
// both of its dialects.
func TestConformance(t *testing.T) {
	forEachDialect(t, func(t *testing.T, d inbox.Dialect) {
		pool := openPool(t, "", "pgx-conformance", nil)
		db := pgxinbox.DB(pool)
		t.Cleanup(func() { db.Close() })
		conformance.Run(t, conformance.Backend{
			DB:      db,
			Dialect: d,
			New: func(t *testing.T, table string, o conformance.Options) (message.HandlerMiddleware, error) {
				t.Helper()
				cfg := pgxinbox.Config{Pool: pool, Dialect: d, Table: table, Logger: o.Logger,
					OnProcessed: o.OnProcessed, OnDuplicate: o.OnDuplicate, OnFailed: o.OnFailed, OnReusedID: o.OnReusedID,
					ReusedIDs: o.ReusedIDs, Fingerprint: o.Fingerprint, MessageID: o.MessageID, Consumer: o.Consumer}
				if o.OutboxPublisher != nil {
					cfg.Outbox = func(pgx.Tx) (message.Publisher, error) { return o.OutboxPublisher, nil }
				}
				if o.Outbox != nil {
					cfg.Outbox = pgxinbox.OutboxPublisher(o.Outbox)
				}
				ib, err := pgxinbox.New(cfg)
				if err != nil {
					return nil, err
				}
				t.Cleanup(func() { ib.Close() })
				if !o.NoSchema {
					if err := ib.InitializeSchema(context.Background()); err != nil {
						t.Fatal(err)
					}
				}
				return ib.Middleware, nil
			},
			ConnsInUse: func() int { return int(pool.Stat().AcquiredConns()) },
			Write: func(msg *message.Message, business string) error {
				tx, ok := pgxinbox.TxFromContext(msg.Context())
				if !ok {
					return pgxinbox.MissingTxError(msg.Context())
				}
				_, err := tx.Exec(msg.Context(), "INSERT INTO "+business+" (id) VALUES ($1)", msg.UUID)
				return err
			},
			Exec: func(msg *message.Message, query string) error {
				tx, ok := pgxinbox.TxFromContext(msg.Context())
				if !ok {
					return errors.New("no inbox transaction")
				}
				_, err := tx.Exec(msg.Context(), query)
				return err
			},
			InTx: func(ctx context.Context) bool { _, ok := pgxinbox.TxFromContext(ctx); return ok },
		})
	})
}
