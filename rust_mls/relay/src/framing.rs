//! The cleartext header of RFC 9420 `MLSMessage`s: what the relay reads, and nothing more.
//! A port of `static/relay/_framing.py` (same rules, same texts in [`Malformed`]).
//!
//! STUB (interface fixed; bodies to be written).

/// RFC 9420 content types the relay tells apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentType {
    Application = 1,
    Proposal = 2,
    Commit = 3,
}

/// The cleartext header of a public (wire format 1) or private (2) message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessageHeader {
    pub wire_format: u16,
    pub group_id: Vec<u8>,
    pub epoch: u64,
    pub content_type: ContentType,
}

/// The cleartext part of a Welcome: its cipher suite and the KeyPackageRefs it is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WelcomeHeader {
    pub cipher_suite: u16,
    pub key_package_refs: Vec<Vec<u8>>,
}

/// The bytes are not an MLSMessage the relay accepts; the text says why (as in Python).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Malformed(pub String);

/// Read the header of a public or private `MLSMessage`.
pub fn parse_message(data: &[u8]) -> Result<MessageHeader, Malformed> {
    let _ = data;
    todo!("port of _framing.parse_message")
}

/// Read an `MLSMessage` holding a Welcome.
pub fn parse_welcome(data: &[u8]) -> Result<WelcomeHeader, Malformed> {
    let _ = data;
    todo!("port of _framing.parse_welcome")
}
