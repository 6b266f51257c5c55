package pgxinbox

import (
	"context"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/inbox"
)

// OutboxPublisher returns the Config.Outbox of an inbox whose outputs go
// through ob, the outbox relay: the messages a handler returns or publishes
// through inbox.OutboxFromContext are written in the message's pgx
// transaction and sent by ob's relay once it commits.
//
//	ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Publisher: kafkaPublisher}) // db: the pool's *sqlx.DB
//	ib, err := pgxinbox.New(pgxinbox.Config{Pool: pool, Outbox: pgxinbox.OutboxPublisher(ob)})
//	router.AddPlugin(ob.RouterPlugin)
//
// Its writes pass payloads and metadata as bytea, so they work in every pgx
// query mode, the exec and simple_protocol modes that PgBouncer needs
// included. The inbox keeps them until the handler returned and sends
// them in one batch with the COMMIT: one round trip for the outputs and
// the COMMIT together; an INSERT that fails there (the table dropped, say)
// commits nothing and the delivery is nacked with the driver's error. The
// handler therefore does not see its outputs' rows in its own transaction.
// The returned function is safe for concurrent use.
func OutboxPublisher(ob *inbox.Outbox) func(tx pgx.Tx) (message.Publisher, error) {
	return func(tx pgx.Tx) (message.Publisher, error) {
		return ob.PublisherOn(func(ctx context.Context, query string, args ...any) error {
			_, err := tx.Exec(ctx, query, args...)
			return err
		}), nil
	}
}
