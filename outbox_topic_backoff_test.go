package inbox

import (
	"fmt"
	"testing"
	"time"
)

// A refused topic that a round found gone (its rows held by another relay
// instance, sent by it, or deleted) keeps its wait for a while: refused
// again soon, it goes on doubling from there, so that two instances do not
// restart each other's waits at 50 ms; refused again later, it starts from
// 50 ms, as docs/outbox.md says. And what is kept goes after that while, so
// that one topic per tenant does not grow the memory for good.
func TestForgottenTopicWaitsAreKeptForAWhileOnly(t *testing.T) {
	t.Run("refused soon after: keeps doubling", func(t *testing.T) {
		b := &topicBackoff{max: 5 * time.Second, waits: map[string]topicWait{}}
		for range 10 {
			b.refused("t", time.Now())
		}
		b.forgetAllBut(nil, nil)
		b.refused("t", time.Now())
		if w := b.waits["t"].wait; w != b.max {
			t.Errorf("refused right after it was forgotten at MaxBackoff: waits %v, want %v", w, b.max)
		}
	})
	t.Run("refused much later: from the first wait", func(t *testing.T) {
		b := &topicBackoff{max: 5 * time.Second, waits: map[string]topicWait{}}
		for range 10 {
			b.refused("t", time.Now())
		}
		b.forgetAllBut(nil, nil)
		b.refused("t", time.Now().Add(time.Hour))
		if w := b.waits["t"].wait; w != outboxRetryFirst {
			t.Errorf("refused an hour after it was forgotten: waits %v, want %v", w, outboxRetryFirst)
		}
	})
	t.Run("what is kept goes", func(t *testing.T) {
		b := &topicBackoff{max: 10 * time.Millisecond, waits: map[string]topicWait{}}
		for i := range 1000 {
			b.refused(fmt.Sprintf("tenant-%d", i), time.Now())
		}
		b.forgetAllBut(nil, nil)
		if len(b.waits) != 0 || len(b.forgotten) != 1000 {
			t.Fatalf("%d waits and %d forgotten right after, want 0 and 1000", len(b.waits), len(b.forgotten))
		}
		time.Sleep(3 * b.max)
		b.forgetAllBut(nil, nil)
		if len(b.forgotten) != 0 {
			t.Errorf("%d forgotten topics kept after 3 MaxBackoffs, want none", len(b.forgotten))
		}
	})
}
