package sqliteoutboxv4_test

import (
	"fmt"
	"os"
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the run if a goroutine is still running once every test
// has ended: each test must close what it started (publishers, subscribers,
// forwarders, pools).
func TestMain(m *testing.M) {
	code := m.Run()
	if code == 0 {
		if err := goleak.Find(
			// Watermill's universal suite (TestConsumerGroups) wraps our
			// subscribers in its multiplier and stops reading its output
			// when the test ends: a forwarding goroutine holding a message
			// blocks on that channel for good, and so does the one waiting
			// for it. Our subscribers themselves are closed.
			goleak.IgnoreAnyFunction("github.com/ThreeDotsLabs/watermill/internal/subscriber.(*multiplier).Subscribe.func2"),
			goleak.IgnoreAnyFunction("github.com/ThreeDotsLabs/watermill/internal/subscriber.(*multiplier).Subscribe.func3"),
		); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: errors on successful test run: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}
