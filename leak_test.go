package inbox_test

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/watermill-inbox/inbox/internal/testdb"
)

// TestMain fails the run if a goroutine is still running once every test
// has ended: each test must close what it started (routers, pub/subs,
// pools, purgers). First it drops the claim functions that earlier runs'
// partitioned tables left behind.
func TestMain(m *testing.M) {
	testdb.DropOrphanClaimFunctions()
	goleak.VerifyTestMain(m,
		// Watermill v1.5.1: Router.Close after a Run that failed (a plugin
		// returned an error) waits for handlers that never started; the two
		// goroutines it waits with never end. A Close that times out on a
		// router that did run is reported by runRouter instead.
		goleak.IgnoreAnyFunction("github.com/ThreeDotsLabs/watermill/message.(*Router).waitForHandlers.func1"),
		goleak.IgnoreAnyFunction("github.com/ThreeDotsLabs/watermill/pubsub/sync.WaitGroupTimeout.func1"),
		// go-metrics, which sarama uses, starts one global goroutine for its
		// meters on first use; it never ends by design.
		goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"),
		// sarama's circuit breaker (go-resiliency) sleeps out its timeout in
		// a goroutine of its own after failed produce requests, even once
		// the producer is closed; it ends by itself
		// (TestKafkaPoisonQueueNeedsItsTopic's missing topic).
		goleak.IgnoreAnyFunction("github.com/eapache/go-resiliency/breaker.(*Breaker).timer"),
	)
}
