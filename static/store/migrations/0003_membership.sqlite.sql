-- database: relay (SQLite keeps the relay's tables in a file of their own: static/store/_migrations.py)
-- Channels governed by MLS membership (docs/design.md §5.2; read and written by the Rust relay,
-- crates/relay/src/store/). Names become global, orgs belong to one account, and access follows
-- the leaves bound to an account.
--
-- Existing channels become legacy ones: `owner` keeps the account that created them (the old
-- scope), which alone reaches them, and their handshakes stay unchecked. Where two accounts had
-- created the same name, the older channel holds the global name (scope '') and the other keeps
-- working for its own account under scope 'legacy:<account>'. New channels have scope '', no
-- owner and legacy = 0.
ALTER TABLE relay_channels ADD COLUMN owner TEXT;
ALTER TABLE relay_channels ADD COLUMN legacy INTEGER NOT NULL DEFAULT 0;
UPDATE relay_channels SET owner = scope, legacy = 1, scope = 'legacy:' || scope;
UPDATE relay_channels SET scope = ''
    WHERE id IN (SELECT MIN(id) FROM relay_channels GROUP BY name);

-- Each org (a name's first component) belongs to the account that first created a channel under
-- it ('' is the anonymous principal). Existing orgs go to the creator of their oldest channel.
CREATE TABLE relay_orgs (
    org TEXT PRIMARY KEY,
    account TEXT NOT NULL
);
INSERT INTO relay_orgs (org, account)
    SELECT substr(name, 1, instr(name, '/') - 1), owner FROM relay_channels
    WHERE id IN (SELECT MIN(id) FROM relay_channels
                 GROUP BY substr(name, 1, instr(name, '/') - 1));

-- The channel's public group state at its current epoch (the relay's own encoding).
CREATE TABLE relay_groups (
    channel_id INTEGER PRIMARY KEY REFERENCES relay_channels (id),
    epoch INTEGER NOT NULL,
    state BLOB NOT NULL
);

-- Leaves bound to accounts: a row per bound leaf of the current group, and per removed one
-- (`removed_seq`: the commit that removed it; its account reaches the log up to there) until
-- its index is bound again.
CREATE TABLE relay_members (
    channel_id INTEGER NOT NULL REFERENCES relay_channels (id),
    leaf_index INTEGER NOT NULL,
    account TEXT NOT NULL,
    removed_seq INTEGER,
    PRIMARY KEY (channel_id, leaf_index)
);

-- Proposals accepted in each epoch: a commit may reference them.
CREATE TABLE relay_proposals (
    channel_id INTEGER NOT NULL REFERENCES relay_channels (id),
    epoch INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    message BLOB NOT NULL,
    PRIMARY KEY (channel_id, epoch, seq)
);

-- Who published each entry, as the relay authenticated it ('' before this migration).
ALTER TABLE relay_entries ADD COLUMN account TEXT NOT NULL DEFAULT '';
