package pgxinbox_test

import (
	"io"
	"net"
	"net/url"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// cuttingProxy forwards TCP connections to PostgreSQL and can cut them all
// without a word, as a PgBouncer killed or a network drop does (where
// pg_terminate_backend sends an error first).
type cuttingProxy struct {
	ln    net.Listener
	mu    sync.Mutex
	conns []net.Conn
}

func newCuttingProxy(t *testing.T, target string) *cuttingProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &cuttingProxy{ln: ln}
	go func() {
		for {
			client, err := ln.Accept()
			if err != nil {
				return
			}
			server, err := net.Dial("tcp", target)
			if err != nil {
				client.Close()
				continue
			}
			p.mu.Lock()
			p.conns = append(p.conns, client, server)
			p.mu.Unlock()
			go func() { _, _ = io.Copy(server, client); server.Close() }()
			go func() { _, _ = io.Copy(client, server); client.Close() }()
		}
	}()
	t.Cleanup(func() { ln.Close(); p.cut() })
	return p
}

func (p *cuttingProxy) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		c.Close()
	}
	p.conns = nil
}

// The connection is cut while the handler runs (a PgBouncer killed, a
// network drop): the handler's next statement fails with a bare
// io.ErrUnexpectedEOF. The delivery's error is transient, so that
// Inbox.Middlewares' poison queue keeps the message, and the redelivery
// processes it. It was not transient, and the message was poisoned
// unprocessed.
func TestConnectionCutDuringTheHandlerIsNotPoisoned(t *testing.T) {
	dsn, err := url.Parse(testdb.PostgresDSN())
	if err != nil || dsn.Host == "" {
		t.Skipf("needs a URL-form %s: %v", testdb.PostgresDSNEnv, err)
	}
	proxy := newCuttingProxy(t, dsn.Host)
	pool := openPool(t, "", "connection_cut", func(c *pgxpool.Config) {
		c.ConnConfig.Host = "127.0.0.1"
		c.ConnConfig.Port = uint16(proxy.ln.Addr().(*net.TCPAddr).Port)
		c.ConnConfig.Fallbacks = nil
	})
	f := newFixture(t, pool)
	ib := f.newInbox(pgxinbox.Config{})
	sink := &poisonSink{}
	mws, err := ib.Middlewares(inbox.MiddlewaresConfig{PoisonQueue: sink, Retry: middleware.Retry{MaxRetries: -1}})
	if err != nil {
		t.Fatal(err)
	}
	rec := &recorder{}
	var calls int
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(rec.Middleware)
		r.AddMiddleware(mws...)
		r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
			if calls++; calls == 1 {
				proxy.cut()
			}
			return f.writeEffect(msg)
		})
	})
	msg := message.NewMessage(watermill.NewUUID(), nil)
	if in.deliver(t, msg) {
		t.Fatal("acked a message whose connection was cut before its commit")
	}
	if err := rec.last(); !inbox.IsTransient(err) || len(sink.poisoned()) > 0 {
		t.Fatalf("nacked with %v (IsTransient %v), poisoned %d; want a transient nack, nothing poisoned",
			err, inbox.IsTransient(err), len(sink.poisoned()))
	}
	if !in.deliver(t, msg) {
		t.Fatalf("redelivery nacked: %v", rec.last())
	}
	f.expectRows(1, 1)
}

// poisonSink is a poison queue's publisher that keeps what it is given.
type poisonSink struct {
	mu   sync.Mutex
	msgs []*message.Message
}

func (p *poisonSink) Publish(_ string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.msgs = append(p.msgs, msgs...)
	return nil
}

func (p *poisonSink) Close() error { return nil }

func (p *poisonSink) poisoned() []*message.Message {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]*message.Message(nil), p.msgs...)
}
