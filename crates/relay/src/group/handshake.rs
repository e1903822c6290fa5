//! Checking a handshake (a proposal or commit PublicMessage) against a channel's group state, as
//! a member would as far as public state allows, and making the state a commit leads to.
//!
//! Cost: the checks that need nothing but the message come first (parse, wire format, group,
//! epoch, sender leaf), then OpenMLS verifies the signature before it stages anything. Only a
//! commit that verified gets a copy of the group (loaded from the records: O(members)), on
//! which it is merged to make the next state; `self` never changes, because the commit may
//! still lose the epoch race to another.
//!
//! A commit that references proposals is first processed on `self`, whose proposal store is
//! empty: OpenMLS verifies its signature, then refuses it for the missing proposals. Only then
//! are the given proposals checked and put in the copy's store, and the commit processed again
//! there (a second signature check of the commit, cheaper than copying before knowing who
//! signed).

use std::collections::HashSet;

use openmls::prelude::tls_codec::Deserialize as _;
use openmls::prelude::{
    ContentType, LeafNodeIndex, MlsMessageBodyIn, MlsMessageIn, ProcessedMessageContent, Proposal,
    PublicGroup, PublicMessageIn, PublicProcessMessageError, QueuedProposal, Sender,
    StageCommitError, StagedCommit, ValidationError,
};

use super::slot::Slot;
use super::{crypto, load, GroupError, GroupState};

/// An accepted handshake.
#[derive(Debug)]
pub enum Handshake {
    /// A proposal by member leaf `sender`; the group does not change until a commit covers it.
    Proposal {
        sender: u32,
    },
    Commit(CommitOutcome),
}

/// An accepted commit.
#[derive(Debug)]
pub struct CommitOutcome {
    /// The committer's leaf.
    pub sender: u32,
    /// The state at the next epoch, once this commit is the one appended.
    pub next: GroupState,
    /// Leaves removed by the commit (Remove and SelfRemove proposals), ascending.
    pub removed: Vec<u32>,
    /// Leaves the commit's Add proposals fill, ascending.
    pub added: Vec<u32>,
}

/// The sender of a [`Framed`] proposal from the relay as external sender (no leaf).
const EXTERNAL: u32 = u32::MAX;

/// A handshake that passed the checks needing only the message.
struct Framed {
    message: PublicMessageIn,
    sender: u32,
    /// "commit" or "proposal", for the error texts.
    what: &'static str,
}

impl GroupState {
    /// Check `message` (an MLSMessage) as a handshake at this state's epoch: a PublicMessage
    /// (a PrivateMessage handshake is refused), from a current member leaf (external senders
    /// and new-member commits are refused), for this group and epoch, whose signature verifies
    /// with the sender leaf's key; a commit must apply (its proposals valid, its path valid, ...)
    /// and leave no two leaves with one identity.
    ///
    /// `proposals`: the proposal messages accepted at this epoch before `message`, in log
    /// order; a commit may reference them. One that no longer checks is skipped. Those may
    /// include the relay's own external proposals ([`GroupState::check_relay_proposal`]).
    pub fn check_handshake(
        &self,
        message: &[u8],
        proposals: &[&[u8]],
    ) -> Result<Handshake, GroupError> {
        self.check_handshake_within(message, proposals, usize::MAX)
    }

    /// [`GroupState::check_handshake`], refusing a commit that would leave the group with more
    /// than `max_members` members (counted once staged, before the next state is made).
    pub fn check_handshake_within(
        &self,
        message: &[u8],
        proposals: &[&[u8]],
        max_members: usize,
    ) -> Result<Handshake, GroupError> {
        let Framed {
            message: framed,
            sender,
            what,
        } = self.frame(message, false)?;
        let processed = match self.group.process_message(crypto(), framed) {
            Ok(processed) => processed,
            // OpenMLS stages only after the signature verified: the sender signed this commit.
            Err(PublicProcessMessageError::InvalidCommit(StageCommitError::MissingProposal))
                if !proposals.is_empty() =>
            {
                return self.commit_by_reference(message, proposals, max_members);
            }
            Err(err) => return Err(self.process_error(what, err)),
        };
        match processed.into_content() {
            ProcessedMessageContent::ProposalMessage(_) => Ok(Handshake::Proposal { sender }),
            ProcessedMessageContent::StagedCommitMessage(staged) => {
                let next = load(&self.records)?;
                self.finish_commit(sender, next, *staged, max_members)
            }
            _ => Err(GroupError::internal(
                "OpenMLS processed a member's handshake as something else",
            )),
        }
    }

    /// The checks that need only the message; cheap, no signature. `relay`: the message is one
    /// of the relay's own proposals (read back from the log), so an external sender is
    /// accepted (OpenMLS then checks it against the group's `external_senders`); a client's
    /// handshake from an external sender is refused.
    fn frame(&self, message: &[u8], relay: bool) -> Result<Framed, GroupError> {
        let message = MlsMessageIn::tls_deserialize_exact(message)
            .map_err(|e| GroupError::malformed("handshake", &e))?;
        let message = match message.extract() {
            MlsMessageBodyIn::PublicMessage(message) => message,
            MlsMessageBodyIn::PrivateMessage(_) => return Err(GroupError::NotPublic),
            MlsMessageBodyIn::Welcome(_) => return Err(GroupError::NotHandshake("a welcome")),
            MlsMessageBodyIn::GroupInfo(_) => return Err(GroupError::NotHandshake("a group info")),
            MlsMessageBodyIn::KeyPackage(_) => {
                return Err(GroupError::NotHandshake("a key package"))
            }
        };
        if message.group_id() != self.group.group_id() {
            return Err(GroupError::WrongGroup);
        }
        let what = match message.content_type() {
            ContentType::Commit => "commit",
            ContentType::Proposal => "proposal",
            ContentType::Application => {
                return Err(GroupError::NotHandshake("an application message"))
            }
        };
        if message.epoch().as_u64() != self.epoch() {
            return Err(GroupError::WrongEpoch {
                message: message.epoch().as_u64(),
                group: self.epoch(),
            });
        }
        let sender = match message.sender() {
            Sender::Member(leaf) => leaf.u32(),
            Sender::External(_) if relay && what == "proposal" => {
                return Ok(Framed {
                    message,
                    sender: EXTERNAL,
                    what,
                })
            }
            Sender::External(_) => return Err(GroupError::NotMemberSender("an external sender")),
            Sender::NewMemberProposal | Sender::NewMemberCommit => {
                return Err(GroupError::NotMemberSender("a new member"))
            }
        };
        if self.group.leaf(LeafNodeIndex::new(sender)).is_none() {
            return Err(GroupError::NotMember {
                epoch: self.epoch(),
            });
        }
        Ok(Framed {
            message,
            sender,
            what,
        })
    }

    /// A commit that references proposals, whose signature has verified on `self`.
    fn commit_by_reference(
        &self,
        message: &[u8],
        proposals: &[&[u8]],
        max_members: usize,
    ) -> Result<Handshake, GroupError> {
        let mut next = load(&self.records)?;
        // Writes of `add_proposal` go nowhere: the proposals live in `next`'s memory.
        let slot = Slot::empty();
        for proposal in proposals {
            if let Some(queued) = self.accepted_proposal(proposal) {
                next.add_proposal(&slot, queued)
                    .map_err(GroupError::internal)?;
            }
        }
        let Framed {
            message: framed,
            sender,
            what,
        } = self.frame(message, false)?;
        let processed = next
            .process_message(crypto(), framed)
            .map_err(|err| self.process_error(what, err))?;
        match processed.into_content() {
            ProcessedMessageContent::StagedCommitMessage(staged) => {
                self.finish_commit(sender, next, *staged, max_members)
            }
            _ => Err(GroupError::internal(
                "OpenMLS processed a commit as something else",
            )),
        }
    }

    /// Checks a proposal the relay made itself (as external sender) before it is logged: what
    /// a commit referencing it will find ([`GroupState::accepted_proposal`]).
    pub fn check_relay_proposal(&self, message: &[u8]) -> Result<(), GroupError> {
        let framed = self.frame(message, true)?;
        match self
            .group
            .process_message(crypto(), framed.message)
            .map_err(|err| self.process_error("proposal", err))?
            .into_content()
        {
            ProcessedMessageContent::ProposalMessage(_) => Ok(()),
            _ => Err(GroupError::internal(
                "OpenMLS processed the relay's proposal as something else",
            )),
        }
    }

    /// `bytes` as a proposal OpenMLS accepts at this state, or `None` (skipped).
    fn accepted_proposal(&self, bytes: &[u8]) -> Option<QueuedProposal> {
        let framed = self.frame(bytes, true).ok()?;
        match self
            .group
            .process_message(crypto(), framed.message)
            .ok()?
            .into_content()
        {
            ProcessedMessageContent::ProposalMessage(queued) => Some(*queued),
            _ => None,
        }
    }

    /// Merges `staged` (checked against this state) into `next` (a copy of this state).
    fn finish_commit(
        &self,
        sender: u32,
        mut next: PublicGroup,
        staged: StagedCommit,
        max_members: usize,
    ) -> Result<Handshake, GroupError> {
        let mut removed: Vec<u32> = staged
            .remove_proposals()
            .map(|remove| remove.remove_proposal().removed().u32())
            .chain(staged.queued_proposals().filter_map(|queued| {
                match (queued.proposal(), queued.sender()) {
                    (Proposal::SelfRemove, Sender::Member(leaf)) => Some(leaf.u32()),
                    _ => None,
                }
            }))
            .collect();
        removed.sort_unstable();
        removed.dedup();
        // OpenMLS does not say where added members land; their signature keys are unique in
        // the tree (it checks), so they find them.
        let added_keys: HashSet<Vec<u8>> = staged
            .add_proposals()
            .map(|add| {
                add.add_proposal()
                    .key_package()
                    .leaf_node()
                    .signature_key()
                    .as_slice()
                    .to_vec()
            })
            .collect();
        // Bounded before the next state is made (its copy is O(members)).
        let members = (self.member_count() + added_keys.len()).saturating_sub(removed.len());
        if members > max_members {
            return Err(GroupError::TooManyMembers {
                members,
                limit: max_members,
            });
        }
        let slot = Slot::empty();
        next.merge_commit(&slot, staged)
            .map_err(GroupError::internal)?;
        let records = slot.into_written().map_err(GroupError::internal)?;
        let next = GroupState {
            group: Box::new(next),
            records,
        };
        next.check_identities()?;
        let added = next
            .group
            .treesync()
            .full_leaves()
            .filter(|(_, leaf)| added_keys.contains(leaf.signature_key().as_slice()))
            .map(|(index, _)| index.u32())
            .collect();
        Ok(Handshake::Commit(CommitOutcome {
            sender,
            next,
            removed,
            added,
        }))
    }

    fn process_error(&self, what: &'static str, err: PublicProcessMessageError) -> GroupError {
        match err {
            PublicProcessMessageError::ValidationError(err) => match err {
                ValidationError::InvalidSignature => GroupError::BadSignature(what),
                ValidationError::UnknownMember => GroupError::NotMember {
                    epoch: self.epoch(),
                },
                ValidationError::WrongGroupId => GroupError::WrongGroup,
                ValidationError::LibraryError(e) => GroupError::internal(e),
                other => GroupError::not_applicable(what, other),
            },
            PublicProcessMessageError::InvalidCommit(err) => match err {
                StageCommitError::MissingProposal => GroupError::MissingProposal,
                StageCommitError::LibraryError(e) => GroupError::internal(e),
                other => GroupError::not_applicable(what, other),
            },
            PublicProcessMessageError::IncompatibleWireFormat => GroupError::NotPublic,
            PublicProcessMessageError::UnauthorizedExternalApplicationMessage
            | PublicProcessMessageError::UnauthorizedExternalCommitMessage
            | PublicProcessMessageError::UnsupportedProposalType => {
                GroupError::NotMemberSender("an external sender")
            }
            PublicProcessMessageError::LibraryError(e) => GroupError::internal(e),
        }
    }
}
