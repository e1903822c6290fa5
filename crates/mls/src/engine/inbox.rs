//! The inbox and the cursor: what was decrypted and not yet handed to the caller, and where
//! the channel stands in the relay's log (both kept by [`crate::store`]).

use super::*;

impl Engine {
    /// Where the channel's processing resumes in the relay's log.
    pub fn cursor(&self, channel: &str) -> Result<Cursor> {
        self.with_group_read(channel, |_| Ok(()))?;
        let db = lock(&self.db);
        Ok(store::rows::cursor(&db.conn, channel)?)
    }

    /// Removes and returns the oldest received message of the channel (see
    /// [`crate::store::Db::light_transaction`] for its durability). For users of the engine
    /// alone: the SDK's client reads with [`Engine::inbox_after`] and marks what it hands out.
    pub fn inbox_take(&self, channel: &str) -> Result<Option<InboxMessage>> {
        let db = lock(&self.db);
        db.light_transaction(|conn| Ok(store::rows::inbox_take(conn, channel)?))
    }

    /// Up to `limit` received messages of the channel after inbox row `after_id`, oldest
    /// first. Reading leaves them stored: the caller records what it handed out (see
    /// `static-client`) and prunes with [`Engine::inbox_prune`].
    pub fn inbox_after(
        &self,
        channel: &str,
        after_id: i64,
        limit: usize,
    ) -> Result<Vec<InboxMessage>> {
        let db = lock(&self.db);
        Ok(store::rows::inbox_after(
            &db.conn, channel, after_id, limit,
        )?)
    }

    /// Deletes the channel's inbox rows up to `upto_id` (handed out already), in a light
    /// transaction (see [`crate::store::Db::light_transaction`]).
    pub fn inbox_prune(&self, channel: &str, upto_id: i64) -> Result<()> {
        let db = lock(&self.db);
        db.light_transaction(|conn| {
            Ok(store::rows::inbox_prune(conn, channel, upto_id).map(|_| ())?)
        })
    }

    /// How many received messages of the channel come after inbox row `after_id`.
    pub fn inbox_count_after(&self, channel: &str, after_id: i64) -> Result<u64> {
        let db = lock(&self.db);
        Ok(store::rows::inbox_count_after(&db.conn, channel, after_id)?)
    }

    /// The channel's slot in the client's hand-out marks file; `init` writes a new slot's
    /// first mark before the slot is recorded (see [`store::rows::inbox_slot`]).
    pub fn inbox_slot(
        &self,
        channel: &str,
        init: impl FnOnce(u64) -> std::result::Result<(), StoreError>,
    ) -> Result<u64> {
        let db = lock(&self.db);
        db.transaction(|conn| Ok(store::rows::inbox_slot(conn, channel, init)?))
    }

    /// How many slots the client's hand-out marks file has, and the file's recorded id (see
    /// [`store::rows::inbox_marks`]).
    pub fn inbox_marks(&self) -> Result<(u64, Option<Vec<u8>>)> {
        let db = lock(&self.db);
        db.transaction(|conn| Ok(store::rows::inbox_marks(conn)?))
    }

    /// Records the id of the client's hand-out marks file.
    pub fn record_inbox_marks(&self, file_id: &[u8]) -> Result<()> {
        let db = lock(&self.db);
        db.transaction(|conn| Ok(store::rows::record_inbox_marks(conn, file_id)?))
    }
}
