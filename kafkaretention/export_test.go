package kafkaretention

import "time"

// SetClock sets the clock s measures how long it remembers a longer window
// by (Source.remembered).
func SetClock(s *Source, now func() time.Time) { s.now = now }
