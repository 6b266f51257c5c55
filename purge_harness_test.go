package inbox_test

// Inbox rows of a chosen age, a fixed safe window, and a probe of the purge
// lock.

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/watermill-inbox/inbox"
)

// fixedWindow is a WindowSource that reports a fixed safe window.
type fixedWindow time.Duration

func (w fixedWindow) SafeWindow(context.Context) (time.Duration, error) { return time.Duration(w), nil }

// agoSQL returns an SQL expression for "the database's now minus d", in the
// representation of processed_at.
func agoSQL(d inbox.Dialect, ago time.Duration) string {
	us := ago.Microseconds()
	switch d {
	case inbox.PostgreSQL, inbox.PostgreSQLPartitioned:
		return fmt.Sprintf("now() - interval '%d microseconds'", us)
	case inbox.MySQL:
		return fmt.Sprintf("UTC_TIMESTAMP(6) - INTERVAL %d MICROSECOND", us)
	default:
		return fmt.Sprintf("CAST(unixepoch('subsec') * 1000000 AS INTEGER) - %d", us)
	}
}

// insertRows adds n inbox rows for consumer, processed ago before now by the
// database clock, in one statement per 500 rows.
func insertRows(t *testing.T, db *sqlx.DB, d inbox.Dialect, table, consumer, prefix string, n int, ago time.Duration) {
	t.Helper()
	for start := 0; start < n; start += 500 {
		var values []string
		for i := start; i < min(n, start+500); i++ {
			values = append(values, fmt.Sprintf("('%s', '%s-%d', %s)", consumer, prefix, i, agoSQL(d, ago)))
		}
		exec(t, db, "INSERT INTO "+table+" (consumer, message_id, processed_at) VALUES "+strings.Join(values, ", "))
	}
}

// lockFree reports whether another instance could take the purge lock of
// table now (taking and releasing it on a probe connection).
// eventuallyLockFree polls lockFree for up to 10 s.
func eventuallyLockFree(t *testing.T, probe *sqlx.DB, d inbox.Dialect, table string) bool {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if lockFree(t, probe, d, table) {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func lockFree(t *testing.T, probe *sqlx.DB, d inbox.Dialect, table string) bool {
	t.Helper()
	p, err := inbox.NewPurger(inbox.PurgerConfig{Purge: inbox.PurgeConfig{DB: probe, Dialect: d, Table: table, OlderThan: time.Hour}})
	if err != nil {
		t.Fatal(err)
	}
	release, got, err := inbox.PurgeLock(context.Background(), probe, p)
	if err != nil {
		t.Fatal(err)
	}
	if got {
		if err := release(); err != nil {
			t.Fatal(err)
		}
	}
	return got
}
