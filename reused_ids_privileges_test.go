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
// refuse to start with ErrInvalidConfig and the GRANT that fixes it, and
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
			if err := ib.Verify(t.Context()); !errors.Is(err, inbox.ErrInvalidConfig) || !strings.Contains(err.Error(), "GRANT SELECT (fingerprint)") {
				t.Errorf("Verify: %v, want ErrInvalidConfig with the GRANT that fixes it", err)
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

// MySQL/MariaDB hide from information_schema a column the user has no
// privilege on: with column GRANTs made before the fingerprint column was
// added, the inbox took the column for missing and turned the check off,
// in silence (an Info line saying the column was missing), and reused ids
// were skipped as duplicates. Verify refuses with ErrInvalidConfig and the
// GRANT that fixes it.
func TestFingerprintColumnHiddenFromTheUserIsReported(t *testing.T) {
	ctl := testdb.OpenMySQL(t, "")
	table := "inbox_colgrant_" + randomSuffix()
	dropLater(t, ctl, table)
	exec(t, ctl, "CREATE TABLE "+table+" (consumer varbinary(255) NOT NULL, message_id varbinary(255) NOT NULL,"+
		" processed_at datetime(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6), PRIMARY KEY (consumer, message_id), KEY (processed_at))")
	user := "inbox_cg_" + randomSuffix()
	exec(t, ctl, "CREATE USER '"+user+"'@'%'")
	t.Cleanup(func() { _, _ = ctl.Exec("DROP USER IF EXISTS '" + user + "'@'%'") })
	cols := "(consumer, message_id, processed_at)"
	exec(t, ctl, "GRANT SELECT "+cols+", INSERT "+cols+", UPDATE "+cols+" ON test."+table+" TO '"+user+"'@'%'")
	exec(t, ctl, inbox.AddFingerprintColumnSQL(inbox.MySQL, table))
	db, err := sqlx.Open("mysql", strings.Replace(testdb.MySQLDSN(), "root@", user+"@", 1))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	ib, err := inbox.New(inbox.Config{DB: db, Table: table})
	if err != nil {
		t.Fatal(err)
	}
	if err := ib.Verify(t.Context()); !errors.Is(err, inbox.ErrInvalidConfig) || !strings.Contains(err.Error(), "GRANT SELECT (fingerprint)") {
		t.Errorf("Verify with the fingerprint column hidden from the user: %v (ReusedIDsDetected %v); want ErrInvalidConfig with the GRANT",
			err, ib.ReusedIDsDetected())
	}
	exec(t, ctl, "GRANT SELECT (fingerprint), INSERT (fingerprint), UPDATE (fingerprint) ON test."+table+" TO '"+user+"'@'%'")
	if err := ib.Verify(t.Context()); err != nil || !ib.ReusedIDsDetected() {
		t.Errorf("Verify after the GRANT: %v, ReusedIDsDetected %v; want nil and the check on", err, ib.ReusedIDsDetected())
	}
}
