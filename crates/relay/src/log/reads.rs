//! The `ChannelLog`'s reads: entries after a cursor (from a channel's ring, else the store),
//! epoch starts and horizons, the retention queries, Welcomes.

use super::channel::Channel;
use super::{ChannelLog, Entry, WelcomeKey, WelcomeRecord};
use crate::error::{RelayError, Result};
use crate::store::RetentionRow;

impl ChannelLog {
    /// Up to `limit` consecutive entries after `cursor` (empty when `cursor` is the head):
    /// from memory when recent, else from the store. Unavailable on store failure or a gap.
    pub async fn read_after(
        &self,
        channel: &Channel,
        cursor: u64,
        limit: usize,
    ) -> Result<Vec<Entry>> {
        self.read_page(channel, cursor, limit, usize::MAX).await
    }

    /// [`ChannelLog::read_after`], and no entry more once the page's messages reach
    /// `max_bytes` (the first entry always comes: a page holds at most `max_bytes` and one
    /// message). What a subscriber holds is bounded by it, whatever the messages' size.
    pub async fn read_page(
        &self,
        channel: &Channel,
        cursor: u64,
        limit: usize,
        max_bytes: usize,
    ) -> Result<Vec<Entry>> {
        let head = channel.head_seq();
        channel.check_cursor(cursor)?;
        if cursor >= head || limit == 0 {
            return Ok(Vec::new());
        }
        if let Some(page) = channel.ring_after(cursor, limit, max_bytes) {
            return Ok(page);
        }
        let page = self
            .inner
            .reader
            .read(channel.id, cursor, limit, max_bytes)
            .await?;
        if page.first().is_none_or(|e| e.seq != cursor + 1) {
            // Pruned meanwhile (here, or by another relay on PostgreSQL)?
            self.refresh_horizon(channel).await?;
            channel.check_cursor(cursor)?;
        }
        if page.is_empty() {
            // Never expected: the head advances only after a commit.
            return Err(RelayError::Unavailable(format!(
                "log ends before seq {head}"
            )));
        }
        for (expected, entry) in (cursor + 1..).zip(&page) {
            if entry.seq != expected {
                // Never expected: the log is gap-free.
                return Err(RelayError::Unavailable(format!(
                    "log gap after seq {}",
                    expected - 1
                )));
            }
        }
        Ok(page)
    }

    /// The seq after which `epoch` starts: NotFound("channel 'NAME' has no epoch E (it is at
    /// C)") when the channel never had it.
    pub async fn start_of_epoch(&self, channel: &Channel, epoch: u64) -> Result<u64> {
        if epoch == 0 {
            let horizon = channel.horizon();
            if horizon > 0 {
                return Err(channel.pruned(horizon, "from epoch 0".to_owned()));
            }
            return Ok(0);
        }
        // Asked of the store even beyond the epoch in memory: on PostgreSQL another relay may
        // have moved the channel on a moment ago. Beyond the store's integers: no such epoch.
        let start = if i64::try_from(epoch).is_ok() {
            self.inner.reader.epoch_start(channel.id, epoch).await?
        } else {
            None
        };
        if let Some(start) = start {
            if start < channel.horizon() {
                return Err(channel.pruned(channel.horizon(), format!("from epoch {epoch}")));
            }
            return Ok(start);
        }
        // Pruning drops the starts of the epochs it went past.
        if epoch <= channel.epoch() {
            self.refresh_horizon(channel).await?;
            if channel.horizon() > 0 {
                return Err(channel.pruned(channel.horizon(), format!("from epoch {epoch}")));
            }
        }
        Err(RelayError::NotFound(format!(
            "channel '{}' has no epoch {epoch} (it is at {})",
            channel.name,
            channel.epoch()
        )))
    }

    /// Reads the channel's horizon again (another relay may have pruned).
    async fn refresh_horizon(&self, channel: &Channel) -> Result<()> {
        if let Some(row) = self.inner.reader.retention_row(channel.id).await? {
            channel.move_horizon(row.horizon);
        }
        Ok(())
    }

    /// The channel's retention as stored.
    pub(crate) async fn retention_row(&self, channel: &Channel) -> Result<RetentionRow> {
        let row = self
            .inner
            .reader
            .retention_row(channel.id)
            .await?
            .ok_or_else(|| RelayError::NotFound(format!("no channel '{}'", channel.name)))?;
        channel.move_horizon(row.horizon);
        Ok(row)
    }

    /// The account owning `org`.
    pub(crate) async fn org_owner(&self, org: &str) -> Result<Option<String>> {
        self.inner.reader.org_owner(org).await
    }

    pub(crate) async fn retention_rows(
        &self,
        after_id: i64,
        limit: usize,
    ) -> Result<Vec<RetentionRow>> {
        self.inner.reader.retention_rows(after_id, limit).await
    }

    pub(crate) async fn first_since(
        &self,
        channel_id: i64,
        after_seq: u64,
        up_to: u64,
        since_ms: i64,
    ) -> Result<Option<u64>> {
        self.inner
            .reader
            .first_since(channel_id, after_seq, up_to, since_ms)
            .await
    }

    pub(crate) async fn bytes_cut(
        &self,
        channel_id: i64,
        after_seq: u64,
        max_bytes: u64,
    ) -> Result<Option<u64>> {
        self.inner
            .reader
            .bytes_cut(channel_id, after_seq, max_bytes)
            .await
    }

    /// Whether some Welcome was created before `created_before` or used before `used_before`.
    pub(crate) async fn welcomes_due(&self, created_before: i64, used_before: i64) -> Result<bool> {
        self.inner
            .reader
            .welcomes_due(created_before, used_before)
            .await
    }

    pub(crate) async fn welcome_floor(&self, channel_id: i64) -> Result<Option<u64>> {
        self.inner.reader.welcome_floor(channel_id).await
    }

    pub async fn fetch_welcome(
        &self,
        channel: &Channel,
        key: WelcomeKey,
    ) -> Result<Option<WelcomeRecord>> {
        self.inner.reader.fetch_welcome(channel.id, key).await
    }
}
