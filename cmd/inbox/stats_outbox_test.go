package main

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// "inbox stats -outbox-table O" shows the outbox O after the inbox table:
// the messages pending, that the oldest was written moments ago, the last
// refusal of the first in line, and the dead letters; an outbox table that does not exist fails the command
// (exit 1, ErrTableNotFound, naming it) and prints nothing on stdout.
func TestStatsShowsTheOutboxTableNamed(t *testing.T) {
	for name, c := range dsns(t) {
		t.Run(name, func(t *testing.T) {
			table, outbox := appliedTable(t, c.dsn, c.db), "cli_outbox_"+testdb.RandomSuffix()
			// Four messages, the first refused for good: one relay round
			// (MaxAttempts 1) sets it aside and sends the second.
			relayWithADeadLetter(t, c.db, outbox, 4)
			// Then a round whose broker has no leader for the topic: the
			// first message in line keeps that refusal as its last error.
			down, err := inbox.NewOutbox(inbox.OutboxConfig{DB: c.db, Table: outbox, Publisher: refuseAll{}})
			if err != nil {
				t.Fatal(err)
			}
			if r := down.RelayOnce(context.Background()); r.Err == nil {
				t.Fatalf("relay round while the broker refuses: %+v, want its error", r)
			}

			code, out, errOut := cli(t, "stats", "-db", c.dsn, "-table", table, "-outbox-table", outbox)
			for _, want := range []string{
				"rows:     0\n",
				"outbox:   " + outbox + "\n",
				"pending:  2 messages, the oldest written ",
				"\nrefused:  the first in line, last refused with: ",
				"no leader for partition 3",
				"dead:     1 message in the dead-letter table\n",
			} {
				if code != 0 || !strings.Contains(out, want) {
					t.Errorf("stats -outbox-table: exit %d, stderr %q, stdout without %q:\n%s", code, errOut, want, out)
				}
			}

			missing := "cli_no_outbox_" + testdb.RandomSuffix()
			args := []string{"-db", c.dsn, "-table", table, "-outbox-table", missing}
			if err := statsCmd(context.Background(), args, &strings.Builder{}, &strings.Builder{}); !errors.Is(err, inbox.ErrTableNotFound) ||
				!strings.Contains(err.Error(), missing) {
				t.Errorf("stats of a missing outbox table: %v, want ErrTableNotFound naming %s", err, missing)
			}
			if code, out, errOut := cli(t, append([]string{"stats"}, args...)...); code != 1 || out != "" || !strings.Contains(errOut, missing) {
				t.Errorf("stats of a missing outbox table: exit %d, stdout %q, stderr %q; want 1, nothing on stdout and the table named", code, out, errOut)
			}
		})
	}
}

// Without -outbox-table, "inbox stats" shows the default outbox table when
// it exists, and nothing of an outbox when it does not. On SQLite alone: the
// default name is shared by every test of a PostgreSQL or MariaDB database.
func TestStatsShowsTheDefaultOutboxWhenItExists(t *testing.T) {
	path := filepath.Join(t.TempDir(), "outbox.db")
	db := testdb.OpenSQLite(t, path)
	dsn := "sqlite://" + path + "?" + testdb.SQLiteParams
	if code, _, errOut := cli(t, "schema", "-db", dsn, "-apply"); code != 0 {
		t.Fatal(errOut)
	}
	code, out, errOut := cli(t, "stats", "-db", dsn)
	if code != 0 || !strings.Contains(out, "rows:     0\n") || strings.Contains(out, "outbox:") {
		t.Errorf("stats without an outbox table: exit %d, stderr %q, stdout:\n%s\nwant the inbox's stats and no outbox", code, errOut, out)
	}
	relayWithADeadLetter(t, db, "", 3)
	code, out, errOut = cli(t, "stats", "-db", dsn)
	want := "outbox:   " + inbox.DefaultOutboxTable + "\npending:  1 message, the oldest written "
	if code != 0 || !strings.Contains(out, want) || !strings.Contains(out, "dead:     1 message in the dead-letter table\n") {
		t.Errorf("stats with the default outbox table: exit %d, stderr %q, stdout:\n%s\nwant %q and 1 dead letter", code, errOut, out, want)
	}
}

// relayWithADeadLetter creates the outbox table (its default name for ""),
// dropped when t ends, commits n messages to it and runs one relay round
// (MaxAttempts 1) whose broker refuses the first: it is set aside, the
// second is sent, and n-2 stay pending.
func relayWithADeadLetter(t *testing.T, db *sqlx.DB, table string, n int) {
	t.Helper()
	broker := &refuseFirst{}
	ob, err := inbox.NewOutbox(inbox.OutboxConfig{DB: db, Table: table, Publisher: broker, MaxAttempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	testdb.DropLater(t, db, ob.Table()+"_dead")
	testdb.DropLater(t, db, ob.Table())
	if err := ob.InitializeSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	tx, err := db.Beginx()
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	pub, err := ob.Publisher(tx)
	if err != nil {
		t.Fatal(err)
	}
	for i := range n {
		m := message.NewMessage(watermill.NewUUID(), nil)
		if i == 0 {
			broker.uuid = m.UUID
		}
		if err := pub.Publish("invoices", m); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	if r := ob.RelayOnce(context.Background()); r.DeadLettered != 1 || r.Relayed != 1 {
		t.Fatalf("relay round %+v, want 1 message set aside and 1 sent", r)
	}
}

// refuseFirst is a broker that refuses every Publish carrying the message
// uuid, and accepts the others.
type refuseFirst struct{ uuid string }

func (b *refuseFirst) Publish(_ string, msgs ...*message.Message) error {
	for _, m := range msgs {
		if m.UUID == b.uuid {
			return fmt.Errorf("message %s too large", m.UUID)
		}
	}
	return nil
}

func (b *refuseFirst) Close() error { return nil }

// refuseAll is a broker that has no leader for any partition.
type refuseAll struct{}

func (refuseAll) Publish(string, ...*message.Message) error {
	return fmt.Errorf("%w: no leader for partition 3", inbox.ErrBrokerUnavailable)
}

func (refuseAll) Close() error { return nil }

// "inbox stats -timeout" bounds its reads: an outbox table another session
// holds a lock on (a migration, an operator's LOCK TABLE) made stats wait,
// silent, for as long as it was held. The command fails, saying that the
// reads outlived -timeout and which one, and prints nothing on stdout.
func TestStatsGivesUpOnATableLockedLongerThanItsTimeout(t *testing.T) {
	for name, c := range dsns(t) {
		if name == "sqlite" {
			continue // a WAL database lets readers through any writer's lock
		}
		t.Run(name, func(t *testing.T) {
			table, outbox := appliedTable(t, c.dsn, c.db), "cli_outbox_"+testdb.RandomSuffix()
			relayWithADeadLetter(t, c.db, outbox, 2)
			conn, err := c.db.Connx(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			lock := map[string][]string{
				"postgres": {"BEGIN", "LOCK TABLE " + outbox + " IN ACCESS EXCLUSIVE MODE"},
				"mysql":    {"LOCK TABLES " + outbox + " WRITE"},
			}[name]
			for _, q := range lock {
				if _, err := conn.ExecContext(context.Background(), q); err != nil {
					t.Fatal(err)
				}
			}
			var out strings.Builder
			err = statsCmd(context.Background(), []string{"-db", c.dsn, "-table", table, "-outbox-table", outbox, "-timeout", "1s"}, &out, &strings.Builder{})
			if err == nil || !strings.Contains(err.Error(), "-timeout 1s") || !strings.Contains(err.Error(), outbox) || out.Len() > 0 {
				t.Errorf("stats while %s is locked: %v, stdout %q; want an error naming the outbox and -timeout, nothing on stdout", outbox, err, out.String())
			}
		})
	}
}

// "inbox stats" and "inbox purge" on an inbox table that does not exist
// (the service names its own, and -table was left out) fail with exit 1,
// an error that matches ErrTableNotFound, and a line that says which flag
// names the table: they printed the driver's "does not exist" alone.
func TestCommandsOnAMissingTableSayWhichFlagNamesIt(t *testing.T) {
	for name, c := range dsns(t) {
		t.Run(name, func(t *testing.T) {
			missing := "cli_no_inbox_" + testdb.RandomSuffix()
			stats := []string{"-db", c.dsn, "-table", missing}
			if err := statsCmd(context.Background(), stats, &strings.Builder{}, &strings.Builder{}); !errors.Is(err, inbox.ErrTableNotFound) {
				t.Errorf("stats of a missing inbox table: %v, want ErrTableNotFound", err)
			}
			for _, args := range [][]string{
				append([]string{"stats"}, stats...),
				{"purge", "-db", c.dsn, "-table", missing, "-older-than", "1h"},
			} {
				code, out, errOut := cli(t, args...)
				if code != 1 || out != "" || !strings.Contains(errOut, missing) || !strings.Contains(errOut, "-table") {
					t.Errorf("%s on a missing table: exit %d, stdout %q, stderr %q; want 1, the table named and the -table flag", args[0], code, out, errOut)
				}
			}
		})
	}
}

// "inbox schema -outbox-table O" prints the outbox's DDL beside the inbox's,
// and with -apply creates the outbox and its dead-letter table, no broker
// needed: an Outbox, whose SchemaSQL the README pointed migrations at,
// could not be made without a broker's publisher, which may connect when
// it is made.
func TestSchemaPrintsAndAppliesTheOutboxTables(t *testing.T) {
	for name, c := range dsns(t) {
		t.Run(name, func(t *testing.T) {
			outbox := "cli_outbox_" + testdb.RandomSuffix()
			want, err := inbox.OutboxSchemaSQL(map[string]inbox.Dialect{"sqlite": inbox.SQLite, "postgres": inbox.PostgreSQL, "mysql": inbox.MySQL}[name], outbox)
			if err != nil {
				t.Fatal(err)
			}
			code, out, errOut := cli(t, "schema", "-db", c.dsn, "-outbox-table", outbox)
			if code != 0 || !strings.Contains(out, "watermill_inbox") || !strings.HasSuffix(out, want) || !strings.Contains(want, outbox+"_dead") {
				t.Errorf("schema -outbox-table: exit %d, stderr %q, stdout\n%s\nwant the inbox's DDL, then\n%s", code, errOut, out, want)
			}
			table := "cli_" + testdb.RandomSuffix()
			testdb.DropLater(t, c.db, table)
			testdb.DropLater(t, c.db, outbox)
			testdb.DropLater(t, c.db, outbox+"_dead")
			code, out, errOut = cli(t, "schema", "-db", c.dsn, "-table", table, "-outbox-table", outbox, "-apply")
			if code != 0 || !strings.Contains(out, "outbox table "+outbox+" and its dead-letter table "+outbox+"_dead are ready") {
				t.Fatalf("schema -outbox-table -apply: exit %d, stdout %q, stderr %q", code, out, errOut)
			}
			if st, err := inbox.ReadOutboxStats(context.Background(), c.db, nil, outbox); err != nil || st.Pending != 0 {
				t.Errorf("the outbox -apply made: %+v, %v; want an empty outbox the relay can read", st, err)
			}
		})
	}
}

// The default outbox table with a message pending and no dead-letter table
// (dropped, or a migration that made only the outbox) fails "inbox stats"
// (exit 1, naming the dead-letter table): it printed no outbox at all, as
// for a service without one, and the waiting message stayed hidden.
func TestStatsFailsOnTheDefaultOutboxWithoutItsDeadLetterTable(t *testing.T) {
	path := filepath.Join(t.TempDir(), "outbox.db")
	db := testdb.OpenSQLite(t, path)
	dsn := "sqlite://" + path + "?" + testdb.SQLiteParams
	if code, _, errOut := cli(t, "schema", "-db", dsn, "-outbox-table", inbox.DefaultOutboxTable, "-apply"); code != 0 {
		t.Fatal(errOut)
	}
	relayWithADeadLetter(t, db, "", 3)
	if _, err := db.Exec("DROP TABLE " + inbox.DefaultOutboxTable + "_dead"); err != nil {
		t.Fatal(err)
	}
	code, out, errOut := cli(t, "stats", "-db", dsn)
	if code != 1 || out != "" || !strings.Contains(errOut, "dead-letter table") || !strings.Contains(errOut, inbox.DefaultOutboxTable+"_dead") {
		t.Errorf("stats: exit %d, stdout %q, stderr %q; want 1, nothing on stdout, and the missing dead-letter table named", code, out, errOut)
	}
}
