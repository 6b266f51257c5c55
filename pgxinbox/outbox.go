package pgxinbox

import (
	"context"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/backend"
)

// OutboxPublisher returns the Config.Outbox of an inbox whose outputs go
// through ob, the outbox relay: the messages a handler returns or publishes
// through inbox.OutboxFromContext are written in the message's pgx
// transaction and sent by ob's relay once it commits.
//
//	db := pgxinbox.DB(pool) // once per pool; the purge can take it too
//	ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Publisher: kafkaPublisher})
//	ib, err := pgxinbox.New(pgxinbox.Config{Pool: pool, Outbox: pgxinbox.OutboxPublisher(ob)})
//	router.AddPlugin(ob.RouterPlugin)
//
// Its writes pass payloads and metadata as bytea, so they work in every pgx
// query mode, the exec and simple_protocol modes that PgBouncer needs
// included. The returned function is safe for concurrent use.
func OutboxPublisher(ob *inbox.Outbox) func(tx pgx.Tx) (message.Publisher, error) {
	return func(tx pgx.Tx) (message.Publisher, error) {
		p := ob.PublisherOn(func(ctx context.Context, query string, args ...any) error {
			_, err := tx.Exec(ctx, query, args...)
			return err
		})
		backend.WritesInTx(p)  // the messages a handler returns may go with COMMIT
		backend.MadeFor(p, tx) // bound to the delivery even behind a decorator
		// The inbox looks the outbox table's schema up through it, in the
		// message's transaction before the handler runs (no connection
		// more), until the Outbox has pinned it.
		backend.ReadsInTx(p, func(ctx context.Context, query string, args []any, dest ...any) error {
			return tx.QueryRow(ctx, query, args...).Scan(dest...)
		})
		return p, nil
	}
}
