//go:build unix

package brokers

import (
	"os"
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the run if a goroutine is still running once every test
// has ended, in the parent. A worker process (the test binary re-run with
// workerEnv set) is checked by the parent instead: a clean exit with no
// connection in use.
func TestMain(m *testing.M) {
	if os.Getenv(workerEnv) != "" {
		os.Exit(m.Run())
	}
	goleak.VerifyTestMain(m)
}
