//! The storage OpenMLS is given for one public group: it reads a group's records from memory and
//! captures the records OpenMLS writes, so a `PublicGroup` can be loaded (copied) and its new
//! state kept as bytes.
//!
//! `PublicGroup` has no public `Clone` and no public serializer; its only public ways in and out
//! of bytes are `PublicGroup::load` and the writes it makes on `from_external` and
//! `merge_commit`. A record is OpenMLS's serde form of the value, encoded with postcard (compact
//! and fast; OpenMLS's own providers use JSON, whose byte strings are arrays of numbers).

use std::cell::RefCell;

use openmls_traits::public_storage::PublicStorageProvider;
use openmls_traits::storage::{traits, CURRENT_VERSION};

/// The four records that make a public group (its proposal store is never stored: proposals
/// are given per call).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Records {
    pub tree: Vec<u8>,
    pub context: Vec<u8>,
    pub interim_transcript_hash: Vec<u8>,
    pub confirmation_tag: Vec<u8>,
}

/// Records as they are being written: each must be written once before the set is complete.
#[derive(Default)]
struct Written {
    tree: Option<Vec<u8>>,
    context: Option<Vec<u8>>,
    interim_transcript_hash: Option<Vec<u8>>,
    confirmation_tag: Option<Vec<u8>>,
}

#[derive(Debug, thiserror::Error)]
pub(super) enum SlotError {
    #[error("cannot encode the {0} record: {1}")]
    Encode(&'static str, postcard::Error),
    #[error("cannot decode the {0} record: {1}")]
    Decode(&'static str, postcard::Error),
    #[error("trailing bytes after the {0} record")]
    Trailing(&'static str),
    #[error("OpenMLS did not write the {0} record")]
    Missing(&'static str),
}

/// One group's storage: reads from `source` (none: nothing stored), writes captured.
pub(super) struct Slot<'a> {
    source: Option<&'a Records>,
    written: RefCell<Written>,
}

impl<'a> Slot<'a> {
    /// A slot to load `source` from (and to capture what is written after).
    pub fn reading(source: &'a Records) -> Slot<'a> {
        Slot {
            source: Some(source),
            written: RefCell::default(),
        }
    }

    /// A slot with nothing stored, to capture a new group's records.
    pub fn empty() -> Slot<'static> {
        Slot {
            source: None,
            written: RefCell::default(),
        }
    }

    /// The records written, all four of them.
    pub fn into_written(self) -> Result<Records, SlotError> {
        let w = self.written.into_inner();
        Ok(Records {
            tree: w.tree.ok_or(SlotError::Missing("tree"))?,
            context: w.context.ok_or(SlotError::Missing("group context"))?,
            interim_transcript_hash: w
                .interim_transcript_hash
                .ok_or(SlotError::Missing("interim transcript hash"))?,
            confirmation_tag: w
                .confirmation_tag
                .ok_or(SlotError::Missing("confirmation tag"))?,
        })
    }

    fn read<T: serde::de::DeserializeOwned>(
        &self,
        what: &'static str,
        field: fn(&Records) -> &Vec<u8>,
    ) -> Result<Option<T>, SlotError> {
        let Some(source) = self.source else {
            return Ok(None);
        };
        let (value, rest) =
            postcard::take_from_bytes(field(source)).map_err(|e| SlotError::Decode(what, e))?;
        // A record is exactly one value: anything after it means the bytes are not ours.
        if !rest.is_empty() {
            return Err(SlotError::Trailing(what));
        }
        Ok(Some(value))
    }

    fn write<T: serde::Serialize>(
        &self,
        what: &'static str,
        value: &T,
        field: fn(&mut Written) -> &mut Option<Vec<u8>>,
    ) -> Result<(), SlotError> {
        let bytes = postcard::to_allocvec(value).map_err(|e| SlotError::Encode(what, e))?;
        *field(&mut self.written.borrow_mut()) = Some(bytes);
        Ok(())
    }
}

// The group id is ignored throughout: a slot holds one group.
impl PublicStorageProvider<CURRENT_VERSION> for Slot<'_> {
    type PublicError = SlotError;

    fn write_tree<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        TreeSync: traits::TreeSync<CURRENT_VERSION>,
    >(
        &self,
        _group_id: &GroupId,
        tree: &TreeSync,
    ) -> Result<(), SlotError> {
        self.write("tree", tree, |w| &mut w.tree)
    }

    fn write_interim_transcript_hash<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        InterimTranscriptHash: traits::InterimTranscriptHash<CURRENT_VERSION>,
    >(
        &self,
        _group_id: &GroupId,
        interim_transcript_hash: &InterimTranscriptHash,
    ) -> Result<(), SlotError> {
        self.write("interim transcript hash", interim_transcript_hash, |w| {
            &mut w.interim_transcript_hash
        })
    }

    fn write_context<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        GroupContext: traits::GroupContext<CURRENT_VERSION>,
    >(
        &self,
        _group_id: &GroupId,
        group_context: &GroupContext,
    ) -> Result<(), SlotError> {
        self.write("group context", group_context, |w| &mut w.context)
    }

    fn write_confirmation_tag<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        ConfirmationTag: traits::ConfirmationTag<CURRENT_VERSION>,
    >(
        &self,
        _group_id: &GroupId,
        confirmation_tag: &ConfirmationTag,
    ) -> Result<(), SlotError> {
        self.write("confirmation tag", confirmation_tag, |w| {
            &mut w.confirmation_tag
        })
    }

    /// Proposals live in the `PublicGroup`'s in-memory store for one check only.
    fn queue_proposal<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        ProposalRef: traits::ProposalRef<CURRENT_VERSION>,
        QueuedProposal: traits::QueuedProposal<CURRENT_VERSION>,
    >(
        &self,
        _group_id: &GroupId,
        _proposal_ref: &ProposalRef,
        _proposal: &QueuedProposal,
    ) -> Result<(), SlotError> {
        Ok(())
    }

    fn queued_proposals<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        ProposalRef: traits::ProposalRef<CURRENT_VERSION>,
        QueuedProposal: traits::QueuedProposal<CURRENT_VERSION>,
    >(
        &self,
        _group_id: &GroupId,
    ) -> Result<Vec<(ProposalRef, QueuedProposal)>, SlotError> {
        Ok(Vec::new())
    }

    fn tree<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        TreeSync: traits::TreeSync<CURRENT_VERSION>,
    >(
        &self,
        _group_id: &GroupId,
    ) -> Result<Option<TreeSync>, SlotError> {
        self.read("tree", |r| &r.tree)
    }

    fn group_context<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        GroupContext: traits::GroupContext<CURRENT_VERSION>,
    >(
        &self,
        _group_id: &GroupId,
    ) -> Result<Option<GroupContext>, SlotError> {
        self.read("group context", |r| &r.context)
    }

    fn interim_transcript_hash<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        InterimTranscriptHash: traits::InterimTranscriptHash<CURRENT_VERSION>,
    >(
        &self,
        _group_id: &GroupId,
    ) -> Result<Option<InterimTranscriptHash>, SlotError> {
        self.read("interim transcript hash", |r| &r.interim_transcript_hash)
    }

    fn confirmation_tag<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        ConfirmationTag: traits::ConfirmationTag<CURRENT_VERSION>,
    >(
        &self,
        _group_id: &GroupId,
    ) -> Result<Option<ConfirmationTag>, SlotError> {
        self.read("confirmation tag", |r| &r.confirmation_tag)
    }

    // OpenMLS deletes only when an application deletes a group; the relay never asks it to.
    fn delete_tree<GroupId: traits::GroupId<CURRENT_VERSION>>(
        &self,
        _group_id: &GroupId,
    ) -> Result<(), SlotError> {
        Ok(())
    }

    fn delete_confirmation_tag<GroupId: traits::GroupId<CURRENT_VERSION>>(
        &self,
        _group_id: &GroupId,
    ) -> Result<(), SlotError> {
        Ok(())
    }

    fn delete_context<GroupId: traits::GroupId<CURRENT_VERSION>>(
        &self,
        _group_id: &GroupId,
    ) -> Result<(), SlotError> {
        Ok(())
    }

    fn delete_interim_transcript_hash<GroupId: traits::GroupId<CURRENT_VERSION>>(
        &self,
        _group_id: &GroupId,
    ) -> Result<(), SlotError> {
        Ok(())
    }

    fn remove_proposal<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        ProposalRef: traits::ProposalRef<CURRENT_VERSION>,
    >(
        &self,
        _group_id: &GroupId,
        _proposal_ref: &ProposalRef,
    ) -> Result<(), SlotError> {
        Ok(())
    }

    fn clear_proposal_queue<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        ProposalRef: traits::ProposalRef<CURRENT_VERSION>,
    >(
        &self,
        _group_id: &GroupId,
    ) -> Result<(), SlotError> {
        Ok(())
    }
}
