-- Accounts, API keys and the JWT signing keys (PostgreSQL).

CREATE TABLE accounts (
    id UUID PRIMARY KEY,
    email TEXT NOT NULL,
    -- The lower-cased email: addresses are unique case-insensitively.
    email_key TEXT NOT NULL UNIQUE,
    name TEXT,
    plan_tier TEXT NOT NULL DEFAULT 'free',
    created_at TIMESTAMPTZ NOT NULL
);

CREATE TABLE api_keys (
    id UUID PRIMARY KEY,
    -- Insertion order: breaks created_at ties so "newest first" is total.
    seq BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE,
    account_id UUID NOT NULL REFERENCES accounts (id),
    -- SHA-256 of the secret; the secret itself is never stored.
    key_hash BYTEA NOT NULL UNIQUE,
    key_prefix TEXT NOT NULL,
    name TEXT NOT NULL,
    created_at TIMESTAMPTZ NOT NULL,
    last_used_at TIMESTAMPTZ,
    revoked_at TIMESTAMPTZ
);

CREATE INDEX api_keys_active_by_account
    ON api_keys (account_id, created_at DESC, seq DESC)
    WHERE revoked_at IS NULL;

CREATE TABLE signing_keys (
    kid TEXT PRIMARY KEY,
    algorithm TEXT NOT NULL,
    -- PKCS#8 PEM of the private key.
    private_key TEXT NOT NULL,
    created_at TIMESTAMPTZ NOT NULL,
    retired_at TIMESTAMPTZ
);
