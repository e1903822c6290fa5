-- database: relay (SQLite keeps the relay's tables in a file of their own: static/store/_migrations.py)
-- The console's reads (docs/console.md; crates/relay/src/store/sql.rs ACCOUNT_CHANNELS and
-- ACCOUNT_RATE): an account's channels are found from its bound leaves, and its message rate
-- from the entries it published in the last hour, each by an index rather than a scan of every
-- channel or entry.
CREATE INDEX relay_members_account ON relay_members (account, channel_id);
CREATE INDEX relay_entries_account ON relay_entries (account, appended_at);
