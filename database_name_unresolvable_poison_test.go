package inbox_test

import (
	"context"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// The database's host name stops resolving for a moment (a failover that
// moves the DNS record, a Kubernetes headless service with no ready pod,
// which answers NXDOMAIN, a DNS outage) while messages arrive. The inbox's
// own BEGIN cannot connect: pgx reports a *net.DNSError ("hostname resolving
// error"), which IsTransient classes as an error "of the message", and the
// stack's poison queue (default filter !IsTransient) took the message,
// although nothing about it was wrong: acked on its topic, never processed
// once the name resolved again. It must wait on its topic and be processed. The database itself (real PostgreSQL on
// 127.0.0.1) and the broker are real; the resolver is pgx's LookupFunc, which
// answers 127.0.0.1 or, during the outage, NXDOMAIN.
func TestDatabaseHostThatBrieflyDoesNotResolveDoesNotPoisonMessages(t *testing.T) {
	t.Parallel()
	for _, broker := range []string{"gochannel", "kafka"} {
		t.Run(broker, func(t *testing.T) {
			t.Parallel()
			probe := testdb.OpenPostgres(t, "")
			var outage atomic.Bool
			cfg, err := pgx.ParseConfig(testdb.PostgresDSN())
			if err != nil {
				t.Fatal(err)
			}
			cfg.Host = "poison-db.internal"
			cfg.LookupFunc = func(ctx context.Context, host string) ([]string, error) {
				if outage.Load() {
					return nil, &net.DNSError{Err: "no such host", Name: host, IsNotFound: true}
				}
				return []string{"127.0.0.1"}, nil
			}
			db := sqlx.NewDb(stdlib.OpenDB(*cfg), "pgx")
			defer db.Close()
			db.SetMaxIdleConns(0) // each transaction connects: the outage shows at once
			sfx := randomSuffix()
			business, table := "poison_business_"+sfx, "poison_inbox_"+sfx
			exec(t, probe, "CREATE TABLE "+business+" (id text PRIMARY KEY)")
			dropLater(t, probe, business)
			ib, err := inbox.New(inbox.Config{DB: db, Table: table})
			if err != nil {
				t.Fatal(err)
			}
			dropLater(t, probe, table)
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
			var lastErr atomic.Pointer[error]
			router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
				return func(msg *message.Message) ([]*message.Message, error) {
					out, err := h(msg)
					if err != nil {
						lastErr.Store(&err)
					}
					return out, err
				}
			})
			router.AddConsumerHandler("billing", "orders", sub, func(msg *message.Message) error {
				tx, _ := inbox.TxFromContext(msg.Context())
				_, err := tx.ExecContext(msg.Context(), "INSERT INTO "+business+" VALUES ($1)", msg.UUID)
				return err
			})
			ctx, cancel := context.WithCancel(context.Background())
			ran := make(chan struct{})
			go func() { defer close(ran); _ = router.Run(ctx) }()
			<-router.Running()

			outage.Store(true) // the name stops resolving for two seconds
			if err := pub.Publish("orders", message.NewMessage(watermill.NewUUID(), []byte("order"))); err != nil {
				t.Fatal(err)
			}
			time.Sleep(2 * time.Second)
			outage.Store(false)
			deadline := time.Now().Add(10 * time.Second)
			for count(t, probe, business, "") == 0 && time.Now().Before(deadline) {
				time.Sleep(100 * time.Millisecond)
			}
			cancel()
			<-ran
			if p := lastErr.Load(); p != nil {
				t.Logf("the inbox returned: %v (IsTransient %v)", *p, inbox.IsTransient(*p))
			}
			got := poisoned()
			for _, p := range got {
				t.Errorf("message %s poisoned while the database's name did not resolve (reason %q); business rows %d: acked, never processed",
					p.UUID, p.Metadata.Get(middleware.ReasonForPoisonedKey), count(t, probe, business, ""))
			}
			if n := count(t, probe, business, ""); n != 1 && len(got) == 0 {
				t.Errorf("business rows %d, want 1", n)
			}
		})
	}
}
