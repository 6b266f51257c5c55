package mysqloutbox

// SlotOf exposes a topic's lock row to the tests.
func SlotOf(l *Lock, topic string) int { return l.slot(topic) }
