package inbox_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// columnGrantedPostgres makes an inbox table without the fingerprint column
// and a role granted what the inbox needs by column (a least-privilege
// DBA's GRANT SELECT (consumer, message_id, processed_at)), then adds the
// column as AddFingerprintColumnSQL says: a column-level GRANT made before
// does not cover the new column. With insertByTable the role's INSERT is
// table-wide (it covers the column), so that only its SELECT is missing.
// It returns the owner's pool, a pool whose sessions run as the role, and
// the table.
func columnGrantedPostgres(t *testing.T, insertByTable bool) (owner, role *sqlx.DB, table string) {
	owner = testdb.OpenPostgres(t, "")
	table = "inbox_colgrant_" + randomSuffix()
	dropLater(t, owner, table)
	exec(t, owner, "CREATE TABLE "+table+" (consumer text NOT NULL, message_id text NOT NULL,"+
		" processed_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (consumer, message_id))")
	exec(t, owner, "CREATE INDEX "+table+"_processed_at ON "+table+" (processed_at)")
	name := "inbox_colgrant_" + randomSuffix()
	exec(t, owner, "CREATE ROLE "+name+" NOLOGIN")
	t.Cleanup(func() {
		_, _ = owner.Exec("REVOKE ALL ON " + table + " FROM " + name)
		_, _ = owner.Exec("DROP ROLE " + name)
	})
	cols := "(consumer, message_id, processed_at)"
	if insertByTable {
		exec(t, owner, "GRANT INSERT, DELETE, SELECT "+cols+" ON "+table+" TO "+name)
	} else {
		exec(t, owner, "GRANT DELETE, SELECT "+cols+", INSERT "+cols+" ON "+table+" TO "+name)
	}
	exec(t, owner, inbox.AddFingerprintColumnSQL(inbox.PostgreSQL, table)) // the migration, then the restart
	return owner, testdb.OpenPostgres(t, "role="+name), table
}

// A fingerprint column the service's role may not read or write (column
// GRANTs made before it was added): Verify, and so Inbox.RouterPlugin,
// refuse to start with ErrIncompatibleTable and the GRANT that fixes it, and
// each message is nacked as transient, its handler not called, until it
// is granted. Verify passed before; then, with SELECT missing, every
// duplicate that read its stored fingerprint (a redelivery to another
// process) failed for good and went to the poison queue, and a reused id
// the same way, neither reported nor counted; with INSERT missing every
// claim failed.
func TestFingerprintColumnTheRoleMayNotUseIsReportedBeforeAnyClaim(t *testing.T) {
	for name, insertByTable := range map[string]bool{"select-missing": true, "select-and-insert-missing": false} {
		t.Run(name, func(t *testing.T) {
			owner, db, table := columnGrantedPostgres(t, insertByTable)
			ib, err := inbox.New(inbox.Config{DB: db, Table: table})
			if err != nil {
				t.Fatal(err)
			}
			if err := ib.Verify(t.Context()); !errors.Is(err, inbox.ErrIncompatibleTable) || !strings.Contains(err.Error(), "GRANT SELECT (fingerprint)") {
				t.Errorf("Verify: %v, want ErrIncompatibleTable with the GRANT that fixes it", err)
			}
			var calls int
			rec := &recorder{}
			in := newFeed()
			runRouter(t, func(r *message.Router) {
				r.AddMiddleware(rec.Middleware, ib.Middleware)
				r.AddConsumerHandler("billing", "orders", in, func(*message.Message) error { calls++; return nil })
			})
			msg := message.NewMessage(watermill.NewUUID(), []byte("order 1"))
			if acked := in.deliver(t, msg); acked || !inbox.IsTransient(rec.last()) || calls != 0 {
				t.Fatalf("a message while the role may not use the fingerprint column: acked %v, error %v, handler calls %d;"+
					" want a transient nack and no call", acked, rec.last(), calls)
			}
			exec(t, owner, "GRANT SELECT (fingerprint), INSERT (fingerprint) ON "+table+" TO "+roleOf(t, db))
			if !in.deliver(t, msg.Copy()) || calls != 1 {
				t.Fatalf("after the GRANT: %v, handler calls %d; want the message processed", rec.last(), calls)
			}
			if !ib.ReusedIDsDetected() {
				t.Error("after the GRANT the check is off")
			}
		})
	}
}

// roleOf returns the role the sessions of db run as.
func roleOf(t *testing.T, db *sqlx.DB) string {
	t.Helper()
	var role string
	if err := db.Get(&role, "SELECT current_user"); err != nil {
		t.Fatal(err)
	}
	return role
}

// A GRANT on the fingerprint column taken back while the inbox runs: the
// duplicate whose stored fingerprint the inbox reads (another process's:
// nothing remembered) is nacked as transient, not poisoned. It was not
// transient, and Inbox.Middlewares' default filter sent a processed
// message's redelivery to the poison queue.
func TestFingerprintReadRefusedForAPrivilegeIsTransient(t *testing.T) {
	owner, db, table := columnGrantedPostgres(t, true)
	role := roleOf(t, db)
	exec(t, owner, "GRANT SELECT (fingerprint) ON "+table+" TO "+role)
	consumer := func() (*feed, *poisonSink, *recorder) {
		ib, err := inbox.New(inbox.Config{DB: db, Table: table})
		if err != nil {
			t.Fatal(err)
		}
		if err := ib.Verify(t.Context()); err != nil {
			t.Fatal(err)
		}
		sink, rec := &poisonSink{}, &recorder{}
		mws, err := ib.Middlewares(inbox.MiddlewaresConfig{PoisonQueue: sink, Retry: middleware.Retry{MaxRetries: -1}})
		if err != nil {
			t.Fatal(err)
		}
		in := newFeed()
		runRouter(t, func(r *message.Router) {
			r.AddMiddleware(rec.Middleware)
			r.AddMiddleware(mws...)
			r.AddConsumerHandler("billing", "orders", in, func(*message.Message) error { return nil })
		})
		return in, sink, rec
	}
	first, _, _ := consumer()
	other, otherPoison, otherRec := consumer() // another process, resolved while it was granted
	msg := message.NewMessage(watermill.NewUUID(), []byte("order 1"))
	if !first.deliver(t, msg) {
		t.Fatal("first delivery nacked")
	}
	exec(t, owner, "REVOKE SELECT (fingerprint) ON "+table+" FROM "+role)
	other.deliver(t, msg.Copy())
	if p := otherPoison.poisoned(); len(p) > 0 {
		t.Errorf("the redelivery of a processed message, its fingerprint's read refused for a privilege, was poisoned: %s",
			p[0].Metadata.Get(middleware.ReasonForPoisonedKey))
	}
	if err := otherRec.last(); err != nil && !inbox.IsTransient(err) {
		t.Errorf("nacked with %v, want a transient error", err)
	}
}

// mysqlColumnGranted makes an inbox table, with the fingerprint column when
// withColumn, and a MySQL/MariaDB user granted grant on it, and returns a
// pool whose sessions run as that user, and the table.
func mysqlColumnGranted(t *testing.T, withColumn bool, grant string) (*sqlx.DB, string) {
	ctl := testdb.OpenMySQL(t, "")
	table := "inbox_colgrant_" + randomSuffix()
	dropLater(t, ctl, table)
	fingerprint := ""
	if withColumn {
		fingerprint = " fingerprint varbinary(16) NULL,"
	}
	exec(t, ctl, "CREATE TABLE "+table+" (consumer varbinary(255) NOT NULL, message_id varbinary(255) NOT NULL,"+
		" processed_at datetime(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),"+fingerprint+" PRIMARY KEY (consumer, message_id), KEY (processed_at))")
	user := "inbox_cg_" + randomSuffix()
	exec(t, ctl, "CREATE USER '"+user+"'@'%'")
	t.Cleanup(func() { _, _ = ctl.Exec("DROP USER IF EXISTS '" + user + "'@'%'") })
	exec(t, ctl, "GRANT "+grant+", DELETE ON test."+table+" TO '"+user+"'@'%'")
	db, err := sqlx.Open("mysql", strings.Replace(testdb.MySQLDSN(), "root@", user+"@", 1))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return db, table
}

// On MySQL/MariaDB a fingerprint column the user may use only in part (the
// claim's ON DUPLICATE KEY UPDATE reads and writes it: SELECT, INSERT and
// UPDATE) is visible in information_schema: Verify, and so
// Inbox.RouterPlugin, passed, and then every claim failed. Verify refuses it
// with ErrIncompatibleTable and the GRANT.
func TestFingerprintColumnPartlyGrantedOnMySQLIsRefusedByVerify(t *testing.T) {
	all, three := "(consumer, message_id, processed_at, fingerprint)", "(consumer, message_id, processed_at)"
	for name, grant := range map[string]string{
		"update-missing": "SELECT " + all + ", INSERT " + all + ", UPDATE " + three,
		"select-missing": "SELECT " + three + ", INSERT " + all + ", UPDATE " + all,
	} {
		t.Run(name, func(t *testing.T) {
			db, table := mysqlColumnGranted(t, true, grant)
			ib, err := inbox.New(inbox.Config{DB: db, Table: table})
			if err != nil {
				t.Fatal(err)
			}
			if err := ib.Verify(t.Context()); !errors.Is(err, inbox.ErrIncompatibleTable) || !strings.Contains(err.Error(), "UPDATE (fingerprint)") {
				t.Errorf("Verify with the fingerprint column partly granted (%s): %v; want ErrIncompatibleTable with the GRANT", grant, err)
			}
		})
	}
}

// MySQL/MariaDB refuse a read of a column that does not exist, to a user
// granted by column, as one of a column the user has no privilege on
// (1143): a table without the fingerprint column, of a user granted by
// column, works with the check off, as every table without the column
// does. (Taking that refusal for a hidden column refused every message.)
func TestTableWithoutFingerprintColumnOfAColumnGrantedMySQLUserWorks(t *testing.T) {
	cols := "(consumer, message_id, processed_at)"
	db, table := mysqlColumnGranted(t, false, "SELECT "+cols+", INSERT "+cols+", UPDATE "+cols)
	ib, err := inbox.New(inbox.Config{DB: db, Table: table})
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.Verify(t.Context()); err != nil || ib.ReusedIDsDetected() {
		t.Errorf("Verify of a table without the fingerprint column: %v, ReusedIDsDetected %v; want nil, the check off", err, ib.ReusedIDsDetected())
	}
	var calls int
	rec := &recorder{}
	in := newFeed()
	runRouter(t, func(r *message.Router) {
		r.AddMiddleware(rec.Middleware, ib.Middleware)
		r.AddConsumerHandler("billing", "orders", in, func(*message.Message) error { calls++; return nil })
	})
	if acked := in.deliver(t, message.NewMessage(watermill.NewUUID(), []byte("order 1"))); !acked || calls != 1 {
		t.Errorf("a message: acked %v (%v), handler calls %d; want it processed", acked, rec.last(), calls)
	}
}
