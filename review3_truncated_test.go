package inbox_test

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"testing"

	"github.com/watermill-inbox/inbox"
)

// TestReview3TruncatedPayloadNotTransient: io.ErrUnexpectedEOF is what
// json.Decoder and binary.Read return for a truncated payload, an error of
// the message that no redelivery fixes. As a bare value it was transient,
// so such a message escaped the README's poison queue and was redelivered
// forever. (A connection lost in a message's transaction is transient by
// its failed ROLLBACK, driver.ErrBadConn or the driver's own error.)
func TestReview3TruncatedPayloadNotTransient(t *testing.T) {
	t.Parallel()
	var order map[string]any
	jsonErr := json.NewDecoder(bytes.NewReader([]byte(`{"order": 4`))).Decode(&order)
	var amount uint64
	binErr := binary.Read(bytes.NewReader([]byte{0, 1, 2}), binary.BigEndian, &amount)
	for _, err := range []error{jsonErr, binErr} {
		if err == nil {
			t.Fatal("no error produced")
		}
		if inbox.IsTransient(fmt.Errorf("decode order: %w", err)) {
			t.Errorf("IsTransient(%T %v) = true, want false: the payload is truncated", err, err)
		}
	}
}
