package gorminbox_test

// The test harness: the databases, a GORM model with hooks and an
// association, and each test's tables.

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
	"gorm.io/driver/mysql"
	"gorm.io/driver/postgres"
	"gorm.io/driver/sqlite"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"
	"gorm.io/gorm/schema"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
	"github.com/watermill-inbox/inbox/internal/testrouter"
)

// databases are the ones GORM runs on here: SQLite (modernc.org/sqlite, the
// inbox's driver), PostgreSQL (pgx) and MySQL/MariaDB. The inbox's
// partitioned and clientFoundRows variants change nothing for GORM.
func databases() []testdb.DB {
	var dbs []testdb.DB
	for _, d := range testdb.All {
		switch d.Name {
		case "sqlite", "postgres", "mysql":
			dbs = append(dbs, d)
		}
	}
	return dbs
}

// Invoice is the business row a handler writes. Its hooks stamp it and
// write an Audit row through the session they are given; its Lines are an
// association created with it.
type Invoice struct {
	ID      uint
	OrderID string `gorm:"size:64;uniqueIndex"`
	Amount  int
	Stamp   string `gorm:"size:32"`
	Lines   []Line
}

// Line belongs to an Invoice.
type Line struct {
	ID        uint
	InvoiceID uint
	SKU       string `gorm:"size:32"`
}

// Audit is written by Invoice's AfterCreate hook.
type Audit struct {
	ID      uint
	OrderID string `gorm:"size:64"`
}

// BeforeCreate stamps the invoice, as hooks that fill in fields do.
func (i *Invoice) BeforeCreate(*gorm.DB) error {
	i.Stamp = "before-create"
	return nil
}

// AfterCreate writes an audit row through tx, the session the Create ran on.
func (i *Invoice) AfterCreate(tx *gorm.DB) error {
	return tx.Create(&Audit{OrderID: i.OrderID}).Error
}

// fixture is one test's database, its own tables (an inbox table, and the
// GORM tables under a prefix of their own), and the application's *gorm.DB
// on the inbox's pool.
type fixture struct {
	t     *testing.T
	db    *sqlx.DB
	gdb   *gorm.DB
	ib    *inbox.Inbox
	inbox string
}

func newFixture(t *testing.T, d testdb.DB) *fixture {
	t.Helper()
	db := d.Open(t)
	suffix := testdb.RandomSuffix()
	f := &fixture{t: t, db: db, inbox: "inbox_" + suffix}

	var dialector gorm.Dialector
	switch d.Name {
	case "sqlite":
		dialector = sqlite.New(sqlite.Config{Conn: db.DB})
	case "postgres":
		dialector = postgres.New(postgres.Config{Conn: db.DB})
	case "mysql":
		dialector = mysql.New(mysql.Config{Conn: db.DB})
	default:
		t.Fatalf("no GORM dialector for %s", d.Name)
	}
	gdb, err := gorm.Open(dialector, &gorm.Config{
		NamingStrategy: schema.NamingStrategy{TablePrefix: "g" + suffix + "_"},
		Logger:         logger.Discard,
	})
	if err != nil {
		t.Fatal(err)
	}
	f.gdb = gdb
	if err := gdb.AutoMigrate(&Invoice{}, &Line{}, &Audit{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := gdb.WithContext(ctx).Migrator().DropTable(&Line{}, &Audit{}, &Invoice{}); err != nil {
			t.Logf("drop GORM tables: %v", err)
		}
	})

	f.ib, err = inbox.New(inbox.Config{DB: db, Dialect: d.Dialect, Table: f.inbox})
	if err != nil {
		t.Fatal(err)
	}
	testdb.DropLater(t, db, f.inbox)
	if err := f.ib.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	return f
}

// invoices counts the invoices of orderID, their lines, and the audit rows.
func (f *fixture) invoices(orderID string) (invoices, lines, audits int64) {
	f.t.Helper()
	if err := f.gdb.Model(&Invoice{}).Where("order_id = ?", orderID).Count(&invoices).Error; err != nil {
		f.t.Fatal(err)
	}
	err := f.gdb.Model(&Line{}).Where("invoice_id IN (?)", f.gdb.Model(&Invoice{}).Select("id").Where("order_id = ?", orderID)).
		Count(&lines).Error
	if err != nil {
		f.t.Fatal(err)
	}
	if err := f.gdb.Model(&Audit{}).Where("order_id = ?", orderID).Count(&audits).Error; err != nil {
		f.t.Fatal(err)
	}
	return invoices, lines, audits
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
