package inbox

// Table returns the outbox table's name as configured: OutboxConfig.Table,
// or DefaultOutboxTable when that was empty. The metrics module labels the
// outbox's series with it. Safe for concurrent use.
func (o *Outbox) Table() string { return o.cfg.Table }
