package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// A handler that sets the search_path of its transaction (SET LOCAL: a
// schema per tenant) to a schema that holds a table named like the outbox
// table has its messages, those it publishes through OutboxFromContext and
// those it returns, written to the outbox the relay reads, and sent: an
// unqualified table name resolved to the tenant's table, where the outputs
// were committed and never sent. Every statement of the Outbox names the
// schema the table was found in before the handlers ran; an Outbox that
// only writes (its relay runs elsewhere, and nothing ran Verify or
// InitializeSchema on it) finds it at its first write, outside the
// handler's transaction.
func TestOutboxWritesToItsTableWhateverTheHandlersSearchPath(t *testing.T) {
	for _, writesOnly := range []bool{false, true} {
		name := "relaying"
		if writesOnly {
			name = "writing only"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db := testdb.OpenPostgres(t, "")
			broker := newBrokerStub()
			relay, table := newNamedTestOutbox(t, db, inbox.PostgreSQL, inbox.OutboxConfig{Publisher: broker, PollInterval: 10 * time.Millisecond})
			writer, handlerDB := relay, db
			if writesOnly {
				// On a pool of one connection, which the message's
				// transaction holds while the writer looks its table up.
				handlerDB = testdb.OpenPostgres(t, "")
				handlerDB.SetMaxOpenConns(1)
				var err error
				if writer, err = inbox.NewOutbox(inbox.OutboxConfig{DB: handlerDB, Dialect: inbox.PostgreSQL, Table: table, Publisher: broker}); err != nil {
					t.Fatal(err)
				}
			}
			tenant := newTenantSchema(t, db)
			exec(t, db, "CREATE TABLE "+tenant+"."+table+" (LIKE "+table+" INCLUDING ALL)")
			exec(t, db, "CREATE TABLE "+tenant+"."+table+"_dead (LIKE "+table+"_dead INCLUDING ALL)")
			f := newFixture(t, handlerDB)
			middleware := f.newInbox(inbox.Config{Outbox: writer.Publisher}).Middleware
			in := newFeed()
			runRouter(t, func(r *message.Router) {
				r.AddPlugin(relay.RouterPlugin)
				r.AddMiddleware(middleware)
				r.AddHandler("billing", "orders", in, "invoices", broker, func(msg *message.Message) ([]*message.Message, error) {
					if err := useTenantSchema(msg, tenant); err != nil {
						return nil, err
					}
					outbox, _ := inbox.OutboxFromContext(msg.Context())
					if err := outbox.Publish("emails", message.NewMessage(msg.UUID+"-email", []byte("email"))); err != nil {
						return nil, err
					}
					return []*message.Message{message.NewMessage(msg.UUID+"-invoice", []byte("invoice"))}, nil
				})
			})
			const orders = 3
			for range orders {
				if !in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
					t.Fatal("the message was nacked")
				}
			}
			waitFor(t, func() bool { return len(broker.uuids("invoices")) == orders && len(broker.uuids("emails")) == orders })
			expectTenantTableEmpty(t, db, tenant, table)
			// The relay deletes what it sent once the broker took it.
			waitFor(t, func() bool { stats, err := relay.Stats(context.Background()); return err == nil && stats.Pending == 0 })
		})
	}
}

// An unqualified outbox table is found along the search_path the
// connections start with (here a DSN's options), in a schema other than
// public, and the relay, Stats and the writers use it there.
func TestOutboxFindsItsTableAlongTheConnectionsSearchPath(t *testing.T) {
	t.Parallel()
	schema := "app_" + randomSuffix()
	admin := testdb.OpenPostgres(t, "")
	exec(t, admin, "CREATE SCHEMA "+schema)
	t.Cleanup(func() { _, _ = admin.Exec("DROP SCHEMA " + schema + " CASCADE") })
	db := testdb.OpenPostgres(t, "search_path="+schema)
	broker := newBrokerStub()
	ob, table := newNamedTestOutbox(t, db, inbox.PostgreSQL, inbox.OutboxConfig{Publisher: broker, PollInterval: 10 * time.Millisecond})
	if n := count(t, admin, schema+"."+table, ""); n != 0 {
		t.Fatalf("%s.%s holds %d rows, want an empty table", schema, table, n)
	}
	f := newFixture(t, db)
	middleware := f.newInbox(inbox.Config{Outbox: ob.Publisher}).Middleware
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddPlugin(ob.RouterPlugin)
		r.AddMiddleware(middleware)
		r.AddHandler("billing", "orders", in, "invoices", broker, func(msg *message.Message) ([]*message.Message, error) {
			return []*message.Message{message.NewMessage(msg.UUID+"-invoice", []byte("invoice"))}, nil
		})
	})
	if !in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
		t.Fatal("the message was nacked")
	}
	waitFor(t, func() bool { return len(broker.uuids("invoices")) == 1 })
	waitFor(t, func() bool { stats, err := ob.Stats(context.Background()); return err == nil && stats.Pending == 0 })
}

// An outbox table missing from the search_path outside the handler is not
// looked for along the handler's: a handler whose SET LOCAL search_path
// finds a tenant's table of that name gets an error (ErrTableNotFound,
// transient: nothing about the message is wrong) and writes nothing there;
// and a handler that goes on as if it had not (ignores the error, rolls
// back to a savepoint around its Publish) is nacked all the same, so the
// output is written by a redelivery once the table exists, not lost. The
// same when the session has no schema to create the table in (a search_path
// of schemas that do not exist): the unqualified name was written along the
// handler's search_path, to the tenant's table.
func TestOutboxTableMissingOutsideTheHandlerIsNotFoundAlongItsSearchPath(t *testing.T) {
	for _, tc := range []struct {
		name      string
		savepoint bool
		noSchema  bool
	}{
		{name: "ignored"},
		{name: "rolled back to a savepoint", savepoint: true},
		{name: "no schema to create it in", noSchema: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			db := testdb.OpenPostgres(t, "")
			f := newFixture(t, db)
			inboxDB, inboxTable := db, f.inbox
			if tc.noSchema {
				inboxDB, inboxTable = testdb.OpenPostgres(t, "search_path=nowhere_"+randomSuffix()), "public."+f.inbox
			}
			table := "outbox_" + randomSuffix()
			writer, err := inbox.NewOutbox(inbox.OutboxConfig{DB: inboxDB, Dialect: inbox.PostgreSQL, Table: table, Publisher: newBrokerStub()})
			if err != nil {
				t.Fatal(err)
			}
			tenant := newTenantSchema(t, db)
			tenantOutbox, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Dialect: inbox.PostgreSQL, Table: tenant + "." + table, Publisher: newBrokerStub()})
			if err != nil {
				t.Fatal(err)
			}
			if err := tenantOutbox.InitializeSchema(context.Background()); err != nil {
				t.Fatal(err)
			}
			ib, err := inbox.New(inbox.Config{DB: inboxDB, Dialect: inbox.PostgreSQL, Table: inboxTable, Outbox: writer.Publisher})
			if err != nil {
				t.Fatal(err)
			}
			if err := ib.InitializeSchema(context.Background()); err != nil {
				t.Fatal(err)
			}
			in := newFeed()
			published := make(chan error, 1)
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(ib.Middleware)
				r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error {
					if err := useTenantSchema(msg, tenant); err != nil {
						return err
					}
					tx, _ := inbox.TxFromContext(msg.Context())
					if tc.savepoint {
						if _, err := tx.ExecContext(msg.Context(), "SAVEPOINT output"); err != nil {
							return err
						}
					}
					outbox, _ := inbox.OutboxFromContext(msg.Context())
					published <- outbox.Publish("invoices", message.NewMessage(msg.UUID+"-invoice", []byte("invoice")))
					if tc.savepoint {
						if _, err := tx.ExecContext(msg.Context(), "ROLLBACK TO SAVEPOINT output"); err != nil {
							return err
						}
					}
					return nil // goes on without its output
				})
			})
			if in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
				t.Error("the message was acked")
			}
			select {
			case err := <-published:
				if !errors.Is(err, inbox.ErrTableNotFound) || !inbox.IsTransient(err) {
					t.Errorf("Publish: %v, want a transient error wrapping ErrTableNotFound", err)
				}
			default:
				t.Error("the handler did not publish")
			}
			expectTenantTableEmpty(t, db, tenant, table)
		})
	}
}

// newTenantSchema creates a schema of a tenant's own, dropped with what it
// holds when the test ends.
func newTenantSchema(t *testing.T, db *sqlx.DB) string {
	t.Helper()
	tenant := "tenant_" + randomSuffix()
	exec(t, db, "CREATE SCHEMA "+tenant)
	t.Cleanup(func() { _, _ = db.Exec("DROP SCHEMA " + tenant + " CASCADE") })
	return tenant
}

// useTenantSchema sets the search_path of msg's inbox transaction to
// tenant first, as a handler of a schema-per-tenant service does.
func useTenantSchema(msg *message.Message, tenant string) error {
	tx, _ := inbox.TxFromContext(msg.Context())
	_, err := tx.ExecContext(msg.Context(), "SET LOCAL search_path TO "+tenant+", public")
	return err
}

// expectTenantTableEmpty fails the test unless tenant's table named like
// the outbox table holds no row.
func expectTenantTableEmpty(t *testing.T, db *sqlx.DB, tenant, table string) {
	t.Helper()
	if n := count(t, db, tenant+"."+table, ""); n != 0 {
		t.Errorf("the tenant's table named like the outbox holds %d rows, want none", n)
	}
}

// A handler that recovers from the refusal of a missing outbox table (rolls
// back to a savepoint, creates the table in its transaction, publishes
// again) is acked with its output written: only a refusal the handler went
// on from without its output fails the delivery.
func TestOutboxHandlerThatRecoversFromAMissingTableIsAcked(t *testing.T) {
	t.Parallel()
	db, table := testdb.OpenPostgres(t, ""), "outbox_"+randomSuffix()
	in := routeWithoutOutboxTable(t, db, table, func(msg *message.Message, writer *inbox.Outbox) error {
		tx, _ := inbox.TxFromContext(msg.Context())
		outbox, _ := inbox.OutboxFromContext(msg.Context())
		output := message.NewMessage(msg.UUID+"-invoice", []byte("invoice"))
		if _, err := tx.ExecContext(msg.Context(), "SAVEPOINT output"); err != nil {
			return err
		}
		if err := outbox.Publish("invoices", output); !errors.Is(err, inbox.ErrTableNotFound) {
			return fmt.Errorf("first Publish: %v, want ErrTableNotFound", err)
		}
		if _, err := tx.ExecContext(msg.Context(), "ROLLBACK TO SAVEPOINT output"); err != nil {
			return err
		}
		for _, stmt := range statements(writer.SchemaSQL()) {
			if _, err := tx.ExecContext(msg.Context(), stmt); err != nil {
				return err
			}
		}
		return outbox.Publish("invoices", output)
	})
	if !in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
		t.Fatal("the message was nacked")
	}
	if n := count(t, db, table, ""); n != 1 {
		t.Errorf("the outbox holds %d rows, want the output", n)
	}
}

// An Outbox's Publisher called by the application, in a transaction of its
// own whose search_path it set first (SET LOCAL: a schema per tenant) or of
// another pool whose connections put a tenant's schema first, writes to the
// outbox the relay reads, and so do the Outbox's later writes: a look-up in
// that transaction pinned the tenant's table of the same name for good.
func TestOutboxPublisherCalledByTheApplicationWritesToItsTable(t *testing.T) {
	for _, fromAnotherPool := range []bool{false, true} {
		name := "SET LOCAL search_path"
		if fromAnotherPool {
			name = "another pool's search_path"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db := testdb.OpenPostgres(t, "")
			_, table := newNamedTestOutbox(t, db, inbox.PostgreSQL, inbox.OutboxConfig{Publisher: newBrokerStub()})
			writer, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Dialect: inbox.PostgreSQL, Table: table, Publisher: newBrokerStub()})
			if err != nil {
				t.Fatal(err)
			}
			tenant := newTenantSchema(t, db)
			exec(t, db, "CREATE TABLE "+tenant+"."+table+" (LIKE "+table+" INCLUDING ALL)")
			if fromAnotherPool {
				publishInTransaction(t, testdb.OpenPostgres(t, "search_path="+tenant+",public"), writer, "")
			} else {
				publishInTransaction(t, db, writer, "SET LOCAL search_path TO "+tenant+", public")
			}
			publishInTransaction(t, db, writer, "")
			if n := count(t, db, "public."+table, ""); n != 2 {
				t.Errorf("the outbox holds %d rows, want 2", n)
			}
			expectTenantTableEmpty(t, db, tenant, table)
		})
	}
}

// A handler that publishes two outputs while its outbox table is missing,
// creates the table, and publishes only the second again has the first
// refused and not written: the delivery fails (the refusal of one output is
// not forgotten because another was written).
func TestOutboxOutputRefusedAndNotWrittenAgainFailsTheDelivery(t *testing.T) {
	t.Parallel()
	db, table := testdb.OpenPostgres(t, ""), "outbox_"+randomSuffix()
	in := routeWithoutOutboxTable(t, db, table, func(msg *message.Message, writer *inbox.Outbox) error {
		tx, _ := inbox.TxFromContext(msg.Context())
		outbox, _ := inbox.OutboxFromContext(msg.Context())
		if _, err := tx.ExecContext(msg.Context(), "SAVEPOINT outputs"); err != nil {
			return err
		}
		_ = outbox.Publish("invoices", message.NewMessage(msg.UUID+"-invoice", []byte("invoice")))
		_ = outbox.Publish("emails", message.NewMessage(msg.UUID+"-email", []byte("email")))
		if _, err := tx.ExecContext(msg.Context(), "ROLLBACK TO SAVEPOINT outputs"); err != nil {
			return err
		}
		for _, stmt := range statements(writer.SchemaSQL()) {
			if _, err := tx.ExecContext(msg.Context(), stmt); err != nil {
				return err
			}
		}
		return outbox.Publish("emails", message.NewMessage(msg.UUID+"-email", []byte("email")))
	})
	if in.deliver(t, message.NewMessage(watermill.NewUUID(), nil)) {
		t.Error("the message was acked without its invoice")
	}
}

// routeWithoutOutboxTable runs, in a router through an inbox on db, handler
// with the Outbox its messages go to, whose table, named table, does not
// exist yet and is dropped when the test ends; it returns the handler's
// feed.
func routeWithoutOutboxTable(t *testing.T, db *sqlx.DB, table string, handler func(msg *message.Message, writer *inbox.Outbox) error) *feed {
	t.Helper()
	dropLater(t, db, table)
	dropLater(t, db, table+"_dead")
	writer, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Dialect: inbox.PostgreSQL, Table: table, Publisher: newBrokerStub()})
	if err != nil {
		t.Fatal(err)
	}
	f := newFixture(t, db)
	middleware := f.newInbox(inbox.Config{Outbox: writer.Publisher}).Middleware
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(middleware)
		r.AddConsumerHandler("billing", "orders", in, func(msg *message.Message) error { return handler(msg, writer) })
	})
	return in
}

// publishInTransaction publishes one message through writer's Publisher in
// a transaction of the application's own on pool, after the statement
// first (none when empty), and commits it.
func publishInTransaction(t *testing.T, pool *sqlx.DB, writer *inbox.Outbox, first string) {
	t.Helper()
	tx, err := pool.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback() //nolint:errcheck // no-op after Commit
	if first != "" {
		if _, err := tx.Exec(first); err != nil {
			t.Fatal(err)
		}
	}
	pub, err := writer.Publisher(tx)
	if err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish("invoices", message.NewMessage(watermill.NewUUID(), []byte("invoice"))); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
}
