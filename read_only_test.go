package inbox_test

import (
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A database that refuses writes (a replica the DSN points to by mistake, a
// primary demoted during a failover, default_transaction_read_only, a
// read-only SQLite file) nacks each message as transient, its handler not
// called, after a wait (100 ms doubling over consecutive ones): a poison filter built on IsTransient keeps the
// topic, and the message is processed once the database takes writes
// again. The refusal was not transient, so the messages went to the poison
// queue, the topic drained while the database was read-only.
func TestClaimThatTheDatabaseRefusesAsReadOnlyIsTransient(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name            string
		plain, readOnly func(t *testing.T) *sqlx.DB
	}{
		{"postgres",
			func(t *testing.T) *sqlx.DB { return testdb.OpenPostgres(t, "") },
			func(t *testing.T) *sqlx.DB { return testdb.OpenPostgres(t, "default_transaction_read_only=on") }},
		{"mysql",
			func(t *testing.T) *sqlx.DB { return testdb.OpenMySQL(t, "") },
			func(t *testing.T) *sqlx.DB { return testdb.OpenMySQL(t, "tx_read_only=1") }},
	}
	path := filepath.Join(t.TempDir(), "inbox.db")
	cases = append(cases, struct {
		name            string
		plain, readOnly func(t *testing.T) *sqlx.DB
	}{"sqlite",
		func(t *testing.T) *sqlx.DB { return testdb.OpenSQLite(t, path) },
		func(t *testing.T) *sqlx.DB {
			db, err := sqlx.Open("sqlite", "file:"+path+"?"+testdb.SQLiteParams+"&_pragma=query_only(1)")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { db.Close() })
			return db
		}})
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			plain := c.plain(t)
			f := newFixture(t, plain)
			f.newInbox(inbox.Config{}) // the table, made where writes are taken
			ib, err := inbox.New(inbox.Config{DB: c.readOnly(t), Table: f.inbox})
			if err != nil {
				t.Fatal(err)
			}
			var mu sync.Mutex
			var waits []time.Duration
			inbox.SetTableBackoffHook(ib, func(wait time.Duration) {
				mu.Lock()
				defer mu.Unlock()
				waits = append(waits, wait)
			})
			var calls int
			rec := &recorder{}
			in := newFeed()
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(rec.Middleware, ib.Middleware)
				r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
					calls++
					return nil
				})
			})
			for range 3 {
				if in.deliver(t, message.NewMessage(watermill.NewUUID(), []byte("payload"))) {
					t.Fatal("a message was acked by an inbox whose database refuses writes")
				}
			}
			mu.Lock()
			if fmt.Sprint(waits) != "[100ms 200ms 400ms]" {
				t.Errorf("waits before the nacks: %v, want 100ms doubling", waits)
			}
			mu.Unlock()
			err = rec.last()
			if !inbox.IsTransient(err) || err == nil || !strings.Contains(err.Error(), "refuses writes") {
				t.Errorf("nacked with %v, want a transient error that says the database refuses writes", err)
			}
			if calls != 0 || count(t, plain, f.inbox, "") != 0 {
				t.Errorf("handler calls %d, inbox rows written; want none", calls)
			}
		})
	}
}
