package jetstreamretention_test

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the run if a goroutine is still running once every test
// has ended: each test must close what it started (connections, routers).
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
