package mysqloutbox_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox/internal/testdb"
)

// BenchmarkPublish measures what the Lock costs publishing transactions
// (BEGIN, one v4 outbox insert, COMMIT) on MariaDB at 1 and 16 in flight,
// without and with the Lock. Compare the msgs/s ratios within one run; the
// machine's load varies between runs.
func BenchmarkPublish(b *testing.B) {
	db := testdb.OpenMySQL(b, "")
	db.SetMaxOpenConns(20)
	lock := newLock(b, db.DB)
	r := relays[0] // v4 DefaultMySQLSchema
	topic := "bench_" + testdb.RandomSuffix()
	for _, table := range r.tables(topic) {
		dropLater(b, db.DB, table)
	}
	sub, initialize, err := r.subscriber(db.DB)
	if err != nil {
		b.Fatal(err)
	}
	defer sub.Close()
	if err := initialize(topic); err != nil {
		b.Fatal(err)
	}
	for _, inFlight := range []int{1, 16} {
		for _, locked := range []bool{false, true} {
			name := "no_lock"
			if locked {
				name = "lock"
			}
			b.Run(fmt.Sprintf("%s/in_flight=%d", name, inFlight), func(b *testing.B) {
				next := make(chan struct{})
				var wg sync.WaitGroup
				start := time.Now()
				for range inFlight {
					wg.Go(func() {
						for range next {
							tx, err := db.BeginTx(context.Background(), nil)
							if err != nil {
								b.Error(err)
								continue
							}
							pub, err := r.publisher(tx)
							if err == nil && locked {
								pub = lock.Publisher(tx, pub)
							}
							if err == nil {
								err = pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte(`{}`)))
							}
							if err == nil {
								err = tx.Commit()
							} else {
								_ = tx.Rollback()
							}
							if err != nil {
								b.Error(err)
							}
						}
					})
				}
				for b.Loop() {
					next <- struct{}{}
				}
				close(next)
				wg.Wait()
				b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "msgs/s")
			})
		}
	}
}
