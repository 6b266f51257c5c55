-- Inbox table for github.com/watermill-inbox/inbox (sqlite).
-- Primary key (consumer, message_id): the claim. Index on processed_at: the purge.
-- fingerprint: first 16 bytes of the SHA-256 of the content (Config.ReusedIDs), NULL matching any.
-- processed_at: Unix microseconds, UTC, from the database clock.

CREATE TABLE IF NOT EXISTS "watermill_inbox" (
    consumer     TEXT    NOT NULL,
    message_id   TEXT    NOT NULL,
    processed_at INTEGER NOT NULL,
    fingerprint  BLOB,
    PRIMARY KEY (consumer, message_id)
) WITHOUT ROWID;

CREATE INDEX IF NOT EXISTS "watermill_inbox_processed_at_idx" ON "watermill_inbox" (processed_at);
