package inbox

import "time"

// hooks are the test seams of an Inbox or a purge: points in the flow where
// a test (through export_test.go) runs a function of its own, to make a race
// happen at an exact moment. A nil *hooks, and every nil field, does
// nothing; nothing outside the tests sets them.
type hooks struct {
	// afterBegin runs right after a message's BEGIN, before the
	// transaction's first statement (the key lock, the claim).
	afterBegin func()
	// afterPurgeSelect runs between a MySQL purge batch's read of its keys
	// and its DELETE.
	afterPurgeSelect func()
	// beforePurgeBatch runs at the start of each purge batch, within the
	// batch's measured duration but before its transaction begins.
	beforePurgeBatch func()
	// onPurgePause runs after each full purge batch with the batch's
	// duration and the pause the pacing chose (0: none), before the pause.
	onPurgePause func(batch, pause time.Duration)
	// onTableBackoff runs when a delivery that met a missing or
	// incompatible table starts its wait, with the wait.
	onTableBackoff func(wait time.Duration)
}

// begun runs afterBegin, if set.
func (h *hooks) begun() {
	if h != nil && h.afterBegin != nil {
		h.afterBegin()
	}
}

// purgeKeysRead runs afterPurgeSelect, if set.
func (h *hooks) purgeKeysRead() {
	if h != nil && h.afterPurgeSelect != nil {
		h.afterPurgeSelect()
	}
}

// purgeBatchStarting runs beforePurgeBatch, if set.
func (h *hooks) purgeBatchStarting() {
	if h != nil && h.beforePurgeBatch != nil {
		h.beforePurgeBatch()
	}
}

// purgePausing runs onPurgePause, if set.
func (h *hooks) purgePausing(batch, pause time.Duration) {
	if h != nil && h.onPurgePause != nil {
		h.onPurgePause(batch, pause)
	}
}

// tableBackoff runs onTableBackoff, if set.
func (h *hooks) tableBackoff(wait time.Duration) {
	if h != nil && h.onTableBackoff != nil {
		h.onTableBackoff(wait)
	}
}
