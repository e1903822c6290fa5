-- database: relay (SQLite keeps the relay's tables in a file of their own: static/store/_migrations.py)
-- Departures kept apart from bindings (docs/design.md §5.2; crates/relay/src/store/). A removed
-- leaf's row in relay_members kept its account's right to read up to the commit that removed
-- it, but only until a later member took that leaf index and bound it: the BIND upsert then
-- overwrote the row, and after an unload or restart the departed account read nothing at all.
-- Now a commit that removes a leaf deletes its binding and records the departure here, one row
-- per account and channel (its last removal: the leaf and the commit's seq), which no later
-- binding touches.
--
-- Existing removed rows move here (per account, its latest removal). A departure that an
-- earlier binding already overwrote is gone and cannot be recovered: that account stays
-- without access, as it was before this migration.
CREATE TABLE relay_departures (
    channel_id BIGINT NOT NULL REFERENCES relay_channels (id),
    account TEXT NOT NULL,
    leaf_index INTEGER NOT NULL,
    removed_seq BIGINT NOT NULL,
    PRIMARY KEY (channel_id, account)
);
INSERT INTO relay_departures (channel_id, account, leaf_index, removed_seq)
    SELECT DISTINCT ON (channel_id, account) channel_id, account, leaf_index, removed_seq
    FROM relay_members WHERE removed_seq IS NOT NULL
    ORDER BY channel_id, account, removed_seq DESC;
DELETE FROM relay_members WHERE removed_seq IS NOT NULL;
