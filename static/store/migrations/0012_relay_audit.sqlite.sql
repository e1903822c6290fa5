-- database: relay (SQLite keeps the relay's tables in a file of their own: static/store/_migrations.py)
-- The relay's audit events of an account's channels (written by the Rust relay; read, merged with
-- the accounts' audit_events of 0011, by GET /v1/audit). at_ms: unix ms. type: channel.created,
-- org.claimed, member.added, member.removed or retention.changed. detail: a JSON object whose
-- members are merged into the event (e.g. {"identity": "...", "member_account": "..."}).
CREATE TABLE relay_audit (seq INTEGER PRIMARY KEY AUTOINCREMENT, account TEXT NOT NULL, at_ms INTEGER NOT NULL, type TEXT NOT NULL, key_id TEXT, channel TEXT NOT NULL, detail TEXT NOT NULL);
CREATE INDEX relay_audit_by_account ON relay_audit (account, at_ms DESC, seq DESC);
