-- database: relay (SQLite keeps the relay's tables in a file of their own: static/store/_migrations.py)
-- The relay's channel logs (read and written by the Rust relay: crates/relay/src/store/postgres.rs;
-- created here, by the Python store's migrations). Channels are unique per scope: the
-- account that created them, or '' for anonymous callers.
CREATE TABLE relay_channels (
    id BIGSERIAL PRIMARY KEY,
    scope TEXT NOT NULL,
    name TEXT NOT NULL,
    epoch BIGINT NOT NULL DEFAULT 0,
    head_seq BIGINT NOT NULL DEFAULT 0,
    created_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP,
    UNIQUE (scope, name)
);

-- The append-only log: gap-free seq per channel.
CREATE TABLE relay_entries (
    channel_id BIGINT NOT NULL REFERENCES relay_channels (id),
    seq BIGINT NOT NULL,
    epoch BIGINT NOT NULL,
    content_type SMALLINT NOT NULL,
    channel_epoch BIGINT NOT NULL,
    idempotency_key BYTEA NOT NULL,
    message BYTEA NOT NULL,
    PRIMARY KEY (channel_id, seq)
);
CREATE UNIQUE INDEX relay_entries_idempotency ON relay_entries (channel_id, idempotency_key);

-- Where each epoch starts: the seq of the commit that created it (0 for epoch 0).
CREATE TABLE relay_epochs (
    channel_id BIGINT NOT NULL REFERENCES relay_channels (id),
    epoch BIGINT NOT NULL,
    start_seq BIGINT NOT NULL,
    PRIMARY KEY (channel_id, epoch)
);

-- Welcomes kept with their commits, by digest and by the KeyPackageRefs they name.
CREATE TABLE relay_welcomes (
    channel_id BIGINT NOT NULL REFERENCES relay_channels (id),
    digest BYTEA NOT NULL,
    commit_seq BIGINT NOT NULL,
    epoch BIGINT NOT NULL,
    welcome BYTEA NOT NULL,
    PRIMARY KEY (channel_id, digest)
);
CREATE TABLE relay_welcome_refs (
    channel_id BIGINT NOT NULL REFERENCES relay_channels (id),
    key_package_ref BYTEA NOT NULL,
    digest BYTEA NOT NULL,
    PRIMARY KEY (channel_id, key_package_ref)
);
