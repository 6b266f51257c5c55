package inbox

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
