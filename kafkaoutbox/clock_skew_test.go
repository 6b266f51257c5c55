package kafkaoutbox_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// The relay host's clock runs two hours ahead of the broker's (NTP down, a
// VM resumed), past the topic's message.timestamp.after.max.ms: the broker
// refuses every record, whose timestamp sarama took from that clock
// (kafka.DefaultMarshaler sets none). That is the clock's state, not the
// messages': nothing is set aside, and once the clock is right every
// message reaches the topic. INVALID_TIMESTAMP was the message's own
// refusal, and every pending output went to the dead-letter table within
// MaxAttempts rounds.
func TestRelayHostClockSkewSetsNothingAside(t *testing.T) {
	var skew atomic.Int64 // how far this host's clock runs ahead of the broker's
	skew.Store(int64(2 * time.Hour))
	c := controlledCluster(t, 1, func(_ *kfake.Cluster, req *kmsg.ProduceRequest) kmsg.Response {
		limit := time.Now().Add(time.Hour - time.Duration(skew.Load())).UnixMilli() // the broker's clock + 1 h, seen from here
		for _, tp := range req.Topics {
			for _, p := range tp.Partitions {
				var batch kmsg.RecordBatch
				if batch.ReadFrom(p.Records) == nil && batch.MaxTimestamp > limit {
					return produceError(req, kerr.InvalidTimestamp.Code)
				}
			}
		}
		return nil
	}, "invoices")
	db, ob := newFailFastRelay(t, c.ListenAddrs()) // MaxAttempts 2
	msgs, want := customerInvoices(6)
	writeOutputs(t, db, ob, "invoices", msgs...)
	for range 4 {
		ob.RelayOnce(context.Background())
	}
	skew.Store(0) // the clock is right again
	waitForRelayed(t, ob)
	if s, err := ob.Stats(context.Background()); err != nil || s.DeadLettered != 0 {
		t.Fatalf("%d of %d messages set aside in the dead-letter table because this host's clock ran ahead (%v)",
			s.DeadLettered, len(msgs), err)
	}
	collectAll(t, c.ListenAddrs(), "invoices", want)
}
