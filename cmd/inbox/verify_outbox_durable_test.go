package main

import (
	"strings"
	"testing"

	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox/internal/testdb"
)

// "inbox schema -verify -outbox-table O" refuses an inbox.Outbox table on
// MySQL/MariaDB whose storage engine is not transactional (MyISAM), as it
// refuses such an inbox table: a handler's outputs written to it stay when
// the handler's transaction rolls back, so the relay sends messages of a
// transaction that never committed.
func TestSchemaVerifyRefusesAnOutboxTableOnANonTransactionalEngine(t *testing.T) {
	c, table, outbox := appliedWithOutbox(t, "mysql")
	if _, err := c.db.Exec("ALTER TABLE " + outbox + " ENGINE=MyISAM"); err != nil {
		t.Fatal(err)
	}
	code, out, errOut := cli(t, "schema", "-db", c.dsn, "-table", table, "-outbox-table", outbox, "-verify")
	if code != 1 || !strings.Contains(errOut, "MyISAM") {
		t.Errorf("schema -verify of a MyISAM outbox table: exit %d, stdout %q, stderr %q; want exit 1 naming the engine", code, out, errOut)
	}
}

// "inbox schema -verify -outbox-table O" refuses an UNLOGGED inbox.Outbox
// table on PostgreSQL, as it refuses an UNLOGGED inbox table: crash recovery
// empties it, and the messages of transactions that committed are lost.
func TestSchemaVerifyRefusesAnUnloggedOutboxTable(t *testing.T) {
	c, table, outbox := appliedWithOutbox(t, "postgres")
	if _, err := c.db.Exec("ALTER TABLE " + outbox + " SET UNLOGGED"); err != nil {
		t.Fatal(err)
	}
	code, out, errOut := cli(t, "schema", "-db", c.dsn, "-table", table, "-outbox-table", outbox, "-verify")
	if code != 1 || !strings.Contains(errOut, "UNLOGGED") {
		t.Errorf("schema -verify of an UNLOGGED outbox table: exit %d, stdout %q, stderr %q; want exit 1 saying it is UNLOGGED", code, out, errOut)
	}
}

// "inbox schema -verify -outbox-table O" checks the types of O's columns as
// it checks the inbox table's: an id of type integer (a hand-written
// migration's "id serial") runs out after 2^31 messages, when every
// handler's transaction fails on the outbox INSERT.
func TestSchemaVerifyRefusesAnOutboxTableWithAnIntegerID(t *testing.T) {
	c, table, outbox := appliedWithOutbox(t, "postgres")
	if _, err := c.db.Exec("ALTER TABLE " + outbox + " ALTER COLUMN id TYPE integer"); err != nil {
		t.Fatal(err)
	}
	code, out, errOut := cli(t, "schema", "-db", c.dsn, "-table", table, "-outbox-table", outbox, "-verify")
	if code != 1 || !strings.Contains(errOut, "id") {
		t.Errorf("schema -verify of an outbox table whose id is an integer: exit %d, stdout %q, stderr %q; want exit 1 naming the id column",
			code, out, errOut)
	}
}

// appliedWithOutbox creates, with "inbox schema -apply", an inbox table and
// an outbox table (with its dead-letter table) on the database name of
// dsns, dropped when the test ends.
func appliedWithOutbox(t *testing.T, name string) (c struct {
	dsn string
	db  *sqlx.DB
}, table, outbox string) {
	t.Helper()
	c = dsns(t)[name]
	table, outbox = "cli_in_"+testdb.RandomSuffix(), "cli_ob_"+testdb.RandomSuffix()
	testdb.DropLater(t, c.db, table)
	testdb.DropLater(t, c.db, outbox)
	testdb.DropLater(t, c.db, outbox+"_dead")
	if code, out, errOut := cli(t, "schema", "-db", c.dsn, "-table", table, "-outbox-table", outbox, "-apply"); code != 0 {
		t.Fatalf("schema -apply: %d %q %q", code, out, errOut)
	}
	return c, table, outbox
}
