//! A group commit's decision, pure: fence, number and deduplicate a batch of publishes over
//! plain channel ids, heads and keys (the stores run it inside their transactions).

use std::collections::HashMap;

use crate::error::RelayError;
use crate::wire::framing::MessageHeader;
use crate::wire::rules::{check_fence, epoch_after};

/// One publish as the decision sees it.
pub(crate) struct Candidate<'a> {
    pub channel_id: i64,
    /// Its idempotency key.
    pub key: &'a [u8],
    pub header: &'a MessageHeader,
    /// A handshake the group state could not check (its epoch was not the state's): it may
    /// only be the retry of a logged one.
    pub other_epoch: bool,
}

/// What the writer decided for one publish of a batch.
pub(crate) enum Decision {
    Append {
        seq: u64,
        channel_epoch: u64,
        starts_epoch: bool,
    },
    Duplicate {
        seq: u64,
        channel_epoch: u64,
    },
    Refused(RelayError),
}

/// A channel's head and epoch as a batch would leave them.
pub(crate) struct Tentative {
    /// A publish of the batch on this channel (its index in the batch).
    pub index: usize,
    pub head: u64,
    pub epoch: u64,
    /// The batch appends to this channel.
    appended: bool,
}

/// The writer's decisions for a batch: per publish, and the channels' tentative heads.
pub(crate) struct Plan {
    pub decisions: Vec<Decision>,
    tentative: HashMap<i64, Tentative>,
}

impl Plan {
    /// The channels the batch appends to (by id), with their new head and epoch.
    pub(crate) fn changed(&self) -> impl Iterator<Item = (i64, &Tentative)> + '_ {
        self.tentative
            .iter()
            .filter(|(_, t)| t.appended)
            .map(|(id, t)| (*id, t))
    }

    /// Whether the batch appends anything.
    pub(crate) fn appends(&self) -> bool {
        self.tentative.values().any(|t| t.appended)
    }
}

/// Fence and number `batch` in order, from each channel's `(head, epoch)` as `base` gives it
/// (called once per channel, with the index of its first publish in the batch).
/// `found`: per publish, where its key already is in the log (None: not looked up). A key
/// seen earlier in the batch (or found) answers as a duplicate of that entry, before the
/// fence: a retry is never refused.
pub(crate) fn decide<'a>(
    batch: impl IntoIterator<Item = Candidate<'a>>,
    base: impl Fn(usize) -> (u64, u64),
    found: Option<&[Option<(u64, u64)>]>,
    window: u64,
) -> Plan {
    let batch: Vec<Candidate<'a>> = batch.into_iter().collect();
    let mut tentative: HashMap<i64, Tentative> = HashMap::new();
    let mut seen: HashMap<(i64, &[u8]), (u64, u64)> = HashMap::new();
    if let Some(found) = found {
        for (p, place) in batch.iter().zip(found) {
            if let Some(place) = place {
                seen.insert((p.channel_id, p.key), *place);
            }
        }
    }
    let decisions = batch
        .iter()
        .enumerate()
        .map(|(index, p)| {
            let t = tentative.entry(p.channel_id).or_insert_with(|| {
                let (head, epoch) = base(index);
                Tentative {
                    index,
                    head,
                    epoch,
                    appended: false,
                }
            });
            let key = (p.channel_id, p.key);
            if let Some(&(seq, channel_epoch)) = seen.get(&key) {
                return Decision::Duplicate { seq, channel_epoch };
            }
            if let Err(err) = check_fence(p.header, t.epoch, window) {
                return Decision::Refused(err);
            }
            if p.other_epoch {
                // Checked against no state (its epoch was not the state's), and not a retry.
                return Decision::Refused(RelayError::StaleEpoch {
                    message_epoch: p.header.epoch,
                    current_epoch: t.epoch,
                });
            }
            let new_epoch = epoch_after(p.header, t.epoch);
            let starts_epoch = new_epoch != t.epoch;
            t.head += 1;
            t.epoch = new_epoch;
            t.appended = true;
            seen.insert(key, (t.head, new_epoch));
            Decision::Append {
                seq: t.head,
                channel_epoch: new_epoch,
                starts_epoch,
            }
        })
        .collect();
    Plan {
        decisions,
        tentative,
    }
}
