//! STUB (replaced by the relay-group branch): a channel's public MLS group state.
#![allow(dead_code, unused_variables)]

#[derive(Debug)]
pub struct GroupState;

#[derive(Debug, Clone)]
pub struct LeafInfo {
    pub leaf_index: u32,
    pub identity: Vec<u8>,
    pub signature_key: Vec<u8>,
    pub encryption_key: Vec<u8>,
}

pub enum Handshake {
    Proposal { sender: u32 },
    Commit(CommitOutcome),
}

pub struct CommitOutcome {
    pub sender: u32,
    pub next: GroupState,
    pub removed: Vec<u32>,
    pub added: Vec<u32>,
}

#[derive(Debug, thiserror::Error)]
pub enum GroupError {
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Denied(String),
}

impl GroupError {
    pub fn is_permission_denied(&self) -> bool {
        matches!(self, GroupError::Denied(_))
    }
    pub fn is_internal(&self) -> bool {
        false
    }
}

impl GroupState {
    pub fn create(
        channel: &str,
        group_info: &[u8],
        ratchet_tree: &[u8],
    ) -> Result<GroupState, GroupError> {
        Err(GroupError::Invalid("stub".into()))
    }
    pub fn to_bytes(&self) -> Result<Vec<u8>, GroupError> {
        Ok(Vec::new())
    }
    pub fn from_bytes(bytes: &[u8]) -> Result<GroupState, GroupError> {
        Ok(GroupState)
    }
    pub fn epoch(&self) -> u64 {
        0
    }
    pub fn leaf(&self, index: u32) -> Option<LeafInfo> {
        None
    }
    pub fn members(&self) -> Vec<LeafInfo> {
        Vec::new()
    }
    pub fn check_handshake(
        &self,
        message: &[u8],
        proposals: &[&[u8]],
    ) -> Result<Handshake, GroupError> {
        Err(GroupError::Invalid("stub".into()))
    }
    pub fn verify_binding(
        &self,
        channel: &str,
        leaf_index: u32,
        account: &str,
        signature: &[u8],
    ) -> Result<(), GroupError> {
        Err(GroupError::Denied("stub".into()))
    }
}
