-- database: relay (SQLite keeps the relay's tables in a file of their own: static/store/_migrations.py)
-- The key-package directory and invitations (docs/design.md §5.5; read and written by the Rust
-- relay, crates/relay/src/store/directory/). Times are unix ms.
--
-- Key packages listed under an address (account, identity). A one-time package is handed out
-- once: its row is marked claimed (kept until its lifetime ends, so that listing it again is
-- still a no-op and it is never handed out twice); an address has at most one last-resort
-- package (handed out again and again). `not_after` is the end of the package's lifetime.
CREATE TABLE relay_key_packages (
    id BIGSERIAL PRIMARY KEY,
    key_package_ref BYTEA NOT NULL UNIQUE,
    account TEXT NOT NULL,
    identity BYTEA NOT NULL,
    last_resort BOOLEAN NOT NULL,
    key_package BYTEA NOT NULL,
    not_after BIGINT NOT NULL,
    listed_at BIGINT NOT NULL,
    claimed_at BIGINT
);
CREATE INDEX relay_key_packages_address
    ON relay_key_packages (account, identity, last_resort, claimed_at, id);
CREATE INDEX relay_key_packages_not_after ON relay_key_packages (not_after);

-- Who may claim an address's packages besides its own account: one row per account named
-- ('*': any). No row: the address's own account only.
CREATE TABLE relay_invitation_policies (
    account TEXT NOT NULL,
    identity BYTEA NOT NULL,
    allowed TEXT NOT NULL,
    PRIMARY KEY (account, identity, allowed)
);

-- Each claim of a package, for Invite: by whom, for which channel. A last-resort package may be
-- claimed again (the row is then renewed).
CREATE TABLE relay_key_package_claims (
    key_package_ref BYTEA NOT NULL,
    channel_id BIGINT NOT NULL REFERENCES relay_channels (id),
    claimer TEXT NOT NULL,
    account TEXT NOT NULL,
    identity BYTEA NOT NULL,
    last_resort BOOLEAN NOT NULL,
    claimed_at BIGINT NOT NULL,
    PRIMARY KEY (key_package_ref, channel_id, claimer)
);
CREATE INDEX relay_key_package_claims_claimed ON relay_key_package_claims (claimed_at);

-- Invitations of an address into a channel, one per (ref, channel). state: 0 pending,
-- 1 accepted, 2 declined. expires_at: when its Welcome expires (NULL: kept until used).
CREATE TABLE relay_invitations (
    id BIGSERIAL PRIMARY KEY,
    account TEXT NOT NULL,
    identity BYTEA NOT NULL,
    channel_id BIGINT NOT NULL REFERENCES relay_channels (id),
    channel TEXT NOT NULL,
    key_package_ref BYTEA NOT NULL,
    inviter_account TEXT NOT NULL,
    inviter_identity BYTEA NOT NULL,
    last_resort BOOLEAN NOT NULL,
    created_at BIGINT NOT NULL,
    expires_at BIGINT,
    state SMALLINT NOT NULL DEFAULT 0,
    settled_at BIGINT,
    UNIQUE (key_package_ref, channel_id)
);
CREATE INDEX relay_invitations_address ON relay_invitations (account, identity, state, id);
CREATE INDEX relay_invitations_settled ON relay_invitations (settled_at);
CREATE INDEX relay_invitations_expires ON relay_invitations (expires_at);
