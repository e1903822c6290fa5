-- database: relay (SQLite keeps the relay's tables in a file of their own: static/store/_migrations.py)
-- Revocation reaches the groups (docs/design.md §5.2, "Removal on revocation"; read and written
-- by the Rust relay, crates/relay/src/store/ and crates/relay/src/removal.rs).
--
-- Each binding remembers the API key that last proved it (BindLeaf's, or CreateChannel's for
-- the creator's leaf): the relay proposes the removal of the leaves whose key is revoked or
-- expired. NULL for bindings made before this migration (and for anonymous callers): those
-- leaves are never proposed for removal.
ALTER TABLE relay_members ADD COLUMN key_id TEXT;
CREATE INDEX relay_members_key ON relay_members (key_id);

-- The relay's own identity as an MLS external sender (RFC 9420 §12.1.8.1): an Ed25519 key pair,
-- made by the first relay that starts on this database and shared by every relay of it. The
-- SDK puts its public key in the `external_senders` extension of each channel it creates.
CREATE TABLE relay_external_sender (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    signature_key BLOB NOT NULL,
    private_key BLOB NOT NULL,
    created_at INTEGER NOT NULL
);
