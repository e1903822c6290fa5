-- database: relay (SQLite keeps the relay's tables in a file of their own: static/store/_migrations.py)
-- The relay's channel logs (read and written by the Rust relay: crates/relay/src/store/sqlite.rs;
-- created here, by the Python store's migrations). Channels are unique per scope: the
-- account that created them, or '' for anonymous callers.
CREATE TABLE relay_channels (
    id INTEGER PRIMARY KEY,
    scope TEXT NOT NULL,
    name TEXT NOT NULL,
    epoch INTEGER NOT NULL DEFAULT 0,
    head_seq INTEGER NOT NULL DEFAULT 0,
    created_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP,
    UNIQUE (scope, name)
);

-- The append-only log: gap-free seq per channel.
CREATE TABLE relay_entries (
    channel_id INTEGER NOT NULL REFERENCES relay_channels (id),
    seq INTEGER NOT NULL,
    epoch INTEGER NOT NULL,
    content_type SMALLINT NOT NULL,
    channel_epoch INTEGER NOT NULL,
    idempotency_key BLOB NOT NULL,
    message BLOB NOT NULL,
    PRIMARY KEY (channel_id, seq)
);
CREATE UNIQUE INDEX relay_entries_idempotency ON relay_entries (channel_id, idempotency_key);

-- Where each epoch starts: the seq of the commit that created it (0 for epoch 0).
CREATE TABLE relay_epochs (
    channel_id INTEGER NOT NULL REFERENCES relay_channels (id),
    epoch INTEGER NOT NULL,
    start_seq INTEGER NOT NULL,
    PRIMARY KEY (channel_id, epoch)
);

-- Welcomes kept with their commits, by digest and by the KeyPackageRefs they name.
CREATE TABLE relay_welcomes (
    channel_id INTEGER NOT NULL REFERENCES relay_channels (id),
    digest BLOB NOT NULL,
    commit_seq INTEGER NOT NULL,
    epoch INTEGER NOT NULL,
    welcome BLOB NOT NULL,
    PRIMARY KEY (channel_id, digest)
);
CREATE TABLE relay_welcome_refs (
    channel_id INTEGER NOT NULL REFERENCES relay_channels (id),
    key_package_ref BLOB NOT NULL,
    digest BLOB NOT NULL,
    PRIMARY KEY (channel_id, key_package_ref)
);
