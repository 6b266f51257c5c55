package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"reflect"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/go-sql-driver/mysql"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// Verify (and so RouterPlugin, before the router starts) refuses a database
// user that can write outbox rows but not relay them: without UPDATE the
// relay could not count a refused message's attempts, without DELETE not
// remove what it sent. The error names the statement that failed. A user
// with the privileges passes.
func TestOutboxVerifyRefusesAUserWhoCannotRelay(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if tdb.Dialect == inbox.SQLite {
			t.Skip("SQLite has no users")
		}
		ob, relay, table, user := newLimitedRelay(t, db, tdb, inbox.OutboxConfig{Publisher: newBrokerStub()})
		err := relay.Verify(context.Background())
		if err == nil || !strings.Contains(err.Error(), "cannot run its statements") || !strings.Contains(err.Error(), "UPDATE") {
			t.Fatalf("Verify with SELECT and INSERT only: %v; want the refused UPDATE named", err)
		}
		exec(t, db, "GRANT UPDATE, DELETE ON "+table+" TO "+grantee(tdb, user))
		if err := relay.Verify(context.Background()); err != nil {
			t.Errorf("Verify with every privilege the relay needs: %v", err)
		}
		writeOutbox(t, db, ob, "orders", 3)
		if round := relay.RelayOnce(context.Background()); round.Err != nil || round.Relayed != 3 {
			t.Errorf("relayed %d, error %v; want 3", round.Relayed, round.Err)
		}
	})
}

// A read of the relay's walk that fails (here whether the dead-letter table
// holds a refused message's id, for a user without SELECT on that table)
// leaves the message it was for first in line, and the round records the
// rest: on PostgreSQL the read runs under a savepoint, so the failed
// statement does not end the round's transaction, which then failed after
// its publishes, and every message it had published went again.
func TestOutboxRelayRecordsItsRoundWhenAReadOfItsWalkFails(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		if tdb.Dialect == inbox.SQLite {
			t.Skip("SQLite has no users")
		}
		broker := newBrokerStub()
		ob, relay, table, user := newLimitedRelay(t, db, tdb, inbox.OutboxConfig{Publisher: broker, MaxAttempts: 1})
		exec(t, db, "GRANT UPDATE, DELETE ON "+table+" TO "+grantee(tdb, user))
		exec(t, db, "REVOKE SELECT ON "+table+"_dead FROM "+grantee(tdb, user))
		refused := writeOutbox(t, db, ob, "payments", 2)
		accepted := writeOutbox(t, db, ob, "invoices", 3)
		broker.setRefuse(refuseUUIDs(errors.New("the broker refuses the message"), refused[0]))
		for i := range 3 {
			round := relay.RelayOnce(context.Background())
			if round.Err == nil || !strings.Contains(round.Err.Error(), "could not be read") {
				t.Errorf("round %d: %+v, want an error that says the dead-letter table could not be read", i+1, round)
			}
			if i == 0 && round.Relayed != 3 {
				t.Errorf("first round relayed %d, want the 3 of the other topic", round.Relayed)
			}
		}
		if got := broker.uuids("invoices"); fmt.Sprint(got) != fmt.Sprint(accepted) {
			t.Errorf("sent %v, want %v, each once", got, accepted)
		}
		if got := broker.uuids("payments"); len(got) != 0 {
			t.Errorf("sent %v past the refused message, want nothing", got)
		}
		if stats, err := ob.Stats(context.Background()); err != nil || stats.Pending != 2 || stats.DeadLettered != 0 {
			t.Errorf("stats: %+v (%v), want the refused message and the one behind it pending", stats, err)
		}
	})
}

// newLimitedRelay returns an outbox on a table of its own (through db) and
// a relay of that table with cfg's other fields, logged in as a new user
// with only SELECT and INSERT on the table and its dead-letter table
// (openAs), with the table's name and the user's.
func newLimitedRelay(t *testing.T, db *sqlx.DB, tdb testDB, cfg inbox.OutboxConfig) (ob, relay *inbox.Outbox, table, user string) {
	t.Helper()
	ob = newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: newBrokerStub()})
	table = relayTable(t, ob)
	user = "outbox_user_" + randomSuffix()
	cfg.DB, cfg.Dialect, cfg.Table = openAs(t, db, tdb, user, table), tdb.Dialect, table
	relay, err := inbox.NewOutbox(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return ob, relay, table, user
}

// grantee is user as GRANT names it.
func grantee(tdb testDB, user string) string {
	if tdb.Dialect == inbox.MySQL {
		return "'" + user + "'@'%'"
	}
	return user
}

// openAs creates user with SELECT and INSERT on table and on its
// dead-letter table, drops it when the test ends, and opens a pool that
// logs in as it.
func openAs(t *testing.T, db *sqlx.DB, tdb testDB, user, table string) *sqlx.DB {
	t.Helper()
	var dsn string
	if tdb.Dialect == inbox.MySQL {
		exec(t, db, "CREATE USER '"+user+"'@'%'")
		t.Cleanup(func() { _, _ = db.Exec("DROP USER '" + user + "'@'%'") })
		cfg, err := mysql.ParseDSN(testdb.MySQLDSN())
		if err != nil {
			t.Fatal(err)
		}
		cfg.User, cfg.Passwd = user, ""
		dsn = cfg.FormatDSN()
	} else {
		exec(t, db, "CREATE ROLE "+user+" LOGIN")
		t.Cleanup(func() {
			_, _ = db.Exec("DROP OWNED BY " + user)
			_, _ = db.Exec("DROP ROLE " + user)
		})
		u, err := url.Parse(testdb.PostgresDSN())
		if err != nil {
			t.Fatal(err)
		}
		u.User = url.User(user)
		dsn = u.String()
	}
	exec(t, db, "GRANT SELECT, INSERT ON "+table+" TO "+grantee(tdb, user))
	exec(t, db, "GRANT SELECT, INSERT ON "+table+"_dead TO "+grantee(tdb, user))
	driver := map[inbox.Dialect]string{inbox.MySQL: "mysql"}[tdb.Dialect]
	if driver == "" {
		driver = "pgx"
	}
	limited, err := sqlx.Open(driver, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { limited.Close() })
	return limited
}

// A message the outbox cannot store as it is (an empty topic, an empty
// UUID or one that is not UTF-8) is refused with ErrOutboxMessage and
// nothing is written; the transaction stays usable, and a valid message in
// it commits.
func TestOutboxRefusesAMessageItCannotStoreAsItIs(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		broker := newBrokerStub()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker})
		withMeta := func(key, value string) *message.Message {
			m := message.NewMessage(watermill.NewUUID(), []byte("payload"))
			m.Metadata.Set(key, value)
			return m
		}
		cases := []struct {
			name  string
			topic string
			msg   *message.Message
		}{
			{"empty topic", "", message.NewMessage(watermill.NewUUID(), nil)},
			{"empty UUID", "orders", message.NewMessage("", nil)},
			{"UUID not UTF-8", "orders", message.NewMessage("id-\xff", nil)},
		}
		tx, pub := beginOutbox(t, db, ob)
		for _, c := range cases {
			if err := pub.Publish(c.topic, c.msg); !errors.Is(err, inbox.ErrOutboxMessage) {
				t.Errorf("%s: Publish returned %v, want ErrOutboxMessage", c.name, err)
			}
		}
		good := withMeta("note", "ünïcode ✓")
		if err := pub.Publish("orders", good); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		relayUntilEmpty(t, ob)
		got := broker.messages("orders")
		if len(got) != 1 || got[0].UUID != good.UUID || got[0].Metadata.Get("note") != "ünïcode ✓" {
			t.Errorf("sent %v, want only the valid message, metadata unchanged", got)
		}
	})
}

// Verify refuses an outbox table made or altered by hand without a column
// the relay writes only when the broker refuses a message (last_error):
// before, it passed, and the first refusal failed every round after its
// publish, so the other messages were sent again and again.
func TestOutboxVerifyRefusesATableWithoutAColumnTheRelayWrites(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: newBrokerStub()})
		exec(t, db, "ALTER TABLE "+relayTable(t, ob)+" DROP COLUMN last_error")
		if err := ob.Verify(context.Background()); err == nil || !strings.Contains(err.Error(), "last_error") {
			t.Errorf("Verify of an outbox table without last_error: %v, want the failing statement named", err)
		}
	})
}

// Metadata keys and values that are not valid UTF-8 (binary Kafka headers a
// handler copies onto its output) reach the broker byte for byte, beside
// metadata that is: they were refused with ErrOutboxMessage, and such a
// handler failed on every redelivery (encoding/json would have put U+FFFD in
// their place).
func TestOutboxRelaysMetadataThatIsNotUTF8Unchanged(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		broker := newBrokerStub()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker})
		binary := message.NewMessage(watermill.NewUUID(), []byte("payload"))
		binary.Metadata.Set("sig", "\xff\xfe\x00\x01")
		binary.Metadata.Set("k\xc3", "v")
		binary.Metadata.Set("note", "ünïcode ✓")
		binary.Metadata.Set("", "")
		plain := message.NewMessage(watermill.NewUUID(), []byte("payload"))
		plain.Metadata.Set("note", "[not an array]")
		tx, pub := beginOutbox(t, db, ob)
		if err := pub.Publish("orders", binary, plain); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		relayUntilEmpty(t, ob)
		got := broker.messages("orders")
		if len(got) != 2 || !reflect.DeepEqual(got[0].Metadata, binary.Metadata) || !reflect.DeepEqual(got[1].Metadata, plain.Metadata) {
			t.Errorf("sent %v, want the metadata byte for byte: %q and %q", got, binary.Metadata, plain.Metadata)
		}
	})
}

// A message whose payload is nil (a Kafka tombstone: compaction deletes its
// key) reaches the broker with a nil payload, and one whose payload is empty
// with an empty one, whatever its metadata: the payload column is NOT NULL,
// and the relay sent a tombstone as a record of 0 bytes, which compaction
// keeps as the key's value for good.
func TestOutboxRelaysANilPayloadAsNil(t *testing.T) {
	forEachDB(t, func(t *testing.T, tdb testDB, db *sqlx.DB) {
		broker := newBrokerStub()
		ob := newTestOutbox(t, db, tdb.Dialect, inbox.OutboxConfig{Publisher: broker})
		tombstone := message.NewMessage(watermill.NewUUID(), nil)
		tombstone.Metadata.Set("key", "customer-1")
		binaryTombstone := message.NewMessage(watermill.NewUUID(), nil)
		binaryTombstone.Metadata.Set("sig", "\xff\xfe")
		empty := message.NewMessage(watermill.NewUUID(), []byte{})
		empty.Metadata.Set("key", "customer-2")
		bare := message.NewMessage(watermill.NewUUID(), nil)
		tx, pub := beginOutbox(t, db, ob)
		if err := pub.Publish("customers", tombstone, binaryTombstone, empty, bare); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		relayUntilEmpty(t, ob)
		got := broker.messages("customers")
		if len(got) != 4 {
			t.Fatalf("sent %d messages, want 4", len(got))
		}
		for i, want := range []*message.Message{tombstone, binaryTombstone, empty, bare} {
			if got[i].UUID != want.UUID || (got[i].Payload == nil) != (want.Payload == nil) || len(got[i].Payload) != 0 ||
				!reflect.DeepEqual(got[i].Metadata, want.Metadata) {
				t.Errorf("message %d sent as %s, payload nil %v, metadata %q; want %s, payload nil %v, metadata %q", i,
					got[i].UUID, got[i].Payload == nil, got[i].Metadata, want.UUID, want.Payload == nil, want.Metadata)
			}
		}
	})
}

// An outbox table whose id sequence caches several values per session
// (ALTER TABLE … ALTER COLUMN id SET CACHE 20, a tuning for tables that
// take many inserts) is refused, with the statement that fixes it: each
// pooled connection drew ids from a range of its own, so one writer's later
// transaction took a smaller id than its earlier one, and the relay, which
// sends in id order, sent them the other way round.
func TestOutboxVerifyRefusesAnIDSequenceThatCachesValuesPerSession(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	ob := newTestOutbox(t, db, inbox.PostgreSQL, inbox.OutboxConfig{Publisher: newBrokerStub()})
	table := relayTable(t, ob)
	exec(t, db, "ALTER TABLE "+table+" ALTER COLUMN id SET CACHE 20")
	err := ob.Verify(context.Background())
	if !errors.Is(err, inbox.ErrIncompatibleTable) || !strings.Contains(err.Error(), "SET CACHE 1") {
		t.Fatalf("Verify of an outbox whose id sequence caches 20 values: %v, want ErrIncompatibleTable with the fix", err)
	}
	exec(t, db, "ALTER TABLE "+table+" ALTER COLUMN id SET CACHE 1")
	if err := ob.Verify(context.Background()); err != nil {
		t.Fatalf("Verify after the fix: %v", err)
	}
}
