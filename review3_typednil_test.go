package inbox_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/watermill-inbox/inbox"
)

// sqlStateError is a driver error type with a pointer receiver, as pgx's
// *pgconn.PgError is.
type sqlStateError struct{ code string }

func (e *sqlStateError) Error() string    { return "sqlstate " + e.code }
func (e *sqlStateError) SQLState() string { return e.code }

type retryError struct{ safe bool }

func (e *retryError) Error() string     { return "retry" }
func (e *retryError) SafeToRetry() bool { return e.safe }

// TestReview3TransientTypedNil: a typed nil pointer in the chain (the
// classic "var pe *pgconn.PgError; return pe") must not make IsTransient
// panic: it runs inside the poison queue's filter, where a panic turns
// every message into a panic.
func TestReview3TransientTypedNil(t *testing.T) {
	t.Parallel()
	for _, err := range []error{
		(*sqlStateError)(nil),
		fmt.Errorf("claim: %w", (*sqlStateError)(nil)),
		errors.Join(errors.New("x"), (*sqlStateError)(nil)),
		(*retryError)(nil),
		fmt.Errorf("commit: %w", (*retryError)(nil)),
	} {
		func() {
			defer func() {
				if r := recover(); r != nil {
					t.Errorf("IsTransient(%#v) panicked: %v", err, r)
				}
			}()
			if inbox.IsTransient(err) {
				t.Errorf("IsTransient(%#v) = true, want false", err)
			}
		}()
	}
	// Non-nil values still count.
	if !inbox.IsTransient(fmt.Errorf("x: %w", &sqlStateError{"40001"})) || !inbox.IsTransient(&retryError{true}) {
		t.Error("non-nil transient errors not recognised")
	}
}
