//! Why the relay refused a channel's group state, a handshake or a leaf binding, and which kind
//! of refusal that is ([`GroupError::kind`]; the service maps kinds to gRPC codes).

use openmls::prelude::tls_codec;

/// How a [`GroupError`] is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The input is wrong whoever sends it: gRPC INVALID_ARGUMENT.
    InvalidArgument,
    /// The sender may not do this (not a member, or not who it claims): PERMISSION_DENIED.
    PermissionDenied,
    /// A bug, or stored state that does not read back: INTERNAL.
    Internal,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GroupError {
    /// The bytes do not parse as `what`.
    #[error("the {what} is malformed: {detail}")]
    Malformed { what: &'static str, detail: String },
    /// An MLSMessage of another wire format where a GroupInfo was expected.
    #[error("expected a group_info MLSMessage, got a {0}")]
    NotGroupInfo(&'static str),
    #[error("handshake messages must be PublicMessages")]
    NotPublic,
    /// An MLSMessage that is not a handshake (a welcome, key package, group info, or an
    /// application message framed as a PublicMessage).
    #[error("{0} is not a handshake message")]
    NotHandshake(&'static str),
    #[error("the message is for another group than this channel's")]
    WrongGroup,
    #[error("the group info is at epoch {0}; a new channel's group must be at epoch 0")]
    NotNewGroup(u64),
    #[error("the group's cipher suite is {0:#06x}; the relay accepts only {1:#06x}")]
    WrongCiphersuite(u16, u16),
    /// CreateChannel with a tree of more than its creator's leaf (RFC 9420 §11: a group
    /// starts with one member).
    #[error("a new channel's group must hold its creator alone (RFC 9420 §11; the others are added by commits); this tree holds {leaves} leaves")]
    NotAlone { leaves: usize },
    /// A commit that would take the group past the relay's bound on members.
    #[error(
        "the commit would make the group {members} members; this relay allows at most {limit}"
    )]
    TooManyMembers { members: usize, limit: usize },
    /// CreateChannel without a tree: neither given nor in the GroupInfo.
    #[error("no ratchet tree: give one or put the ratchet_tree extension in the group info")]
    NoRatchetTree,
    /// The GroupInfo and tree do not make a valid group (tree, signature, hash).
    #[error("the group info is not valid: {0}")]
    InvalidGroupInfo(String),
    /// A handshake for an epoch other than the group's (the relay's epoch fence normally
    /// refuses these before).
    #[error("the message is for epoch {message}, the group is at epoch {group}")]
    WrongEpoch { message: u64, group: u64 },
    /// The commit references a proposal not among those given.
    #[error("the commit references a proposal that was not accepted at this epoch")]
    MissingProposal,
    /// The handshake is well formed and signed, but does not apply to the group.
    #[error("the {what} does not apply: {detail}")]
    NotApplicable { what: &'static str, detail: String },
    /// After the commit (or at creation) two leaves would hold one identity.
    #[error("identity {identity:?} would be held by leaves {first} and {second}")]
    DuplicateIdentity {
        identity: String,
        first: u32,
        second: u32,
    },
    /// A sender that is not a member leaf (an external sender, a new member).
    #[error("{0} may not send handshakes; only members may")]
    NotMemberSender(&'static str),
    #[error("the sender is not a member of the group at epoch {epoch}")]
    NotMember { epoch: u64 },
    /// A binding for a leaf that is blank or outside the tree.
    #[error("leaf {leaf} is not a member of the group at epoch {epoch}")]
    NoSuchLeaf { leaf: u32, epoch: u64 },
    #[error("the {0}'s signature does not verify")]
    BadSignature(&'static str),
    #[error("the leaf binding does not verify for leaf {leaf} and this account")]
    BadBinding { leaf: u32 },
    /// A bug, or stored state that does not read back; the text is for logs.
    #[error("internal error: {0}")]
    Internal(String),
}

impl GroupError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            GroupError::Malformed { .. }
            | GroupError::NotGroupInfo(_)
            | GroupError::NotPublic
            | GroupError::NotHandshake(_)
            | GroupError::WrongGroup
            | GroupError::NotNewGroup(_)
            | GroupError::WrongCiphersuite(..)
            | GroupError::NoRatchetTree
            | GroupError::NotAlone { .. }
            | GroupError::TooManyMembers { .. }
            | GroupError::InvalidGroupInfo(_)
            | GroupError::WrongEpoch { .. }
            | GroupError::MissingProposal
            | GroupError::NotApplicable { .. }
            | GroupError::DuplicateIdentity { .. } => ErrorKind::InvalidArgument,
            GroupError::NotMemberSender(_)
            | GroupError::NotMember { .. }
            | GroupError::NoSuchLeaf { .. }
            | GroupError::BadSignature(_)
            | GroupError::BadBinding { .. } => ErrorKind::PermissionDenied,
            GroupError::Internal(_) => ErrorKind::Internal,
        }
    }

    pub fn is_invalid_argument(&self) -> bool {
        self.kind() == ErrorKind::InvalidArgument
    }

    pub fn is_permission_denied(&self) -> bool {
        self.kind() == ErrorKind::PermissionDenied
    }

    pub fn is_internal(&self) -> bool {
        self.kind() == ErrorKind::Internal
    }

    /// `what` does not decode (TLS presentation language, RFC 8446 §3).
    pub(crate) fn malformed(what: &'static str, err: &tls_codec::Error) -> GroupError {
        // tls_codec's Display is its Debug ("EndOfStream").
        let detail = match err {
            tls_codec::Error::EndOfStream => "it is truncated".to_string(),
            tls_codec::Error::TrailingData => "bytes follow its end".to_string(),
            tls_codec::Error::UnknownValue(value) => {
                format!("unknown value {value} (of a version, wire format or type)")
            }
            tls_codec::Error::InvalidVectorLength => "a length is invalid".to_string(),
            tls_codec::Error::InvalidInput => "an integer is invalid".to_string(),
            tls_codec::Error::DecodingError(text) => lower(text),
            other => other.to_string(),
        };
        GroupError::Malformed { what, detail }
    }

    pub(crate) fn not_applicable(what: &'static str, err: impl std::fmt::Display) -> GroupError {
        GroupError::NotApplicable {
            what,
            detail: lower(&err.to_string()),
        }
    }

    pub(crate) fn internal(err: impl std::fmt::Display) -> GroupError {
        GroupError::Internal(err.to_string())
    }
}

/// OpenMLS's texts ("Verifying the signature failed.") as a clause of ours.
pub(super) fn lower(text: &str) -> String {
    let text = text.trim_end_matches('.');
    let first_word = text.split(' ').next().unwrap_or_default();
    match first_word.chars().next() {
        // Keep names and acronyms ("KeyPackage", "MLS") as they are.
        Some(first) if !first_word.chars().skip(1).any(char::is_uppercase) => first
            .to_lowercase()
            .chain(text[first.len_utf8()..].chars())
            .collect(),
        _ => text.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openmls_texts_become_clauses() {
        assert_eq!(
            lower("Verifying the signature failed."),
            "verifying the signature failed"
        );
        assert_eq!(lower("MLS version mismatch"), "MLS version mismatch");
        assert_eq!(lower("KeyPackage expired"), "KeyPackage expired");
        assert_eq!(lower(""), "");
    }

    #[test]
    fn decoding_errors_say_what_was_wrong() {
        let text = |e| GroupError::malformed("handshake", &e).to_string();
        assert_eq!(
            text(tls_codec::Error::EndOfStream),
            "the handshake is malformed: it is truncated"
        );
        assert_eq!(
            text(tls_codec::Error::UnknownValue(9)),
            "the handshake is malformed: unknown value 9 (of a version, wire format or type)"
        );
    }

    #[test]
    fn kinds() {
        assert!(GroupError::NotPublic.is_invalid_argument());
        assert!(GroupError::NotMember { epoch: 4 }.is_permission_denied());
        assert!(GroupError::BadSignature("commit").is_permission_denied());
        assert!(GroupError::internal("x").is_internal());
        assert_eq!(
            GroupError::NotMember { epoch: 4 }.to_string(),
            "the sender is not a member of the group at epoch 4"
        );
        assert_eq!(
            GroupError::BadSignature("commit").to_string(),
            "the commit's signature does not verify"
        );
    }
}
