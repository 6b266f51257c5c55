package main

import (
	"context"
	"os"
	"testing"
	"time"
)

// Both inboxes under Watermill's CQRS component: each order is invoiced
// once; each InvoiceIssued goes through the outbox relay (the relay reports
// both sent, the outbox ends empty with no dead letter) and reaches the
// broker's subscriber once, the one whose first try failed included; and
// the consumer is the event handler's name (Result.Check).
func TestCQRS_EachOrderIsInvoicedOnceAndItsEventIsRelayedOnce(t *testing.T) {
	dsn := envOr("INBOX_TEST_POSTGRES_DSN", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
	for _, kind := range []string{"database/sql", "pgx"} {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			r, err := run(ctx, kind, dsn)
			if err != nil {
				if os.Getenv("CI") != "true" && isUnreachable(err) {
					t.Skipf("PostgreSQL not reachable (%v): start it or set INBOX_TEST_POSTGRES_DSN", err)
				}
				t.Fatal(err)
			}
			if err := r.Check(); err != nil {
				t.Fatal(err)
			}
		})
	}
}
