package pgxinbox_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// pgx pools whose sessions have a client_encoding other than UTF8 (the
// DSN's client_encoding, or ALTER ROLE / ALTER DATABASE ... SET
// client_encoding, which pgx honours: it sends none of its own): the server
// converts every string parameter from LATIN1 to the database's UTF8, so
// the id "ünï-…" is stored as "Ã¼nÃ¯-…" and the consumer "bïlling" as
// "bÃ¯lling". pgxinbox.New, InitializeSchema and Verify accept such a
// pool, and a message processed by an instance on a UTF8 pool is processed
// again by one on a LATIN1 pool: its effect happens twice.
//
// Such a pool must be refused at startup with an error that names
// client_encoding (inbox.ErrInvalidConfig), or the message processed once.
func TestPgxPoolWithAnotherClientEncodingProcessesEachMessageOnce(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	utf := openPool(t, "", "encoding-utf8", nil)
	latin := openPool(t, "", "encoding-latin1", func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["client_encoding"] = "LATIN1" })
	table := "sess_inbox_" + testdb.RandomSuffix()
	t.Cleanup(func() { _, _ = utf.Exec(context.Background(), "DROP TABLE IF EXISTS "+table) })
	var enc string
	if err := latin.QueryRow(ctx, "SHOW client_encoding").Scan(&enc); err != nil || enc != "LATIN1" {
		t.Fatalf("client_encoding %q, %v; want LATIN1", enc, err)
	}
	first, err := pgxinbox.New(pgxinbox.Config{Pool: utf, Table: table})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { first.Close() })
	if err := first.InitializeSchema(ctx); err != nil {
		t.Fatal(err)
	}
	second, err := pgxinbox.New(pgxinbox.Config{Pool: latin, Table: table})
	if err != nil {
		if errors.Is(err, inbox.ErrInvalidConfig) {
			return
		}
		t.Fatal(err)
	}
	t.Cleanup(func() { second.Close() })
	if err := second.Verify(ctx); err != nil {
		if errors.Is(err, inbox.ErrInvalidConfig) && strings.Contains(err.Error(), "client_encoding") {
			return // refused at startup
		}
		t.Fatalf("Verify: %v; want nil or ErrInvalidConfig naming client_encoding", err)
	}
	var calls atomic.Int32
	msg := message.NewMessage("ünï-"+watermill.NewUUID(), []byte("order"))
	for _, ib := range []*pgxinbox.Inbox{first, second} {
		rec := &recorder{}
		in := newFeed()
		runRouter(t, func(r *message.Router) {
			r.AddMiddleware(rec.Middleware, ib.Middleware)
			r.AddConsumerHandler("bïlling", "orders", in, func(*message.Message) error {
				calls.Add(1)
				return nil
			})
		})
		if !in.deliver(t, msg) {
			t.Logf("nacked: %v", rec.last())
		}
	}
	rows, err := utf.Query(ctx, "SELECT consumer || ' / ' || message_id FROM "+table)
	if err != nil {
		t.Fatal(err)
	}
	var stored []string
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			t.Fatal(err)
		}
		stored = append(stored, s)
	}
	if calls.Load() != 1 {
		t.Errorf("one message delivered to an instance on a UTF8 pool and then to one on a LATIN1 pool: handler calls %d,"+
			" want 1; inbox rows %q (the id is %q)", calls.Load(), stored, msg.UUID)
	}
}
