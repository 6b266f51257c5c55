package bench

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the run if a goroutine is still running once every
// benchmark has ended: each must close what it started (routers, brokers,
// pools).
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// go-metrics, which sarama (watermill-kafka) uses, starts one global
		// goroutine for its meters on first use; it never ends by design.
		goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"),
		// Watermill's in-memory Deduplicator repository (the "deduplicator"
		// variant) cleans its map on a goroutine of context.Background() and
		// has no Close: it runs for the life of the process.
		goleak.IgnoreTopFunction("github.com/ThreeDotsLabs/watermill/message/router/middleware.(*mapExpiringKeyRepository).cleanOutLoop"),
	)
}
