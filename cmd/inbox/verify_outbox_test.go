package main

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// "inbox schema -verify -outbox-table O" checks an inbox.Outbox table as the
// relay will use it, not only that it exists: with its dead-letter table
// dropped, the command said "outbox table O exists" and exited 0, and the
// relay's first round then failed in production. A table of another outbox
// (watermill-sql's, Config.OutboxTables) is still only checked to exist.
func TestSchemaVerifyChecksAnOutboxTableAsTheRelayUsesIt(t *testing.T) {
	for name, c := range dsns(t) {
		t.Run(name, func(t *testing.T) {
			table, outbox := appliedOutbox(t, c.dsn, c.db)

			code, out, errOut := cli(t, "schema", "-db", c.dsn, "-table", table, "-outbox-table", outbox, "-verify")
			want := "outbox table " + outbox + " and its dead-letter table " + outbox + "_dead are verified (inbox.Outbox)\n"
			if code != 0 || !strings.Contains(out, want) {
				t.Errorf("verify an outbox -apply made: exit %d, stdout %q, stderr %q; want 0 and %q", code, out, errOut, want)
			}

			if _, err := c.db.Exec("DROP TABLE " + outbox + "_dead"); err != nil {
				t.Fatal(err)
			}
			args := []string{"-db", c.dsn, "-table", table, "-outbox-table", outbox, "-verify"}
			err := schemaCmd(context.Background(), args, &strings.Builder{}, &strings.Builder{})
			if !errors.Is(err, inbox.ErrTableNotFound) || !strings.Contains(err.Error(), outbox+"_dead") {
				t.Errorf("verify an outbox without its dead-letter table: %v, want ErrTableNotFound naming %s_dead", err, outbox)
			}
			if code, out, errOut := cli(t, append([]string{"schema"}, args...)...); code != 1 || !strings.Contains(errOut, outbox+"_dead") {
				t.Errorf("verify an outbox without its dead-letter table: exit %d, stdout %q, stderr %q; want 1 and the table named", code, out, errOut)
			}

			// A table of watermill-sql's (its v4 queue schema's columns):
			// the inbox cannot tell how it is relayed, so it only exists.
			other := "cli_wsql_" + testdb.RandomSuffix()
			testdb.DropLater(t, c.db, other)
			if _, err := c.db.Exec("CREATE TABLE " + other + ` ("offset" BIGINT PRIMARY KEY, uuid VARCHAR(36) NOT NULL,` +
				` payload TEXT, metadata TEXT, created_at TIMESTAMP)`); err != nil {
				if _, err := c.db.Exec("CREATE TABLE " + other + " (`offset` BIGINT PRIMARY KEY, uuid VARCHAR(36) NOT NULL," +
					" payload TEXT, metadata TEXT, created_at TIMESTAMP NULL)"); err != nil {
					t.Fatal(err)
				}
			}
			code, out, errOut = cli(t, "schema", "-db", c.dsn, "-table", table, "-outbox-table", other, "-verify")
			if code != 0 || !strings.Contains(out, "outbox table "+other+" exists\n") {
				t.Errorf("verify another outbox's table: exit %d, stdout %q, stderr %q; want 0 and that it exists", code, out, errOut)
			}
		})
	}
}

// On PostgreSQL, "inbox schema -verify -outbox-table O" refuses an outbox
// whose id sequence caches values per session (the relay could send one
// writer's messages out of order), with the statement that fixes it.
func TestSchemaVerifyRefusesAnOutboxWhoseIDSequenceCaches(t *testing.T) {
	c := dsns(t)["postgres"]
	table, outbox := appliedOutbox(t, c.dsn, c.db)
	if _, err := c.db.Exec("ALTER TABLE " + outbox + " ALTER COLUMN id SET CACHE 20"); err != nil {
		t.Fatal(err)
	}
	args := []string{"-db", c.dsn, "-table", table, "-outbox-table", outbox, "-verify"}
	if err := schemaCmd(context.Background(), args, &strings.Builder{}, &strings.Builder{}); !errors.Is(err, inbox.ErrIncompatibleTable) ||
		!strings.Contains(err.Error(), "SET CACHE 1") {
		t.Errorf("verify an outbox whose id sequence caches 20: %v, want ErrIncompatibleTable with the fix", err)
	}
}

// appliedOutbox makes an inbox table and an inbox.Outbox table with
// "inbox schema -apply", dropped after the test, and returns their names.
func appliedOutbox(t *testing.T, dsn string, db *sqlx.DB) (table, outbox string) {
	t.Helper()
	table, outbox = appliedTable(t, dsn, db), "cli_outbox_"+testdb.RandomSuffix()
	testdb.DropLater(t, db, outbox)
	testdb.DropLater(t, db, outbox+"_dead")
	if code, out, errOut := cli(t, "schema", "-db", dsn, "-table", table, "-outbox-table", outbox, "-apply"); code != 0 {
		t.Fatalf("schema -apply: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	return table, outbox
}

// A service whose user may only INSERT into another outbox's table (a
// watermill-sql publisher only inserts; its relay reads the table as another
// user): "inbox schema -verify -outbox-table" says that the table exists and
// exits 0, as it did before it read the columns of an outbox table to tell
// an inbox.Outbox's (that read's refusal failed the command).
func TestSchemaVerifyOfAnotherOutboxTheUserMayOnlyWriteSaysItExists(t *testing.T) {
	c := dsns(t)["postgres"]
	table := appliedTable(t, c.dsn, c.db)
	other := "cli_wsql_" + testdb.RandomSuffix()
	testdb.DropLater(t, c.db, other)
	role := "cli_svc_" + testdb.RandomSuffix()
	for _, s := range []string{
		`CREATE TABLE ` + other + ` ("offset" BIGSERIAL PRIMARY KEY, uuid VARCHAR(36) NOT NULL, payload JSON, metadata JSON,` +
			` transaction_id xid8 NOT NULL DEFAULT pg_current_xact_id(), created_at TIMESTAMP NOT NULL DEFAULT now())`,
		"CREATE ROLE " + role + " LOGIN",
		"GRANT SELECT, INSERT, DELETE ON " + table + " TO " + role,
		"GRANT INSERT ON " + other + " TO " + role,
	} {
		if _, err := c.db.Exec(s); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		_, _ = c.db.Exec("DROP OWNED BY " + role)
		_, _ = c.db.Exec("DROP ROLE " + role)
	})
	dsn := strings.Replace(c.dsn, "postgres@", role+"@", 1)
	code, out, errOut := cli(t, "schema", "-db", dsn, "-table", table, "-outbox-table", other, "-verify")
	if code != 0 || !strings.Contains(out, "outbox table "+other+" exists") {
		t.Errorf("verify another outbox the user may only write: exit %d, stdout %q, stderr %q; want 0 and that it exists", code, out, errOut)
	}
}

// A fingerprint column the user may not read and write makes "inbox schema
// -verify" exit 1 (the database needs fixing) with the GRANT, not 2 and the
// usage hint (the command line needs fixing).
func TestSchemaVerifyOfAFingerprintColumnNotGrantedExitsOne(t *testing.T) {
	c := dsns(t)["postgres"]
	table := "cli_fg_" + testdb.RandomSuffix()
	testdb.DropLater(t, c.db, table)
	role := "cli_fgr_" + testdb.RandomSuffix()
	cols := "(consumer, message_id, processed_at)"
	for _, s := range []string{
		"CREATE TABLE " + table + " (consumer text NOT NULL, message_id text NOT NULL," +
			" processed_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (consumer, message_id))",
		"CREATE INDEX " + table + "_processed_at_idx ON " + table + " (processed_at)",
		"CREATE ROLE " + role + " LOGIN",
		"GRANT DELETE, SELECT " + cols + ", INSERT " + cols + " ON " + table + " TO " + role,
		"ALTER TABLE " + table + " ADD COLUMN fingerprint bytea",
	} {
		if _, err := c.db.Exec(s); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		_, _ = c.db.Exec("DROP OWNED BY " + role)
		_, _ = c.db.Exec("DROP ROLE " + role)
	})
	dsn := strings.Replace(c.dsn, "postgres@", role+"@", 1)
	code, out, errOut := cli(t, "schema", "-db", dsn, "-table", table, "-verify")
	if code != 1 || strings.Contains(errOut, "for usage") || !strings.Contains(errOut, "GRANT SELECT (fingerprint)") {
		t.Errorf("verify with the fingerprint column not granted: exit %d, stdout %q, stderr %q; want 1 with the GRANT, no usage hint",
			code, out, errOut)
	}
}
