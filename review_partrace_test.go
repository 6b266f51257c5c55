package inbox_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/inbox"
	"github.com/watermill-inbox/inbox/internal/testdb"
)

// Live claims while partitions are attached (two CreatePartitions at once)
// and old ones detached and dropped: no claim fails, none waits long, no
// message is processed twice.
func TestReviewPartitionMaintenanceUnderClaims(t *testing.T) {
	db := testdb.OpenPostgres(t, "")
	db.SetMaxOpenConns(16)
	table := "inbox_" + randomSuffix()
	t.Cleanup(func() { db.Exec("DROP TABLE IF EXISTS " + table + " CASCADE") })
	ib := newPartitionedInbox(t, db, table, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Second)
	defer cancel()
	var calls, errs atomic.Int64
	var maxLat atomic.Int64
	ids := make([]string, 200)
	for i := range ids {
		ids[i] = watermill.NewUUID()
	}
	h := ib.Middleware(func(*message.Message) ([]*message.Message, error) { calls.Add(1); return nil, nil })
	var wg sync.WaitGroup
	for w := range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ctx.Err() == nil; i++ {
				s := time.Now()
				if _, err := h(message.NewMessage(ids[(i*7+w)%len(ids)], nil)); err != nil {
					errs.Add(1)
					t.Log(err)
				}
				if d := int64(time.Since(s)); d > maxLat.Load() {
					maxLat.Store(d)
				}
			}
		}()
	}
	now := dbNow(t, db)
	for round := 0; ctx.Err() == nil; round++ {
		var mw sync.WaitGroup
		for range 2 {
			mw.Add(1)
			go func() {
				defer mw.Done()
				if err := inbox.CreatePartitions(context.Background(), db, table, now.AddDate(0, 0, -40+round%20), 5); err != nil {
					t.Errorf("create: %v", err)
				}
			}()
		}
		mw.Wait()
		if _, err := inbox.DropPartitions(context.Background(), db, table, 10*24*time.Hour, nil); err != nil {
			t.Errorf("drop: %v", err)
		}
	}
	wg.Wait()
	if errs.Load() != 0 || calls.Load() != int64(len(ids)) {
		t.Errorf("claim errors %d, handler calls %d for %d distinct messages", errs.Load(), calls.Load(), len(ids))
	}
	t.Logf("max claim latency %v, calls %d", time.Duration(maxLat.Load()), calls.Load())
}
