//! The console's reads (docs/console.md, docs/http-api.md `GET /v1/channels`): an account's
//! channels with their rosters, epochs, last activity and retention policies, and the account's
//! message rate over the last hour.
//!
//! Members only, as the gRPC reads are: a channel is listed only when a leaf of its group is
//! bound to the account (its rows in `relay_members`, then memory's roster, which is fresher).
//! The HTTP side (`static/api`) checks the caller's key and scope first and passes the key's
//! channel patterns, which filter the page here.
//!
//! Cost of one call, bounded by the caller's limits, not by what the account holds:
//! [`account_channels`] reads at most `limit` (at most [`MAX_CHANNELS`]) channel rows through
//! the index on `relay_members (account, channel_id)`, then loads each listed channel's group
//! state once (as ListMembers does; kept in memory afterwards) and returns at most
//! [`MAX_ROSTER`] members of each. [`account_rate`] counts the account's entries of the last
//! hour through the index on `relay_entries (account, appended_at)` (at most what the relay's
//! publish rate let the account send in an hour), grouped per channel (at most
//! [`MAX_RATE_ROWS`] groups, so that the key's patterns can filter them), and returns 60
//! numbers.

use crate::error::{RelayError, Result};
use crate::log::ChannelLog;
use crate::store::Policy;
use crate::ChannelPatterns;

/// Channels read per call, whatever the caller asks for.
pub const MAX_CHANNELS: usize = 50;
/// Members returned per channel (the rest are counted in `member_count`).
pub const MAX_ROSTER: usize = 100;
/// Minutes [`account_rate`] covers, the current one last.
pub const RATE_MINUTES: usize = 60;
/// (channel, minute) counts [`account_rate`] reads: an account active in more channels in the
/// hour has the rest left out of its chart.
pub const MAX_RATE_ROWS: usize = 10_000;

/// One member of a channel's group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RosterMember {
    pub leaf_index: u32,
    /// The identity of its credential (bytes, as the agent chose them).
    pub identity: Vec<u8>,
    /// The account its leaf is bound to, None when unbound.
    pub account: Option<String>,
}

/// One of an account's channels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChannelView {
    pub name: String,
    pub epoch: u64,
    /// Entries logged so far (the seq of the newest).
    pub head_seq: u64,
    /// When its newest entry was appended (unix ms), None when it holds none.
    pub last_activity_ms: Option<i64>,
    /// As the channel sets it (None per limit: the server's default).
    pub policy: Policy,
    /// At most [`MAX_ROSTER`] members, by leaf index.
    pub members: Vec<RosterMember>,
    /// All members, listed or not.
    pub member_count: usize,
}

/// A page of an account's channels.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChannelPage {
    pub channels: Vec<ChannelView>,
    /// Where the next page starts (pass it as `after`), None when this was the last.
    pub next_after: Option<i64>,
}

/// Up to `limit` of `account`'s channels (capped at [`MAX_CHANNELS`]) after channel id
/// `after`, by id, those matching `patterns` (None: every channel), each with its roster.
pub async fn account_channels(
    log: &ChannelLog,
    account: &str,
    patterns: Option<&ChannelPatterns>,
    after: i64,
    limit: usize,
) -> Result<ChannelPage> {
    let limit = limit.clamp(1, MAX_CHANNELS);
    let rows = log.account_channels(account, after, limit).await?;
    let next_after = if rows.len() == limit {
        rows.last().map(|row| row.id)
    } else {
        None
    };
    let mut channels = Vec::with_capacity(rows.len());
    for row in rows {
        // The key's patterns before any group state is loaded.
        if patterns.is_some_and(|p| !p.matches(&row.name)) {
            continue;
        }
        let channel = match log.channel(account, &row.name).await {
            Ok(channel) => channel,
            // Gone meanwhile (nothing deletes channels today, but a page is not the place to
            // fail for it).
            Err(RelayError::NotFound(_)) => continue,
            Err(e) => return Err(e),
        };
        if channel.is_legacy() {
            continue;
        }
        let (epoch, members) = log.members_of(&channel).await?;
        // Memory is fresher than the row: an account removed since is no longer a member.
        if !members
            .iter()
            .any(|(_, bound)| bound.as_deref() == Some(account))
        {
            continue;
        }
        let member_count = members.len();
        let members = members
            .into_iter()
            .take(MAX_ROSTER)
            .map(|(leaf, bound)| RosterMember {
                leaf_index: leaf.leaf_index,
                identity: leaf.identity,
                account: bound.map(|a| a.to_string()),
            })
            .collect();
        channels.push(ChannelView {
            name: row.name,
            epoch,
            head_seq: channel.head_seq().max(row.head_seq),
            last_activity_ms: row.last_activity_ms,
            policy: row.policy,
            members,
            member_count,
        });
    }
    Ok(ChannelPage {
        channels,
        next_after,
    })
}

/// How many application messages `account` published in each of the last [`RATE_MINUTES`]
/// minutes before `now_ms` (unix ms), the oldest first, the current minute last; only in
/// channels matching `patterns` (None: every channel).
pub async fn account_rate(
    log: &ChannelLog,
    account: &str,
    patterns: Option<&ChannelPatterns>,
    now_ms: i64,
) -> Result<Vec<u64>> {
    let minutes = i64::try_from(RATE_MINUTES).unwrap_or(i64::MAX);
    let first = now_ms.div_euclid(60_000) - (minutes - 1);
    let counts = log
        .account_rate(
            account,
            first.saturating_mul(60_000),
            static_proto::content_type::APPLICATION,
            MAX_RATE_ROWS,
        )
        .await?;
    let mut rate = vec![0u64; RATE_MINUTES];
    for (channel, minute, count) in counts {
        if patterns.is_some_and(|p| !p.matches(&channel)) {
            continue;
        }
        if let Some(slot) = minute
            .checked_sub(first)
            .and_then(|i| usize::try_from(i).ok())
            .and_then(|i| rate.get_mut(i))
        {
            *slot = slot.saturating_add(count);
        }
    }
    Ok(rate)
}
