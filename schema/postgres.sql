-- Inbox table for github.com/watermill-inbox/inbox (postgres).
-- Primary key (consumer, message_id): the claim. Index on processed_at: the purge.
-- fingerprint: first 16 bytes of the SHA-256 of the content (Config.ReusedIDs), NULL matching any.
-- processed_at: the database clock (now()), an absolute instant.

CREATE TABLE IF NOT EXISTS "watermill_inbox" (
    consumer     text        NOT NULL,
    message_id   text        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    fingerprint  bytea,
    PRIMARY KEY (consumer, message_id)
);

CREATE INDEX IF NOT EXISTS "watermill_inbox_processed_at_idx" ON "watermill_inbox" (processed_at);
