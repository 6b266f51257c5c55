package entinbox_test

// The test harness: the databases, the ent client of the application (on
// the inbox's pool), and each test's inbox table.

import (
	"context"
	"sync"
	"testing"
	"time"

	"entgo.io/ent/dialect"
	entsql "entgo.io/ent/dialect/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/entinbox/internal/invoiceent"
	"github.com/watermill-inbox/inbox/entinbox/internal/invoiceent/invoice"
	"github.com/watermill-inbox/inbox/entinbox/internal/invoiceent/line"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/internal/testrouter"
)

// database is one database ent runs on here, with its ent dialect: SQLite
// (modernc.org/sqlite, the inbox's driver), PostgreSQL (pgx) and
// MySQL/MariaDB. The inbox's partitioned and clientFoundRows variants change
// nothing for ent.
type database struct {
	testdb.DB
	dialect string
}

func databases() []database {
	dialects := map[string]string{"sqlite": dialect.SQLite, "postgres": dialect.Postgres, "mysql": dialect.MySQL}
	var dbs []database
	for _, d := range testdb.All {
		if dl, ok := dialects[d.Name]; ok {
			dbs = append(dbs, database{DB: d, dialect: dl})
		}
	}
	return dbs
}

// migrating serialises ent's migrations: the generated tables have fixed
// names, shared on PostgreSQL and MariaDB by the tests running in parallel
// (each test keeps to its own order ids), and ent's migration inspects
// before it creates, so two at once could both try to create a table.
var migrating sync.Mutex

// fixture is one test's database, the application's ent client on the
// inbox's pool, and an inbox table of the test's own.
type fixture struct {
	t       *testing.T
	db      *sqlx.DB
	dialect string
	client  *invoiceent.Client // the application's client, on the pool
	ib      *inbox.Inbox
	inbox   string
	orderID string // the test's order id: its rows' order ids and SKUs start with it
}

func newFixture(t *testing.T, d database) *fixture {
	t.Helper()
	db := d.Open(t)
	suffix := testdb.RandomSuffix()
	f := &fixture{t: t, db: db, dialect: d.dialect, inbox: "inbox_" + suffix, orderID: "order-" + suffix}
	f.client = invoiceent.NewClient(invoiceent.Driver(entsql.OpenDB(d.dialect, db.DB)))

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	migrating.Lock()
	err := f.client.Schema.Create(ctx)
	migrating.Unlock()
	if err != nil {
		t.Fatalf("ent migration: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := f.client.Line.Delete().Where(line.SkuHasPrefix(f.orderID)).Exec(ctx); err != nil {
			t.Logf("delete the test's lines: %v", err)
		}
		if _, err := f.client.Invoice.Delete().Where(invoice.OrderIDHasPrefix(f.orderID)).Exec(ctx); err != nil {
			t.Logf("delete the test's invoices: %v", err)
		}
	})

	f.ib, err = inbox.New(inbox.Config{DB: db, Dialect: d.Dialect, Table: f.inbox})
	if err != nil {
		t.Fatal(err)
	}
	testdb.DropLater(t, db, f.inbox)
	if err := f.ib.InitializeSchema(ctx); err != nil {
		t.Fatal(err)
	}
	return f
}

// invoice returns the amount of the invoice of orderID and its number of
// lines, and false when there is no such invoice.
func (f *fixture) invoice(orderID string) (amount, lines int, ok bool) {
	f.t.Helper()
	ctx := context.Background()
	inv, err := f.client.Invoice.Query().Where(invoice.OrderID(orderID)).Only(ctx)
	if invoiceent.IsNotFound(err) {
		return 0, 0, false
	}
	if err != nil {
		f.t.Fatal(err)
	}
	n, err := inv.QueryLines().Count(ctx)
	if err != nil {
		f.t.Fatal(err)
	}
	return inv.Amount, n, true
}

// lines counts the lines whose SKU starts with orderID, attached or not.
func (f *fixture) lines(orderID string) int {
	f.t.Helper()
	n, err := f.client.Line.Query().Where(line.SkuHasPrefix(orderID)).Count(context.Background())
	if err != nil {
		f.t.Fatal(err)
	}
	return n
}

// inboxRows counts the rows of the fixture's inbox table.
func (f *fixture) inboxRows() int {
	f.t.Helper()
	var n int
	if err := f.db.GetContext(context.Background(), &n, "SELECT COUNT(*) FROM "+f.inbox); err != nil {
		f.t.Fatal(err)
	}
	return n
}

// router runs h as the handler of a router, behind the fixture's inbox
// middleware when withInbox is set.
func (f *fixture) router(withInbox bool, h message.NoPublishHandlerFunc) (*testrouter.Feed, *testrouter.Outcomes) {
	f.t.Helper()
	if withInbox {
		return testrouter.Run(f.t, h, f.ib.Middleware)
	}
	return testrouter.Run(f.t, h)
}
