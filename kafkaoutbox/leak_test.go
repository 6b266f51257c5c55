package kafkaoutbox_test

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the run if a goroutine is still running once every test
// has ended: each test must close what it started (routers, producers,
// subscribers).
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// go-metrics, which sarama uses, starts one global goroutine for its
		// meters on first use; it never ends by design.
		goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"),
		// sarama's circuit breaker (go-resiliency) sleeps out its timeout
		// in a goroutine of its own after failed produce requests, even
		// once the producer is closed; it ends by itself.
		// Its top frame is time.Sleep while it waits.
		goleak.IgnoreAnyFunction("github.com/eapache/go-resiliency/breaker.(*Breaker).timer"),
	)
}
