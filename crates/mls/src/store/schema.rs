//! The tables the engine keeps beside OpenMLS's in `mls.sqlite3`, all created here when the
//! store opens (idempotent), with the migrations of databases of earlier versions.

use rusqlite::Connection;

/// The past part of split message secrets (see [`crate::store::storage`]), keyed like OpenMLS's rows.
const MESSAGE_SECRETS_PAST: &str = "CREATE TABLE IF NOT EXISTS static_message_secrets_past (
         group_id BLOB PRIMARY KEY,
         data BLOB NOT NULL
     )";

/// The store's own records (see [`crate::store`]).
const STORE_TABLES: &str = "CREATE TABLE IF NOT EXISTS static_identity (
         id INTEGER PRIMARY KEY CHECK (id = 0),
         identity BLOB NOT NULL,
         signature_public_key BLOB NOT NULL
     );
     CREATE TABLE IF NOT EXISTS static_groups (
         name TEXT PRIMARY KEY
     );
     CREATE TABLE IF NOT EXISTS static_pending_commits (
         name TEXT PRIMARY KEY REFERENCES static_groups(name) ON DELETE CASCADE,
         commit_bytes BLOB NOT NULL,
         -- The Welcome an add made with it: a commit cut off before the relay answered is
         -- published again whole (see `static-client`'s committer).
         welcome_bytes BLOB
     );
     -- Where each channel stands in the relay's log: `seq` is the last entry applied
     -- (NULL: none yet, subscribe from the start of `join_epoch`). Written in the same
     -- transaction as the MLS state change the entry caused.
     CREATE TABLE IF NOT EXISTS static_cursors (
         name TEXT PRIMARY KEY REFERENCES static_groups(name) ON DELETE CASCADE,
         seq INTEGER,
         join_epoch INTEGER NOT NULL DEFAULT 0
     );
     -- Decrypted application messages not yet handed to the caller. MLS deletes a
     -- message key once used, so a plaintext only held in memory would be lost by a
     -- crash: it is stored with the state change that decrypted it. Not tied to the
     -- group: what arrived before a removal can still be read.
     CREATE TABLE IF NOT EXISTS static_inbox (
         id INTEGER PRIMARY KEY AUTOINCREMENT,
         name TEXT NOT NULL,
         seq INTEGER NOT NULL,
         sender BLOB NOT NULL,
         payload BLOB NOT NULL,
         epoch INTEGER NOT NULL DEFAULT 0,
         account TEXT
     );
     CREATE INDEX IF NOT EXISTS static_inbox_by_name ON static_inbox (name, id);
     -- The engine's last opening: the kernel's boot id then (NULL: unknown, every send
     -- was synced) and whether it was closed cleanly (see `Engine::open`).
     CREATE TABLE IF NOT EXISTS static_session (
         id INTEGER PRIMARY KEY CHECK (id = 0),
         boot_id TEXT,
         clean INTEGER NOT NULL
     );
     -- Groups in which we must not encrypt until a commit of ours moved them to a new
     -- epoch: after the machine went down, sends not yet on disk may have been lost.
     CREATE TABLE IF NOT EXISTS static_fresh_epoch_needed (
         name TEXT PRIMARY KEY REFERENCES static_groups(name) ON DELETE CASCADE
     );
     -- The API key that last bound our leaf of each channel on the relay (the relay proposes
     -- the removal of leaves whose key is revoked): bound again when our key changes.
     CREATE TABLE IF NOT EXISTS static_bound_keys (
         name TEXT PRIMARY KEY REFERENCES static_groups(name) ON DELETE CASCADE,
         key_id TEXT NOT NULL
     );";

/// The outbox (see [`crate::outbox`]). A message's row is keyed by its channel and place, with
/// no other index and no count updated per message, so that recording a batch writes few pages
/// beside the ratchet's.
const OUTBOX_TABLES: &str = "CREATE TABLE IF NOT EXISTS static_outbox (
         name TEXT NOT NULL REFERENCES static_groups(name) ON DELETE CASCADE,
         id INTEGER NOT NULL,
         epoch INTEGER NOT NULL,
         message BLOB NOT NULL,
         recorded_ms INTEGER NOT NULL,
         PRIMARY KEY (name, id)
     ) WITHOUT ROWID;
     -- The last place each channel's outbox settled (deleted up to): with the places
     -- still in the outbox, how many messages it ever recorded.
     CREATE TABLE IF NOT EXISTS static_outbox_settled (
         name TEXT PRIMARY KEY REFERENCES static_groups(name) ON DELETE CASCADE,
         upto INTEGER NOT NULL
     );";

/// Request/reply's records (see [`crate::request`]): the requester's requests awaiting their
/// reply being handed out, and the responder's requests not replied to yet. Not tied to the
/// group, like the inbox.
const REQUEST_TABLES: &str = "CREATE TABLE IF NOT EXISTS static_requests_out (
         name TEXT NOT NULL,
         id BLOB NOT NULL,
         payload_hash BLOB NOT NULL,
         created_ms INTEGER NOT NULL,
         reply_sender BLOB,
         reply_payload BLOB,
         reply_account TEXT,
         reply_seq INTEGER,
         reply_epoch INTEGER,
         PRIMARY KEY (name, id)
     ) WITHOUT ROWID;
     CREATE INDEX IF NOT EXISTS static_requests_out_by_hash
         ON static_requests_out (name, payload_hash);
     CREATE TABLE IF NOT EXISTS static_requests_in (
         row INTEGER PRIMARY KEY AUTOINCREMENT,
         name TEXT NOT NULL,
         id BLOB NOT NULL,
         seq INTEGER NOT NULL,
         sender BLOB NOT NULL,
         payload BLOB NOT NULL,
         epoch INTEGER NOT NULL,
         account TEXT,
         UNIQUE (name, id)
     );";

/// The inbox's hand-out slots and marks (see [`crate::store::inbox_slot`]): created on first
/// use, not at opening.
pub(crate) const INBOX_SLOTS_TABLE: &str = "CREATE TABLE IF NOT EXISTS static_inbox_slots (
         name TEXT PRIMARY KEY,
         slot INTEGER NOT NULL UNIQUE
     );
     -- The hand-out marks file's own id, as the client recorded it (see `static-client`):
     -- from then on the file must be there, with that id, and a mark for every slot.
     CREATE TABLE IF NOT EXISTS static_inbox_marks (
         id INTEGER PRIMARY KEY CHECK (id = 0),
         file_id BLOB NOT NULL
     );";

/// Creates every table of ours that is missing and migrates older ones; OpenMLS's own tables
/// (its migrations, run by the store) come first.
pub(crate) fn create_tables(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch(MESSAGE_SECRETS_PAST)?;
    conn.execute_batch(STORE_TABLES)?;
    conn.execute_batch(OUTBOX_TABLES)?;
    conn.execute_batch(REQUEST_TABLES)?;
    // Inboxes of an older version: the message's epoch and the publishing account came later
    // (an old row reads as epoch 0, account unknown); so did a pending commit's Welcome (an old
    // row has none: it was made before, and is published again without one).
    for (table, column, ddl) in [
        (
            "static_inbox",
            "epoch",
            "ALTER TABLE static_inbox ADD COLUMN epoch INTEGER NOT NULL DEFAULT 0",
        ),
        (
            "static_inbox",
            "account",
            "ALTER TABLE static_inbox ADD COLUMN account TEXT",
        ),
        (
            "static_pending_commits",
            "welcome_bytes",
            "ALTER TABLE static_pending_commits ADD COLUMN welcome_bytes BLOB",
        ),
    ] {
        let present: bool = conn.query_row(
            "SELECT count(*) > 0 FROM pragma_table_info(?1) WHERE name = ?2",
            (table, column),
            |row| row.get(0),
        )?;
        if !present {
            conn.execute_batch(ddl)?;
        }
    }
    Ok(())
}
