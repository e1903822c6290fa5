-- Accounts, API keys and the JWT signing keys (SQLite). Timestamps are ISO 8601 UTC text of
-- fixed width ("2026-01-02T03:04:05.000006Z"), so text order is time order.

CREATE TABLE accounts (
    id TEXT PRIMARY KEY,
    email TEXT NOT NULL,
    -- The lower-cased email: addresses are unique case-insensitively.
    email_key TEXT NOT NULL UNIQUE,
    name TEXT,
    plan_tier TEXT NOT NULL DEFAULT 'free',
    created_at TEXT NOT NULL
);

CREATE TABLE api_keys (
    -- Insertion order: breaks created_at ties so "newest first" is total.
    seq INTEGER PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    account_id TEXT NOT NULL REFERENCES accounts (id),
    -- SHA-256 of the secret; the secret itself is never stored.
    key_hash BLOB NOT NULL UNIQUE,
    key_prefix TEXT NOT NULL,
    name TEXT NOT NULL,
    created_at TEXT NOT NULL,
    last_used_at TEXT,
    revoked_at TEXT
);

CREATE INDEX api_keys_active_by_account
    ON api_keys (account_id, created_at DESC, seq DESC)
    WHERE revoked_at IS NULL;

CREATE TABLE signing_keys (
    kid TEXT PRIMARY KEY,
    algorithm TEXT NOT NULL,
    -- PKCS#8 PEM of the private key.
    private_key TEXT NOT NULL,
    created_at TEXT NOT NULL,
    retired_at TEXT
);
