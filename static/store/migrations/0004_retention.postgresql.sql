-- database: relay (SQLite keeps the relay's tables in a file of their own: static/store/_migrations.py)
-- Retention (docs/design.md §5.3; read and written by the Rust relay, crates/relay/src/store/):
-- per-channel policies, the pruned horizon, the time each entry was appended and the life of
-- each Welcome.
--
-- A channel's own policy, per limit: NULL follows the server's default, 0 is no limit.
-- `horizon_seq` is the last seq pruned: the log holds horizon_seq + 1 .. head_seq.
ALTER TABLE relay_channels ADD COLUMN horizon_seq BIGINT NOT NULL DEFAULT 0;
ALTER TABLE relay_channels ADD COLUMN retention_max_age BIGINT;
ALTER TABLE relay_channels ADD COLUMN retention_max_entries BIGINT;
ALTER TABLE relay_channels ADD COLUMN retention_max_bytes BIGINT;

-- When the relay appended each entry (unix ms). Entries logged before this migration have 0:
-- an age limit counts them as the oldest (a constant default: no table rewrite).
ALTER TABLE relay_entries ADD COLUMN appended_at BIGINT NOT NULL DEFAULT 0;

-- When each Welcome was stored and when its last joiner bound its leaf (unix ms). Existing
-- Welcomes start their life now.
ALTER TABLE relay_welcomes ADD COLUMN created_at BIGINT NOT NULL DEFAULT 0;
ALTER TABLE relay_welcomes ADD COLUMN used_at BIGINT;
UPDATE relay_welcomes SET created_at = (extract(epoch FROM now()) * 1000)::bigint;
CREATE INDEX relay_welcomes_created ON relay_welcomes (created_at);
CREATE INDEX relay_welcomes_used ON relay_welcomes (used_at);
CREATE INDEX relay_welcome_refs_digest ON relay_welcome_refs (channel_id, digest);

-- The leaves a Welcome's commit added and whose binding is awaited: once none is left, the
-- Welcome is used.
CREATE TABLE relay_welcome_leaves (
    channel_id BIGINT NOT NULL REFERENCES relay_channels (id),
    leaf_index INTEGER NOT NULL,
    digest BYTEA NOT NULL,
    PRIMARY KEY (channel_id, leaf_index)
);
CREATE INDEX relay_welcome_leaves_digest ON relay_welcome_leaves (channel_id, digest);
