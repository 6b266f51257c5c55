package inbox_test

import (
	"context"
	"errors"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// PostgreSQL sessions whose client_encoding is not UTF8 (LATIN1 here), from
// the DSN's client_encoding or from ALTER ROLE / ALTER DATABASE ... SET
// client_encoding, which pgx honours (it sends none of its own; lib/pq
// forces UTF8): the server converts every string parameter from LATIN1 to
// the database's UTF8, so the id "ünï-…" (UTF-8 bytes, read as LATIN1
// characters) is stored as "Ã¼nÃ¯-…", the consumer "bïlling" as
// "bÃ¯lling". New, InitializeSchema and Verify accept such sessions, and a
// message processed by an instance on UTF8 sessions is processed again by
// one on LATIN1 sessions (two inbox rows for one key): its effect happens
// twice. The contract says ids are never normalised, and the inbox refuses
// the MySQL/MariaDB equivalent (character_set_client apart from
// character_set_connection) with ErrInvalidConfig.
//
// Such sessions must be refused at startup with an error that names
// client_encoding (ErrInvalidConfig), or the message processed once.
func TestPostgresSessionsWithAnotherClientEncodingProcessEachMessageOnce(t *testing.T) {
	plain := testdb.OpenPostgres(t, "")
	cases := []struct {
		name string
		open func(t *testing.T) *sqlx.DB
	}{
		{"DSN client_encoding=LATIN1", func(t *testing.T) *sqlx.DB { return testdb.OpenPostgres(t, "client_encoding=LATIN1") }},
		{"ALTER ROLE SET client_encoding", func(t *testing.T) *sqlx.DB {
			role := "sess_latin_" + randomSuffix()
			exec(t, plain, "CREATE ROLE "+role+" LOGIN")
			t.Cleanup(func() {
				_, _ = plain.Exec("DROP OWNED BY " + role)
				_, _ = plain.Exec("DROP ROLE " + role)
			})
			exec(t, plain, "ALTER ROLE "+role+" SET client_encoding = 'LATIN1'")
			exec(t, plain, "GRANT USAGE ON SCHEMA public TO "+role)
			u, err := url.Parse(testdb.PostgresDSN())
			if err != nil {
				t.Skip(err)
			}
			u.User = url.User(role)
			db, err := sqlx.Open("pgx", u.String())
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { db.Close() })
			return db
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			table := "sess_inbox_" + randomSuffix()
			dropLater(t, plain, table)
			first, err := inbox.New(inbox.Config{DB: plain, Table: table})
			if err != nil {
				t.Fatal(err)
			}
			if err := first.InitializeSchema(ctx); err != nil {
				t.Fatal(err)
			}
			latin := c.open(t)
			exec(t, plain, "GRANT SELECT, INSERT, UPDATE, DELETE ON "+table+" TO PUBLIC")
			var enc string
			if err := latin.Get(&enc, "SHOW client_encoding"); err != nil || enc != "LATIN1" {
				t.Fatalf("client_encoding %q, %v; want LATIN1", enc, err)
			}
			second, err := inbox.New(inbox.Config{DB: latin, Table: table})
			if err != nil {
				if errors.Is(err, inbox.ErrInvalidConfig) {
					return
				}
				t.Fatal(err)
			}
			if err := second.Verify(ctx); err != nil {
				if errors.Is(err, inbox.ErrInvalidConfig) && strings.Contains(err.Error(), "client_encoding") {
					return // refused at startup
				}
				t.Fatalf("Verify: %v; want nil or ErrInvalidConfig naming client_encoding", err)
			}
			var calls atomic.Int32
			msg := message.NewMessage("ünï-"+watermill.NewUUID(), []byte("order"))
			for _, ib := range []*inbox.Inbox{first, second} {
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
			var stored []string
			if err := plain.Select(&stored, "SELECT consumer || ' / ' || message_id FROM "+table); err != nil {
				t.Fatal(err)
			}
			if calls.Load() != 1 {
				t.Errorf("one message delivered to an instance on UTF8 sessions and then to one on LATIN1 sessions:"+
					" handler calls %d, want 1; inbox rows %q (the id is %q)", calls.Load(), stored, msg.UUID)
			}
		})
	}
}
