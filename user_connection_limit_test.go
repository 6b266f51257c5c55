package inbox_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// TestUserConnectionLimitIsNotPoisoned: the service's MariaDB user has a
// per-user connection limit (MAX_USER_CONNECTIONS; another instance of the
// service holds the connections for a moment). The message's BEGIN cannot get
// a connection: MariaDB error 1226 (ER_USER_LIMIT_REACHED; the global
// max_user_connections gives 1203, ER_TOO_MANY_USER_CONNECTIONS), the per-user
// twin of 1040 (too many connections) and of PostgreSQL's 53300 for a role's
// CONNECTION LIMIT, both transient. Nothing about the message is wrong: the
// nack must be transient, not poisoned.
func TestUserConnectionLimitIsNotPoisoned(t *testing.T) {
	ctl := testdb.OpenMySQL(t, "")
	user := "inbox_u_" + randomSuffix()
	exec(t, ctl, "CREATE USER '"+user+"'@'127.0.0.1' WITH MAX_USER_CONNECTIONS 1")
	t.Cleanup(func() { _, _ = ctl.Exec("DROP USER IF EXISTS '" + user + "'@'127.0.0.1'") })
	exec(t, ctl, "GRANT ALL ON test.* TO '"+user+"'@'127.0.0.1'")
	dsn := strings.Replace(testdb.MySQLDSN(), "root@", user+"@", 1)
	pool, err := sqlx.Open("mysql", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pool.Close() })
	pool.SetMaxOpenConns(1)
	d := &faultDB{dialect: inbox.MySQL, pool: pool, ctl: ctl}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var e *faultEnv
	e = newFaultEnv(t, d, inbox.Config{}, func(msg *message.Message, tx *sqlx.Tx, attempt int) error {
		return e.ledgerRow(msg, tx, attempt, false)
	})
	msgs := newMessages(2)
	if err := e.deliverUntilAcked(ctx, msgs[0], 1); err != nil { // warms up the inbox's startup checks
		t.Fatal(err)
	}
	// The service's pooled connection goes away; another instance takes the
	// user's only connection.
	pool.SetMaxIdleConns(0)
	userSessions := func() int {
		return count(t, ctl, "information_schema.PROCESSLIST", "USER = ?", user)
	}
	waitFor(t, func() bool { return userSessions() == 0 })
	other, err := sqlx.Open("mysql", dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	held, err := other.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pool.SetMaxIdleConns(2)
	d1, err := e.deliver(ctx, msgs[1], 1)
	if err != nil {
		t.Fatal(err)
	}
	held.Close()
	other.Close()
	waitFor(t, func() bool { return userSessions() == 0 })
	if err := e.deliverUntilAcked(ctx, msgs[1], 2); err != nil {
		t.Fatal(err)
	}
	t.Logf("first delivery: acked=%v err=%s", d1.acked, describeErr(d1.err))
	if d1.acked {
		t.Fatal("acked without a connection")
	}
	if !inbox.IsTransient(d1.err) {
		t.Errorf("per-user connection limit: nacked with a non-transient error (a poison filter !IsTransient takes the message): %s", describeErr(d1.err))
	}
	e.checkRows(ids(msgs))
}
