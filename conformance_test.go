package inbox_test

import (
	"context"
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/conformance"
)

// The contract's shared cases (internal/conformance) on database/sql, on
// every test database and dialect.
func TestConformance(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		conformance.Run(t, conformance.Backend{
			DB:      db,
			Dialect: tdb.Dialect,
			New: func(t *testing.T, table string, o conformance.Options) (message.HandlerMiddleware, error) {
				t.Helper()
				cfg := inbox.Config{DB: db, Dialect: tdb.Dialect, Table: table, Logger: o.Logger,
					OnProcessed: o.OnProcessed, OnDuplicate: o.OnDuplicate, OnFailed: o.OnFailed, OnReusedID: o.OnReusedID,
					ReusedIDs: o.ReusedIDs, Fingerprint: o.Fingerprint, MessageID: o.MessageID, Consumer: o.Consumer}
				if o.OutboxPublisher != nil {
					cfg.Outbox = func(*sqlx.Tx) (message.Publisher, error) { return o.OutboxPublisher, nil }
				}
				if o.Outbox != nil {
					cfg.Outbox = o.Outbox.Publisher
				}
				ib, err := inbox.New(cfg)
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
			ConnsInUse: func() int { return db.Stats().InUse },
			Write: func(msg *message.Message, business string) error {
				tx, ok := inbox.TxFromContext(msg.Context())
				if !ok {
					return inbox.MissingTxError(msg.Context())
				}
				_, err := tx.ExecContext(msg.Context(), tx.Rebind("INSERT INTO "+business+" (id) VALUES (?)"), msg.UUID)
				return err
			},
			Exec: func(msg *message.Message, query string) error {
				tx, ok := inbox.TxFromContext(msg.Context())
				if !ok {
					return errors.New("no inbox transaction")
				}
				_, err := tx.ExecContext(msg.Context(), query)
				return err
			},
			InTx: func(ctx context.Context) bool { _, ok := inbox.TxFromContext(ctx); return ok },
		})
	})
}
