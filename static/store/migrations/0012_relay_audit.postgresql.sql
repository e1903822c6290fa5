-- database: relay (SQLite keeps the relay's tables in a file of their own: static/store/_migrations.py)
-- The relay's part of the audit log (GET /v1/audit merges it with the accounts' audit_events):
-- membership events from the handshakes the relay checks, never content. `detail` is a JSON
-- object merged into the event.
CREATE TABLE relay_audit (
    seq BIGSERIAL PRIMARY KEY,
    account TEXT NOT NULL,
    at_ms BIGINT NOT NULL,
    type TEXT NOT NULL,
    key_id TEXT,
    channel TEXT NOT NULL,
    detail TEXT NOT NULL
);
CREATE INDEX relay_audit_by_account ON relay_audit (account, at_ms DESC, seq DESC);
