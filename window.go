package inbox

import (
	"context"
	"fmt"
	"time"
)

// FixedWindow is a WindowSource that reports itself as the safe window: the
// window you state for a broker whose redelivery horizon cannot be read from
// its configuration (RabbitMQ classic and quorum queues, whose consumers never
// see an acked message again, so that the window is the longest a message can
// stay unacked and come back; a producer's retry horizon; see
// docs/brokers.md). Plugged into PurgeConfig.Window (or DropPartitions), a
// purge asked for a shorter OlderThan is refused with ErrWindowTooShort and a
// zero OlderThan takes the fixed window:
//
//	inbox.Purge(ctx, inbox.PurgeConfig{DB: db, Window: inbox.FixedWindow(72 * time.Hour)})
//
// A FixedWindow that is not positive reports an error wrapping
// ErrInvalidConfig, which stops the purge before anything is deleted (a zero
// window would otherwise delete rows processed a moment ago); one above
// MaxSafeWindow (100 years) stops it with ErrWindowOutOfRange. The value is
// never changed, so it is safe for concurrent use. For brokers whose window
// can be read, the kafkaretention and jetstreamretention packages ask the
// broker at every purge instead.
type FixedWindow time.Duration

var _ WindowSource = FixedWindow(0)

// SafeWindow returns w as a duration, or an error wrapping ErrInvalidConfig
// when w is zero or negative. It implements WindowSource.
func (w FixedWindow) SafeWindow(context.Context) (time.Duration, error) {
	if w <= 0 {
		return 0, fmt.Errorf("%w: FixedWindow must be positive, got %v", ErrInvalidConfig, time.Duration(w))
	}
	return time.Duration(w), nil
}
