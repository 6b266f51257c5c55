-- Inbox table for github.com/watermill-inbox/inbox (postgres-partitioned).
-- fingerprint: first 16 bytes of the SHA-256 of the content (Config.ReusedIDs), NULL matching any.
-- Range-partitioned on processed_at, by ISO week (Monday 00:00 UTC) unless the table's partitions
-- say otherwise (see PartitionInterval); partitions are created ahead by InitializeSchema /
-- CreatePartitions (or a Purger) and dropped by DropPartitions.
-- The primary key must include the partition key, so it guards one partition only:
-- the claim serialises each key with pg_advisory_xact_lock and checks every partition,
-- both in one call of the function "watermill_inbox_claim" (without it, in two statements).
-- Partition of one week: CREATE TABLE "watermill_inbox_w20261130" PARTITION OF "watermill_inbox"
--   FOR VALUES FROM ('2026-11-30 00:00:00Z') TO ('2026-12-07 00:00:00Z');
-- (daily partitions are named watermill_inbox_pYYYYMMDD and cover one UTC day.)

CREATE TABLE IF NOT EXISTS "watermill_inbox" (
    consumer     text        NOT NULL,
    message_id   text        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    fingerprint  bytea,
    PRIMARY KEY (consumer, message_id, processed_at)
) PARTITION BY RANGE (processed_at);

CREATE OR REPLACE FUNCTION "watermill_inbox_claim"(text, text, bigint) RETURNS boolean
    LANGUAGE plpgsql VOLATILE AS $$BEGIN PERFORM pg_advisory_xact_lock($3); INSERT INTO "watermill_inbox" (consumer, message_id, processed_at) SELECT $1, $2, now() WHERE NOT EXISTS (SELECT 1 FROM "watermill_inbox" WHERE consumer = $1 AND message_id = $2); RETURN FOUND; END$$;

CREATE OR REPLACE FUNCTION "watermill_inbox_claim"(text, text, bigint, bytea) RETURNS boolean
    LANGUAGE plpgsql VOLATILE AS $$BEGIN PERFORM pg_advisory_xact_lock($3); INSERT INTO "watermill_inbox" (consumer, message_id, processed_at, fingerprint) SELECT $1, $2, now(), $4 WHERE NOT EXISTS (SELECT 1 FROM "watermill_inbox" WHERE consumer = $1 AND message_id = $2); RETURN FOUND; END$$;
