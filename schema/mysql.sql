-- Inbox table for github.com/watermill-inbox/inbox (mysql).
-- Primary key (consumer, message_id): the claim. Index on processed_at: the purge.
-- fingerprint: first 16 bytes of the SHA-256 of the content (Config.ReusedIDs), NULL matching any.
-- varbinary, not varchar: MySQL and MariaDB collations fold case or trailing spaces
-- (PAD SPACE, even utf8mb4_bin), and message ids must compare byte for byte.
-- processed_at: UTC_TIMESTAMP(6), UTC whatever the session time zone.

CREATE TABLE IF NOT EXISTS `watermill_inbox` (
    consumer     varbinary(255) NOT NULL,
    message_id   varbinary(255) NOT NULL,
    processed_at datetime(6)    NOT NULL,
    fingerprint  varbinary(16)  NULL,
    PRIMARY KEY (consumer, message_id),
    INDEX `watermill_inbox_processed_at_idx` (processed_at)
) ENGINE=InnoDB;
