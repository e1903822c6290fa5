-- database: relay (SQLite keeps the relay's tables in a file of their own: static/store/_migrations.py)
-- The relay's idempotency index in generations (docs/design.md §5; crates/relay/src/store/
-- sqlite.rs). Keys are SHA-256 digests, so a unique index on (channel_id, idempotency_key)
-- takes every publish to a random leaf: once that index outgrew SQLite's page cache, each
-- publish read a leaf and wrote it back to the WAL (measured: relay CPU per pipelined publish
-- 13 us at an empty log, 31.5 us at 400k entries). Leading with the generation (a run of
-- 16,384 entries, in log order) keeps the leaves a publish touches in one small, cached part
-- of the index; the relay finds a key of an older generation through in-memory filters.
-- Entries logged before this migration are generation 0.
ALTER TABLE relay_entries ADD COLUMN key_gen INTEGER NOT NULL DEFAULT 0;
DROP INDEX relay_entries_idempotency;
CREATE UNIQUE INDEX relay_entries_idempotency
    ON relay_entries (key_gen, channel_id, idempotency_key);
