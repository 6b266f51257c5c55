// Package harness runs the data-layer bindings' tests: a fresh database per
// case (a schema on PostgreSQL, a database on MariaDB, a file on SQLite)
// holding the invoices table, a real Watermill router fed one message at a
// time, and the contract every binding must keep (Run).
package harness

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox/internal/testrouter"
)

// RunRouter starts a router (the shared internal/testrouter) with one
// handler, "billing" (hence the inbox consumer), that runs h
// with its middlewares already around it, closes the router when the test
// ends, and returns the handler's feed.
func RunRouter(t testing.TB, h message.HandlerFunc) *testrouter.Feed {
	t.Helper()
	feed, _ := testrouter.Run(t, func(msg *message.Message) error {
		_, err := h(msg)
		return err
	})
	return feed
}
