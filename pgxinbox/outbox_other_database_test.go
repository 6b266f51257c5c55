package pgxinbox_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/pgxinbox"
)

// An Outbox whose DB is on another database than the pgxinbox pool has its
// messages written in the inbox's database (where a table of its name
// exists) while its relay reads its own: they were committed and never
// sent, with nothing said. The inbox's logger says so once, at Info, as it
// does for database/sql's inbox on another handle; an Outbox on the pool's
// own database (another *sql.DB over another pool) says nothing.
func TestOutboxOnAnotherDatabaseThanThePgxPoolIsSaid(t *testing.T) {
	for _, c := range []struct {
		name, outboxDatabase string
		said                 bool
	}{
		{"another database", "postgres", true},
		{"the same database through another pool", "", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := newFixture(t, openPool(t, "", "pgx_other_db", nil))
			other := sqlx.NewDb(stdlib.OpenDBFromPool(openPool(t, c.outboxDatabase, "pgx_other_db_outbox", nil)), "pgx")
			t.Cleanup(func() { other.Close() })
			table := "pgx_outbox_" + f.sfx
			ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: other, Table: table, Publisher: &countingBroker{}, PollInterval: time.Hour})
			if err != nil {
				t.Fatal(err)
			}
			inboxDB := sqlx.NewDb(stdlib.OpenDBFromPool(f.pool), "pgx")
			for _, db := range []*sqlx.DB{other, inboxDB} {
				t.Cleanup(func() { db.Exec(`DROP TABLE IF EXISTS ` + table + `, ` + table + `_dead`) }) //nolint:errcheck // best effort
			}
			if err := ob.InitializeSchema(context.Background()); err != nil {
				t.Fatal(err)
			}
			// The table on the inbox's database too (on the Outbox's alone
			// a write fails loudly: the table is missing).
			twin, err := inbox.NewOutbox(inbox.OutboxConfig{DB: inboxDB, Table: table, Publisher: &countingBroker{}})
			if err != nil {
				t.Fatal(err)
			}
			if err := twin.InitializeSchema(context.Background()); err != nil {
				t.Fatal(err)
			}
			logs := &infoLines{}
			ib := f.newInbox(pgxinbox.Config{Outbox: pgxinbox.OutboxPublisher(ob), Logger: logs})
			in := newFeed()
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(ib.Middleware)
				r.AddHandler("billing", "orders", in, "invoices", &countingBroker{}, func(msg *message.Message) ([]*message.Message, error) {
					return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("invoice"))}, nil
				})
			})
			for i := range 2 {
				if !in.deliver(t, message.NewMessage(watermill.NewUUID(), []byte("order"))) {
					t.Fatalf("delivery %d nacked", i)
				}
			}
			// The Outbox's database is read on a goroutine of its own (the
			// delivery may hold the pool's last connection): said soon after.
			said := func() (n int, lines []string) {
				logs.mu.Lock()
				defer logs.mu.Unlock()
				for _, line := range logs.lines {
					if strings.Contains(line, "on another database than the inbox's transactions") {
						n++
					}
				}
				return n, append([]string(nil), logs.lines...)
			}
			want := 0
			if c.said {
				want = 1
			}
			deadline := time.Now().Add(2 * time.Second)
			for n, _ := said(); n < want && time.Now().Before(deadline); n, _ = said() {
				time.Sleep(10 * time.Millisecond)
			}
			if !c.said {
				time.Sleep(500 * time.Millisecond) // a line would come within it
			}
			if n, lines := said(); n != want {
				t.Errorf("Info lines saying the Outbox is on another database: %d, want %d (%q)", n, want, lines)
			}
		})
	}
}
