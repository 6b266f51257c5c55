-- Inbox table for github.com/watermill-inbox/inbox (sqlite).
-- Primary key (consumer, message_id): the claim. Index on processed_at: the purge.
-- processed_at: Unix microseconds, UTC, from the database clock.

CREATE TABLE IF NOT EXISTS "watermill_inbox" (
    consumer     TEXT    NOT NULL,
    message_id   TEXT    NOT NULL,
    processed_at INTEGER NOT NULL,
    PRIMARY KEY (consumer, message_id)
) WITHOUT ROWID;

CREATE INDEX IF NOT EXISTS "watermill_inbox_processed_at_idx" ON "watermill_inbox" (processed_at);
