package inbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// TestIdleSessionTimeoutIsNotPoisoned: the server closes an idle pooled
// session (idle_session_timeout, SQLSTATE 57P05, PostgreSQL 14+). The next
// message's BEGIN meets the closed session and pgx's stdlib returns the
// server's FATAL error as it is (lib/pq turns it into driver.ErrBadConn, which
// database/sql retries). Nothing about the message is wrong: its nack must be
// transient (not poisoned), as 57P01 is.
//
// SubSecondTimeout: pgx's stdlib pings a connection idle for more than 1 s,
// so the timeout is 300 ms. NoPing: the stdlib's OptionShouldPing turned off
// (to save the round trip per checkout), with a 1 s timeout.
func TestIdleSessionTimeoutIsNotPoisoned(t *testing.T) {
	for _, tc := range []struct {
		name    string
		timeout string
		idle    time.Duration
		noPing  bool
	}{
		{"SubSecondTimeout", "300", 600 * time.Millisecond, false},
		{"NoPing", "1000", 1500 * time.Millisecond, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var d *faultDB
			if tc.noPing {
				testdb.OpenPostgres(t, "") // skips without a server
				cfg, err := pgx.ParseConfig(testdb.WithParam(testdb.PostgresDSN(), "idle_session_timeout="+tc.timeout))
				if err != nil {
					t.Fatal(err)
				}
				db := sqlx.NewDb(stdlib.OpenDB(*cfg, stdlib.OptionShouldPing(func(context.Context, stdlib.ShouldPingParams) bool { return false })), "pgx")
				t.Cleanup(func() { db.Close() })
				d = &faultDB{dialect: inbox.PostgreSQL, pool: db, ctl: testdb.OpenPostgres(t, "")}
			} else {
				d = openFaultDB(t, "postgres", "idle_session_timeout="+tc.timeout)
			}
			d.pool.SetMaxOpenConns(1)
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			var e *faultEnv
			e = newFaultEnv(t, d, inbox.Config{}, func(msg *message.Message, tx *sqlx.Tx, attempt int) error {
				return e.ledgerRow(msg, tx, attempt, false)
			})
			msgs := newMessages(3)
			for _, msg := range msgs {
				time.Sleep(tc.idle) // the pooled session sits idle past the server's timeout
				if err := e.deliverUntilAcked(ctx, msg, 1); err != nil {
					t.Fatal(err)
				}
			}
			for _, n := range e.nacks() {
				t.Logf("nack of %s attempt %d: %s (IsTransient=%v)", n.id, n.attempt, describeErr(n.err), inbox.IsTransient(n.err))
				if !inbox.IsTransient(n.err) {
					t.Errorf("message %s attempt %d nacked with a non-transient error (a poison filter !IsTransient takes it): %s", n.id, n.attempt, describeErr(n.err))
				}
			}
			e.checkExactlyOnce(ids(msgs))
		})
	}
}
