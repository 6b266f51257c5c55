package inbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// pgxStatementCache is pgx with its default query exec mode
// (cache_statement), the setting that cannot work behind a transaction-mode
// pooler.
var pgxStatementCache = testdb.PgBouncerDriver{Name: "pgx-cache", Driver: "pgx"}

// isPreparedStatementError reports whether err carries the SQLSTATE of a
// prepared statement missing (26000) or already there (42P05).
func isPreparedStatementError(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "42P05" || pgErr.Code == "26000")
}

// Behind a transaction-mode PgBouncer with pgx's default statement cache,
// the first errors a user meets are at startup: InitializeSchema, Verify
// and RouterPlugin (router.Run) then fail with 42P05 or 26000, still
// matchable with errors.As, and each says how to fix the driver's settings.
func TestPooler_StartupErrorsOfTheStatementCacheNameTheFix(t *testing.T) {
	t.Parallel()
	direct := testdb.OpenPostgres(t, "")
	f := newFixture(t, direct)
	f.newInbox(inbox.Config{}) // the table, made without the pooler
	steps := map[string]func(ib *inbox.Inbox) error{
		"InitializeSchema": func(ib *inbox.Inbox) error { return ib.InitializeSchema(context.Background()) },
		"Verify":           func(ib *inbox.Inbox) error { return ib.Verify(context.Background()) },
		"RouterPlugin": func(ib *inbox.Inbox) error {
			r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
			if err != nil {
				t.Fatal(err)
			}
			r.AddConsumerHandler("billing", "orders", newFeed(), func(*message.Message) error { return nil })
			r.AddMiddleware(ib.Middleware)
			r.AddPlugin(ib.RouterPlugin)
			return runUntilRunning(r)
		},
	}
	for name, step := range steps {
		t.Run(name, func(t *testing.T) {
			// Each service is a new client of the pooler, whose server
			// connections already hold the statements an earlier client
			// prepared (42P05), or lack those its own pool prepared on
			// another (26000).
			failed := 0
			for i := 0; i < 20 && failed < 3; i++ {
				db := testdb.OpenPgBouncer(t, pgxStatementCache)
				ib, err := inbox.New(inbox.Config{DB: db, Table: f.inbox})
				if err != nil {
					t.Fatal(err)
				}
				for range 3 {
					err := step(ib)
					if err == nil {
						continue
					}
					if !isPreparedStatementError(err) {
						t.Fatalf("%s: %v, want nil or a prepared-statement error", name, err)
					}
					failed++
					if n := strings.Count(err.Error(), "default_query_exec_mode=exec or simple_protocol"); n != 1 {
						t.Errorf("%s: %v: the pooler hint %d times, want once", name, err, n)
					}
				}
				db.Close()
			}
			t.Logf("%d prepared-statement errors", failed)
			if failed == 0 {
				t.Fatalf("%s never met 42P05/26000 behind the pooler: the case did not happen", name)
			}
		})
	}
}

// Behind a transaction-mode PgBouncer with pgx's default statement cache,
// the outbox relay's rounds, the Purger's rounds and Purge, which a service
// runs for as long as it runs, say the fix too: their errors were the bare
// SQLSTATE, logged every round, while the handlers' said it.
func TestPooler_RelayAndPurgeErrorsOfTheStatementCacheNameTheFix(t *testing.T) {
	t.Parallel()
	direct := testdb.OpenPostgres(t, "")
	f := newFixture(t, direct)
	f.newInbox(inbox.Config{})
	outbox := "outbox_" + randomSuffix()
	dropLater(t, direct, outbox)
	dropLater(t, direct, outbox+"_dead")
	made, err := inbox.NewOutbox(inbox.OutboxConfig{DB: direct, Table: outbox, Publisher: newBrokerStub()})
	if err != nil {
		t.Fatal(err)
	}
	if err := made.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	steps := map[string]func(db *sqlx.DB) error{
		"RelayOnce": func(db *sqlx.DB) error {
			ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Table: outbox, Publisher: newBrokerStub()})
			if err != nil {
				t.Fatal(err)
			}
			return ob.RelayOnce(context.Background()).Err
		},
		"Purger.RunOnce": func(db *sqlx.DB) error {
			p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: db, Table: f.inbox, OlderThan: time.Hour}})
			if err != nil {
				t.Fatal(err)
			}
			return p.RunOnce(context.Background()).Err
		},
		"Purge": func(db *sqlx.DB) error {
			_, err := inbox.Purge(context.Background(), inbox.PurgeConfig{DB: db, Table: f.inbox, OlderThan: time.Hour})
			return err
		},
	}
	for name, step := range steps {
		t.Run(name, func(t *testing.T) {
			failed := 0
			for i := 0; i < 20 && failed < 3; i++ {
				db := testdb.OpenPgBouncer(t, pgxStatementCache)
				for range 3 {
					err := step(db)
					if err == nil || !isPreparedStatementError(err) {
						continue
					}
					failed++
					if n := strings.Count(err.Error(), "default_query_exec_mode=exec or simple_protocol"); n != 1 {
						t.Errorf("%s: %v: the pooler hint %d times, want once", name, err, n)
					}
				}
				db.Close()
			}
			t.Logf("%d prepared-statement errors", failed)
		})
	}
}
