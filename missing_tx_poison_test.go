package inbox_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// A service on pgxinbox whose handler (code written for the database/sql
// inbox, as the README shows it) asks inbox.TxFromContext and returns
// inbox.MissingTxError(msg.Context()) when it finds none: a setup mistake the
// error itself names ("call pgxinbox.TxFromContext…"). ErrNoTx was not
// transient, so the stack's poison queue (default filter !IsTransient) took
// every message: the topic was drained into the poison queue, acked, none
// processed, although the README promises that the inbox's own errors of
// setup are nacked, "so a misconfigured inbox does not drain the topic".
func TestMissingTxSetupMistakeDoesNotDrainTheTopicIntoThePoisonQueue(t *testing.T) {
	t.Parallel()
	probe := testdb.OpenPostgres(t, "")
	pool, err := pgxpool.New(context.Background(), testdb.PostgresDSN())
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	for _, broker := range []string{"gochannel", "kafka"} {
		t.Run(broker, func(t *testing.T) {
			table := "setup_inbox_" + randomSuffix()
			dropLater(t, probe, table)
			ib, err := pgxinbox.New(pgxinbox.Config{Pool: pool, Table: table})
			if err != nil {
				t.Fatal(err)
			}
			defer ib.Close()
			if err := ib.InitializeSchema(context.Background()); err != nil {
				t.Fatal(err)
			}
			sub, pub, poisoned := shutdownBroker(t, broker)
			router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
			if err != nil {
				t.Fatal(err)
			}
			mws, err := ib.Middlewares(inbox.MiddlewaresConfig{PoisonQueue: pub, PoisonTopic: "poison"})
			if err != nil {
				t.Fatal(err)
			}
			router.AddMiddleware(mws...)
			var mu sync.Mutex
			var seen []error
			router.AddConsumerHandler("billing", "orders", sub, func(msg *message.Message) error {
				tx, ok := inbox.TxFromContext(msg.Context())
				if !ok {
					err := inbox.MissingTxError(msg.Context())
					mu.Lock()
					seen = append(seen, err)
					mu.Unlock()
					return err
				}
				_ = tx
				return nil
			})
			ctx, cancel := context.WithCancel(context.Background())
			ran := make(chan struct{})
			go func() { defer close(ran); _ = router.Run(ctx) }()
			<-router.Running()
			const n = 3
			for range n {
				if err := pub.Publish("orders", message.NewMessage(watermill.NewUUID(), []byte("order"))); err != nil {
					t.Fatal(err)
				}
			}
			waitFor(t, func() bool { mu.Lock(); defer mu.Unlock(); return len(seen) >= n })
			time.Sleep(time.Second)
			cancel()
			<-ran
			mu.Lock()
			if !errors.Is(seen[0], inbox.ErrNoTx) {
				t.Fatalf("handler error %v, want ErrNoTx", seen[0])
			}
			t.Logf("the handler returned: %v (IsTransient %v)", seen[0], inbox.IsTransient(seen[0]))
			mu.Unlock()
			got := poisoned()
			if len(got) > 0 {
				t.Errorf("%d of %d messages drained into the poison queue for a setup mistake (reason %q): acked on orders, never processed",
					len(got), n, got[0].Metadata.Get(middleware.ReasonForPoisonedKey))
			}
		})
	}
}
