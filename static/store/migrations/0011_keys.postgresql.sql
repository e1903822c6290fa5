-- Keys for agents (docs/http-api.md "Scopes, channel patterns, expiry, roll" and "Audit log"):
-- what a key may do, until when, its successor's grace, and the account's audit events (PostgreSQL).
--
-- scopes: JSON array of "keys" / "channels"; channels: JSON array of `org/namespace/service`
-- patterns (`*` matches one component), NULL for every channel. expires_at: the key stops
-- working then (NULL: never); lifetime_seconds: what it was created with, so that a roll gives
-- its successor as long. grace_ends_at: set by a roll, the old key stops working then (the
-- sweep later sets revoked_at to it). expiry_noted: the sweep wrote the key.expired event.
ALTER TABLE api_keys ADD COLUMN scopes TEXT NOT NULL DEFAULT '["keys","channels"]';
ALTER TABLE api_keys ADD COLUMN channels TEXT;
ALTER TABLE api_keys ADD COLUMN expires_at TIMESTAMPTZ;
ALTER TABLE api_keys ADD COLUMN lifetime_seconds INTEGER;
ALTER TABLE api_keys ADD COLUMN grace_ends_at TIMESTAMPTZ;
ALTER TABLE api_keys ADD COLUMN expiry_noted INTEGER NOT NULL DEFAULT 0;

-- What the sweep looks for, without reading every key.
CREATE INDEX api_keys_expiring ON api_keys (expires_at)
    WHERE revoked_at IS NULL AND expires_at IS NOT NULL AND expiry_noted = 0;
CREATE INDEX api_keys_in_grace ON api_keys (grace_ends_at)
    WHERE revoked_at IS NULL AND grace_ends_at IS NOT NULL;

-- One row per change to an account's keys, written in the change's transaction. Times are
-- unix ms, as in the relay's relay_audit (0012), so that GET /v1/audit merges the two by time.
-- detail: a JSON object of the type's own fields (never a secret).
CREATE TABLE audit_events (
    seq BIGSERIAL PRIMARY KEY,
    account TEXT NOT NULL,
    at_ms BIGINT NOT NULL,
    type TEXT NOT NULL,
    key_id TEXT,
    detail TEXT NOT NULL
);
CREATE INDEX audit_events_by_account ON audit_events (account, at_ms DESC, seq DESC);
CREATE INDEX audit_events_by_time ON audit_events (at_ms);
