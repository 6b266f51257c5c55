package inbox_test

import (
	"context"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// Outbox.Stats is bounded by its context (the metrics module scrapes it
// with a timeout; "inbox stats -timeout") also while a relay round waits on
// a server that does not answer (a pooler queueing the connection, a server
// that hangs) for as long as the relay's context lasts: the server check
// both run first held its lock over its reads, and Stats overran its
// deadline by as much.
func TestOutboxStatsKeepsItsDeadlineWhileARelayRoundWaitsForTheServer(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0") // accepts, never answers
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var conns []net.Conn
	accepted := make(chan struct{}, 64)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			accepted <- struct{}{}
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	db, err := sqlx.Open("pgx", "postgres://postgres@"+ln.Addr().String()+"/test?sslmode=disable")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Dialect: inbox.PostgreSQL, Table: "outbox_hung", Publisher: newBrokerStub()})
	if err != nil {
		t.Fatal(err)
	}
	const relayWait = 15 * time.Second
	relayCtx, cancel := context.WithTimeout(context.Background(), relayWait)
	defer cancel()
	relayed := make(chan struct{})
	go func() {
		defer close(relayed)
		ob.RelayOnce(relayCtx)
	}()
	defer func() { cancel(); <-relayed }()
	select {
	case <-accepted: // the relay round is asking the server
	case <-time.After(10 * time.Second):
		t.Fatal("the relay round never reached the server")
	}
	time.Sleep(100 * time.Millisecond)

	ctx, cancelStats := context.WithTimeout(context.Background(), time.Second)
	defer cancelStats()
	start := time.Now()
	_, err = ob.Stats(ctx)
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("Stats with a 1s deadline returned after %v (err %v), held by the relay round's server check;"+
			" want it to give up at its deadline", took.Round(time.Millisecond), err)
	}
	if err == nil {
		t.Error("Stats on a server that never answers returned no error")
	}
}
