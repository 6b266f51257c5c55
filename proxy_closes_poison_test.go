package inbox_test

import (
	"context"
	"io"
	"net"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// closingProxy forwards 127.0.0.1:<port> to PostgreSQL; while down, it accepts
// and closes each connection at once, as a TCP proxy or load balancer in
// front of a database (HAProxy, a cloud SQL proxy) does while its backend is
// restarting.
func closingProxy(t *testing.T, target string, down *atomic.Bool) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			if down.Load() {
				c.Close()
				continue
			}
			go func() {
				s, err := net.Dial("tcp", target)
				if err != nil {
					c.Close()
					return
				}
				go func() { io.Copy(s, c); s.Close() }()
				io.Copy(c, s)
				c.Close()
			}()
		}
	}()
	return ln.Addr().String()
}

// The database restarts behind its proxy while messages arrive: the inbox's
// BEGIN cannot open a connection (the proxy closes it: pgx reports an EOF,
// go-sql-driver a plain "invalid connection"), which says nothing about the
// message. IsTransient did not recognise it, and the stack's poison queue
// (!IsTransient) took the message: acked on its topic, never processed once
// the database was back. It must wait on its topic and be processed then.
func TestDatabaseRestartBehindAProxyDoesNotPoisonMessages(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ database, broker string }{
		{"postgres", "gochannel"}, {"postgres", "kafka"}, {"mariadb", "gochannel"}, {"mariadb", "kafka"},
	} {
		broker := c.broker
		t.Run(c.database+"/"+broker, func(t *testing.T) {
			t.Parallel()
			var down atomic.Bool
			var probe, db *sqlx.DB
			if c.database == "postgres" {
				probe = testdb.OpenPostgres(t, "")
				cfg, err := pgx.ParseConfig(testdb.PostgresDSN())
				if err != nil {
					t.Fatal(err)
				}
				host, port, err := net.SplitHostPort(closingProxy(t, net.JoinHostPort(cfg.Host, "5432"), &down))
				if err != nil {
					t.Fatal(err)
				}
				cfg.Host = host
				n, _ := strconv.Atoi(port)
				cfg.Port = uint16(n)
				db = sqlx.NewDb(stdlib.OpenDB(*cfg), "pgx")
			} else {
				probe = testdb.OpenMySQL(t, "")
				mc, err := mysql.ParseDSN(testdb.MySQLDSN())
				if err != nil {
					t.Fatal(err)
				}
				mc.Addr = closingProxy(t, mc.Addr, &down)
				db, err = sqlx.Open("mysql", mc.FormatDSN())
				if err != nil {
					t.Fatal(err)
				}
			}
			defer db.Close()
			db.SetMaxIdleConns(0) // each transaction connects through the proxy
			sfx := randomSuffix()
			business, table := "poison_business_"+sfx, "poison_inbox_"+sfx
			exec(t, probe, "CREATE TABLE "+business+" (id VARCHAR(64) PRIMARY KEY)")
			dropLater(t, probe, business)
			dropLater(t, probe, table)
			ib, err := inbox.New(inbox.Config{DB: db, Table: table})
			if err != nil {
				t.Fatal(err)
			}
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
				_, err := tx.ExecContext(msg.Context(), tx.Rebind("INSERT INTO "+business+" VALUES (?)"), msg.UUID)
				return err
			})
			ctx, cancel := context.WithCancel(context.Background())
			ran := make(chan struct{})
			go func() { defer close(ran); _ = router.Run(ctx) }()
			<-router.Running()

			down.Store(true) // the database restarts for two seconds
			if err := pub.Publish("orders", message.NewMessage(watermill.NewUUID(), []byte("order"))); err != nil {
				t.Fatal(err)
			}
			time.Sleep(2 * time.Second)
			down.Store(false)
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
				t.Errorf("message %s poisoned while the database restarted (reason %q); business rows %d: acked, never processed",
					p.UUID, p.Metadata.Get(middleware.ReasonForPoisonedKey), count(t, probe, business, ""))
			}
			if n := count(t, probe, business, ""); n != 1 && len(got) == 0 {
				t.Errorf("business rows %d, want 1", n)
			}
		})
	}
}
