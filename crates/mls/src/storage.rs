//! The storage provider the engine gives OpenMLS: `openmls_sqlite_storage` (JSON codec, but for
//! the message secrets, see below) plus an optional *deferral* of the message secrets.
//!
//! OpenMLS rewrites the whole message-secrets store of a group (secret tree and the past
//! epochs' trees, JSON-encoded) after every message it encrypts or decrypts. Within one engine
//! transaction that handles a batch, only the last of those writes matters: with deferral on
//! ([`Storage::defer_message_secrets`]) a write only marks the group dirty, and the engine
//! writes the current store once before committing ([`Storage::end_deferral`] tells it to).
//! This is sound because OpenMLS reads the message secrets only when loading a group, which
//! the engine never does inside a deferring transaction (a read of a dirty group is refused
//! rather than answered with stale data), and because a transaction that fails is rolled back
//! whole. Without deferral every call goes straight through.
//!
//! The message secrets are also the one record written per message, so they are stored in a
//! compact binary encoding (postcard, behind [`BINARY_TAG`]) rather than the JSON of every
//! other record: about a quarter of the bytes (OpenMLS's byte strings are JSON arrays of
//! numbers) and far cheaper to encode and decode. Records written as JSON by earlier versions
//! are still read; the next write replaces them. Keys stay JSON, as the rest of the store has
//! them.

use std::cell::RefCell;

use openmls_sqlite_storage::SqliteStorageProvider;
use openmls_traits::storage::{traits, StorageProvider, CURRENT_VERSION};
use rusqlite::{Connection, OptionalExtension};

use crate::store::JsonCodec;

#[derive(Default)]
enum Deferral {
    /// Writes go through.
    #[default]
    Off,
    /// Writes of the message secrets are deferred; `dirty` holds the (encoded) id of the group
    /// whose write is owed, if any.
    On { dirty: Option<Vec<u8>> },
}

/// See the module docs. Built per transaction (cheap).
pub struct Storage<'a> {
    conn: &'a Connection,
    inner: SqliteStorageProvider<JsonCodec, &'a Connection>,
    deferral: RefCell<Deferral>,
}

fn key_of<K: serde::Serialize>(key: &K) -> Result<Vec<u8>, rusqlite::Error> {
    serde_json::to_vec(key).map_err(|e| rusqlite::Error::ToSqlConversionFailure(Box::new(e)))
}

/// Starts a binary (postcard) record; no JSON text starts with a NUL byte.
pub const BINARY_TAG: &[u8] = b"\0static-postcard-1\0";

/// The binary encoding of a record (see the module docs).
fn encode_binary<T: serde::Serialize>(value: &T) -> Result<Vec<u8>, rusqlite::Error> {
    postcard::to_extend(value, BINARY_TAG.to_vec())
        .map_err(|e| rusqlite::Error::ToSqlConversionFailure(Box::new(e)))
}

/// A record written by [`encode_binary`], or as JSON (earlier versions, the other records).
fn decode_record<T: serde::de::DeserializeOwned>(blob: &[u8]) -> Result<T, rusqlite::Error> {
    let conversion = |e: Box<dyn std::error::Error + Send + Sync>| {
        rusqlite::Error::FromSqlConversionFailure(0, rusqlite::types::Type::Blob, e)
    };
    match blob.strip_prefix(BINARY_TAG) {
        Some(binary) => postcard::from_bytes(binary).map_err(|e| conversion(Box::new(e))),
        None => serde_json::from_slice(blob).map_err(|e| conversion(Box::new(e))),
    }
}

// The row `openmls_sqlite_storage` keeps the message secrets in (its table, its data type name,
// its key encoding): the rest of the provider (deletion, a group's removal) finds it there.
const WRITE_MESSAGE_SECRETS: &str = "INSERT OR REPLACE INTO openmls_group_data \
     (group_id, data_type, group_data, provider_version) VALUES (?1, 'message_secrets', ?2, ?3)";
const READ_MESSAGE_SECRETS: &str = "SELECT group_data FROM openmls_group_data \
     WHERE group_id = ?1 AND data_type = 'message_secrets' AND provider_version = ?2";

impl<'a> Storage<'a> {
    pub fn new(conn: &'a Connection) -> Self {
        Self {
            conn,
            inner: SqliteStorageProvider::new(conn),
            deferral: RefCell::new(Deferral::Off),
        }
    }

    /// From now on, writes of the message secrets of one group are deferred until
    /// [`Storage::end_deferral`] (whose caller then owes that write).
    pub fn defer_message_secrets(&self) {
        let mut deferral = self.deferral.borrow_mut();
        if matches!(*deferral, Deferral::Off) {
            *deferral = Deferral::On { dirty: None };
        }
    }

    /// Stops deferring; `true` if a write of the message secrets was deferred and so must now
    /// be made (from the in-memory group) before the transaction commits.
    pub fn end_deferral(&self) -> bool {
        matches!(
            self.deferral.replace(Deferral::Off),
            Deferral::On { dirty: Some(_) }
        )
    }

    /// Whether the stored message secrets of `group_id` are stale (a write is owed).
    fn is_dirty(&self, key: &[u8]) -> bool {
        matches!(&*self.deferral.borrow(), Deferral::On { dirty: Some(k) } if k == key)
    }
}

impl StorageProvider<CURRENT_VERSION> for Storage<'_> {
    type Error = rusqlite::Error;

    fn write_message_secrets<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        MessageSecrets: traits::MessageSecrets<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
        message_secrets: &MessageSecrets,
    ) -> Result<(), Self::Error> {
        if let Deferral::On { dirty } = &mut *self.deferral.borrow_mut() {
            let key = key_of(group_id)?;
            match dirty {
                None => {
                    *dirty = Some(key);
                    return Ok(());
                }
                Some(k) if *k == key => return Ok(()),
                // Another group (the engine never does this): not deferred.
                Some(_) => {}
            }
        }
        let mut stmt = self.conn.prepare_cached(WRITE_MESSAGE_SECRETS)?;
        stmt.execute(rusqlite::params![
            key_of(group_id)?,
            encode_binary(message_secrets)?,
            CURRENT_VERSION
        ])?;
        Ok(())
    }

    fn message_secrets<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        MessageSecrets: traits::MessageSecrets<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
    ) -> Result<Option<MessageSecrets>, Self::Error> {
        if !matches!(*self.deferral.borrow(), Deferral::Off) && self.is_dirty(&key_of(group_id)?) {
            // The stored value is stale: refuse (the transaction fails and rolls back) rather
            // than hand out old secrets.
            return Err(rusqlite::Error::InvalidParameterName(
                "message secrets read while their write is deferred".into(),
            ));
        }
        let mut stmt = self.conn.prepare_cached(READ_MESSAGE_SECRETS)?;
        let blob: Option<Vec<u8>> = stmt
            .query_row(
                rusqlite::params![key_of(group_id)?, CURRENT_VERSION],
                |row| row.get(0),
            )
            .optional()?;
        blob.map(|b| decode_record(&b)).transpose()
    }

    fn delete_message_secrets<GroupId: traits::GroupId<CURRENT_VERSION>>(
        &self,
        group_id: &GroupId,
    ) -> Result<(), Self::Error> {
        if let Deferral::On { dirty } = &mut *self.deferral.borrow_mut() {
            if dirty.as_deref() == Some(key_of(group_id)?.as_slice()) {
                // Deleted: nothing owed any more.
                *dirty = None;
            }
        }
        self.inner.delete_message_secrets::<GroupId>(group_id)
    }

    // Everything else goes straight through.

    fn write_mls_join_config<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        MlsGroupJoinConfig: traits::MlsGroupJoinConfig<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
        config: &MlsGroupJoinConfig,
    ) -> Result<(), Self::Error> {
        self.inner
            .write_mls_join_config::<GroupId, MlsGroupJoinConfig>(group_id, config)
    }

    fn append_own_leaf_node<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        LeafNode: traits::LeafNode<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
        leaf_node: &LeafNode,
    ) -> Result<(), Self::Error> {
        self.inner
            .append_own_leaf_node::<GroupId, LeafNode>(group_id, leaf_node)
    }

    fn queue_proposal<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        ProposalRef: traits::ProposalRef<CURRENT_VERSION>,
        QueuedProposal: traits::QueuedProposal<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
        proposal_ref: &ProposalRef,
        proposal: &QueuedProposal,
    ) -> Result<(), Self::Error> {
        self.inner
            .queue_proposal::<GroupId, ProposalRef, QueuedProposal>(
                group_id,
                proposal_ref,
                proposal,
            )
    }

    fn write_tree<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        TreeSync: traits::TreeSync<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
        tree: &TreeSync,
    ) -> Result<(), Self::Error> {
        self.inner.write_tree::<GroupId, TreeSync>(group_id, tree)
    }

    fn write_interim_transcript_hash<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        InterimTranscriptHash: traits::InterimTranscriptHash<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
        interim_transcript_hash: &InterimTranscriptHash,
    ) -> Result<(), Self::Error> {
        self.inner
            .write_interim_transcript_hash::<GroupId, InterimTranscriptHash>(
                group_id,
                interim_transcript_hash,
            )
    }

    fn write_context<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        GroupContext: traits::GroupContext<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
        group_context: &GroupContext,
    ) -> Result<(), Self::Error> {
        self.inner
            .write_context::<GroupId, GroupContext>(group_id, group_context)
    }

    fn write_confirmation_tag<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        ConfirmationTag: traits::ConfirmationTag<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
        confirmation_tag: &ConfirmationTag,
    ) -> Result<(), Self::Error> {
        self.inner
            .write_confirmation_tag::<GroupId, ConfirmationTag>(group_id, confirmation_tag)
    }

    fn write_group_state<
        GroupState: traits::GroupState<CURRENT_VERSION>,
        GroupId: traits::GroupId<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
        group_state: &GroupState,
    ) -> Result<(), Self::Error> {
        self.inner
            .write_group_state::<GroupState, GroupId>(group_id, group_state)
    }

    fn write_resumption_psk_store<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        ResumptionPskStore: traits::ResumptionPskStore<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
        resumption_psk_store: &ResumptionPskStore,
    ) -> Result<(), Self::Error> {
        self.inner
            .write_resumption_psk_store::<GroupId, ResumptionPskStore>(
                group_id,
                resumption_psk_store,
            )
    }

    fn write_own_leaf_index<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        LeafNodeIndex: traits::LeafNodeIndex<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
        own_leaf_index: &LeafNodeIndex,
    ) -> Result<(), Self::Error> {
        self.inner
            .write_own_leaf_index::<GroupId, LeafNodeIndex>(group_id, own_leaf_index)
    }

    fn write_group_epoch_secrets<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        GroupEpochSecrets: traits::GroupEpochSecrets<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
        group_epoch_secrets: &GroupEpochSecrets,
    ) -> Result<(), Self::Error> {
        self.inner
            .write_group_epoch_secrets::<GroupId, GroupEpochSecrets>(group_id, group_epoch_secrets)
    }

    fn write_signature_key_pair<
        SignaturePublicKey: traits::SignaturePublicKey<CURRENT_VERSION>,
        SignatureKeyPair: traits::SignatureKeyPair<CURRENT_VERSION>,
    >(
        &self,
        public_key: &SignaturePublicKey,
        signature_key_pair: &SignatureKeyPair,
    ) -> Result<(), Self::Error> {
        self.inner
            .write_signature_key_pair::<SignaturePublicKey, SignatureKeyPair>(
                public_key,
                signature_key_pair,
            )
    }

    fn write_encryption_key_pair<
        EncryptionKey: traits::EncryptionKey<CURRENT_VERSION>,
        HpkeKeyPair: traits::HpkeKeyPair<CURRENT_VERSION>,
    >(
        &self,
        public_key: &EncryptionKey,
        key_pair: &HpkeKeyPair,
    ) -> Result<(), Self::Error> {
        self.inner
            .write_encryption_key_pair::<EncryptionKey, HpkeKeyPair>(public_key, key_pair)
    }

    fn write_encryption_epoch_key_pairs<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        EpochKey: traits::EpochKey<CURRENT_VERSION>,
        HpkeKeyPair: traits::HpkeKeyPair<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
        epoch: &EpochKey,
        leaf_index: u32,
        key_pairs: &[HpkeKeyPair],
    ) -> Result<(), Self::Error> {
        self.inner
            .write_encryption_epoch_key_pairs::<GroupId, EpochKey, HpkeKeyPair>(
                group_id, epoch, leaf_index, key_pairs,
            )
    }

    fn write_key_package<
        HashReference: traits::HashReference<CURRENT_VERSION>,
        KeyPackage: traits::KeyPackage<CURRENT_VERSION>,
    >(
        &self,
        hash_ref: &HashReference,
        key_package: &KeyPackage,
    ) -> Result<(), Self::Error> {
        self.inner
            .write_key_package::<HashReference, KeyPackage>(hash_ref, key_package)
    }

    fn write_psk<
        PskId: traits::PskId<CURRENT_VERSION>,
        PskBundle: traits::PskBundle<CURRENT_VERSION>,
    >(
        &self,
        psk_id: &PskId,
        psk: &PskBundle,
    ) -> Result<(), Self::Error> {
        self.inner.write_psk::<PskId, PskBundle>(psk_id, psk)
    }

    fn mls_group_join_config<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        MlsGroupJoinConfig: traits::MlsGroupJoinConfig<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
    ) -> Result<Option<MlsGroupJoinConfig>, Self::Error> {
        self.inner
            .mls_group_join_config::<GroupId, MlsGroupJoinConfig>(group_id)
    }

    fn own_leaf_nodes<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        LeafNode: traits::LeafNode<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
    ) -> Result<Vec<LeafNode>, Self::Error> {
        self.inner.own_leaf_nodes::<GroupId, LeafNode>(group_id)
    }

    fn queued_proposal_refs<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        ProposalRef: traits::ProposalRef<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
    ) -> Result<Vec<ProposalRef>, Self::Error> {
        self.inner
            .queued_proposal_refs::<GroupId, ProposalRef>(group_id)
    }

    fn queued_proposals<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        ProposalRef: traits::ProposalRef<CURRENT_VERSION>,
        QueuedProposal: traits::QueuedProposal<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
    ) -> Result<Vec<(ProposalRef, QueuedProposal)>, Self::Error> {
        self.inner
            .queued_proposals::<GroupId, ProposalRef, QueuedProposal>(group_id)
    }

    fn tree<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        TreeSync: traits::TreeSync<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
    ) -> Result<Option<TreeSync>, Self::Error> {
        self.inner.tree::<GroupId, TreeSync>(group_id)
    }

    fn group_context<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        GroupContext: traits::GroupContext<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
    ) -> Result<Option<GroupContext>, Self::Error> {
        self.inner.group_context::<GroupId, GroupContext>(group_id)
    }

    fn interim_transcript_hash<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        InterimTranscriptHash: traits::InterimTranscriptHash<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
    ) -> Result<Option<InterimTranscriptHash>, Self::Error> {
        self.inner
            .interim_transcript_hash::<GroupId, InterimTranscriptHash>(group_id)
    }

    fn confirmation_tag<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        ConfirmationTag: traits::ConfirmationTag<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
    ) -> Result<Option<ConfirmationTag>, Self::Error> {
        self.inner
            .confirmation_tag::<GroupId, ConfirmationTag>(group_id)
    }

    fn group_state<
        GroupState: traits::GroupState<CURRENT_VERSION>,
        GroupId: traits::GroupId<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
    ) -> Result<Option<GroupState>, Self::Error> {
        self.inner.group_state::<GroupState, GroupId>(group_id)
    }

    fn resumption_psk_store<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        ResumptionPskStore: traits::ResumptionPskStore<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
    ) -> Result<Option<ResumptionPskStore>, Self::Error> {
        self.inner
            .resumption_psk_store::<GroupId, ResumptionPskStore>(group_id)
    }

    fn own_leaf_index<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        LeafNodeIndex: traits::LeafNodeIndex<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
    ) -> Result<Option<LeafNodeIndex>, Self::Error> {
        self.inner
            .own_leaf_index::<GroupId, LeafNodeIndex>(group_id)
    }

    fn group_epoch_secrets<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        GroupEpochSecrets: traits::GroupEpochSecrets<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
    ) -> Result<Option<GroupEpochSecrets>, Self::Error> {
        self.inner
            .group_epoch_secrets::<GroupId, GroupEpochSecrets>(group_id)
    }

    fn signature_key_pair<
        SignaturePublicKey: traits::SignaturePublicKey<CURRENT_VERSION>,
        SignatureKeyPair: traits::SignatureKeyPair<CURRENT_VERSION>,
    >(
        &self,
        public_key: &SignaturePublicKey,
    ) -> Result<Option<SignatureKeyPair>, Self::Error> {
        self.inner
            .signature_key_pair::<SignaturePublicKey, SignatureKeyPair>(public_key)
    }

    fn encryption_key_pair<
        HpkeKeyPair: traits::HpkeKeyPair<CURRENT_VERSION>,
        EncryptionKey: traits::EncryptionKey<CURRENT_VERSION>,
    >(
        &self,
        public_key: &EncryptionKey,
    ) -> Result<Option<HpkeKeyPair>, Self::Error> {
        self.inner
            .encryption_key_pair::<HpkeKeyPair, EncryptionKey>(public_key)
    }

    fn encryption_epoch_key_pairs<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        EpochKey: traits::EpochKey<CURRENT_VERSION>,
        HpkeKeyPair: traits::HpkeKeyPair<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
        epoch: &EpochKey,
        leaf_index: u32,
    ) -> Result<Vec<HpkeKeyPair>, Self::Error> {
        self.inner
            .encryption_epoch_key_pairs::<GroupId, EpochKey, HpkeKeyPair>(
                group_id, epoch, leaf_index,
            )
    }

    fn key_package<
        KeyPackageRef: traits::HashReference<CURRENT_VERSION>,
        KeyPackage: traits::KeyPackage<CURRENT_VERSION>,
    >(
        &self,
        hash_ref: &KeyPackageRef,
    ) -> Result<Option<KeyPackage>, Self::Error> {
        self.inner
            .key_package::<KeyPackageRef, KeyPackage>(hash_ref)
    }

    fn psk<PskBundle: traits::PskBundle<CURRENT_VERSION>, PskId: traits::PskId<CURRENT_VERSION>>(
        &self,
        psk_id: &PskId,
    ) -> Result<Option<PskBundle>, Self::Error> {
        self.inner.psk::<PskBundle, PskId>(psk_id)
    }

    fn remove_proposal<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        ProposalRef: traits::ProposalRef<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
        proposal_ref: &ProposalRef,
    ) -> Result<(), Self::Error> {
        self.inner
            .remove_proposal::<GroupId, ProposalRef>(group_id, proposal_ref)
    }

    fn delete_own_leaf_nodes<GroupId: traits::GroupId<CURRENT_VERSION>>(
        &self,
        group_id: &GroupId,
    ) -> Result<(), Self::Error> {
        self.inner.delete_own_leaf_nodes::<GroupId>(group_id)
    }

    fn delete_group_config<GroupId: traits::GroupId<CURRENT_VERSION>>(
        &self,
        group_id: &GroupId,
    ) -> Result<(), Self::Error> {
        self.inner.delete_group_config::<GroupId>(group_id)
    }

    fn delete_tree<GroupId: traits::GroupId<CURRENT_VERSION>>(
        &self,
        group_id: &GroupId,
    ) -> Result<(), Self::Error> {
        self.inner.delete_tree::<GroupId>(group_id)
    }

    fn delete_confirmation_tag<GroupId: traits::GroupId<CURRENT_VERSION>>(
        &self,
        group_id: &GroupId,
    ) -> Result<(), Self::Error> {
        self.inner.delete_confirmation_tag::<GroupId>(group_id)
    }

    fn delete_group_state<GroupId: traits::GroupId<CURRENT_VERSION>>(
        &self,
        group_id: &GroupId,
    ) -> Result<(), Self::Error> {
        self.inner.delete_group_state::<GroupId>(group_id)
    }

    fn delete_context<GroupId: traits::GroupId<CURRENT_VERSION>>(
        &self,
        group_id: &GroupId,
    ) -> Result<(), Self::Error> {
        self.inner.delete_context::<GroupId>(group_id)
    }

    fn delete_interim_transcript_hash<GroupId: traits::GroupId<CURRENT_VERSION>>(
        &self,
        group_id: &GroupId,
    ) -> Result<(), Self::Error> {
        self.inner
            .delete_interim_transcript_hash::<GroupId>(group_id)
    }

    fn delete_all_resumption_psk_secrets<GroupId: traits::GroupId<CURRENT_VERSION>>(
        &self,
        group_id: &GroupId,
    ) -> Result<(), Self::Error> {
        self.inner
            .delete_all_resumption_psk_secrets::<GroupId>(group_id)
    }

    fn delete_own_leaf_index<GroupId: traits::GroupId<CURRENT_VERSION>>(
        &self,
        group_id: &GroupId,
    ) -> Result<(), Self::Error> {
        self.inner.delete_own_leaf_index::<GroupId>(group_id)
    }

    fn delete_group_epoch_secrets<GroupId: traits::GroupId<CURRENT_VERSION>>(
        &self,
        group_id: &GroupId,
    ) -> Result<(), Self::Error> {
        self.inner.delete_group_epoch_secrets::<GroupId>(group_id)
    }

    fn clear_proposal_queue<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        ProposalRef: traits::ProposalRef<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
    ) -> Result<(), Self::Error> {
        self.inner
            .clear_proposal_queue::<GroupId, ProposalRef>(group_id)
    }

    fn delete_signature_key_pair<
        SignaturePublicKey: traits::SignaturePublicKey<CURRENT_VERSION>,
    >(
        &self,
        public_key: &SignaturePublicKey,
    ) -> Result<(), Self::Error> {
        self.inner
            .delete_signature_key_pair::<SignaturePublicKey>(public_key)
    }

    fn delete_encryption_key_pair<EncryptionKey: traits::EncryptionKey<CURRENT_VERSION>>(
        &self,
        public_key: &EncryptionKey,
    ) -> Result<(), Self::Error> {
        self.inner
            .delete_encryption_key_pair::<EncryptionKey>(public_key)
    }

    fn delete_encryption_epoch_key_pairs<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        EpochKey: traits::EpochKey<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
        epoch: &EpochKey,
        leaf_index: u32,
    ) -> Result<(), Self::Error> {
        self.inner
            .delete_encryption_epoch_key_pairs::<GroupId, EpochKey>(group_id, epoch, leaf_index)
    }

    fn delete_key_package<KeyPackageRef: traits::HashReference<CURRENT_VERSION>>(
        &self,
        hash_ref: &KeyPackageRef,
    ) -> Result<(), Self::Error> {
        self.inner.delete_key_package::<KeyPackageRef>(hash_ref)
    }

    fn delete_psk<PskKey: traits::PskId<CURRENT_VERSION>>(
        &self,
        psk_id: &PskKey,
    ) -> Result<(), Self::Error> {
        self.inner.delete_psk::<PskKey>(psk_id)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::collections::VecDeque;
    use std::time::SystemTime;

    use openmls::group::GroupId;
    use openmls_traits::storage::Entity;

    use super::*;

    /// A stand-in with the shapes OpenMLS's message secrets have (byte strings, an optional
    /// timestamp, a queue of past epochs).
    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Secrets {
        sender_data_secret: Vec<u8>,
        added_at: Option<SystemTime>,
        past_epochs: VecDeque<(u64, Vec<u8>)>,
    }
    impl Entity<CURRENT_VERSION> for Secrets {}
    impl traits::MessageSecrets<CURRENT_VERSION> for Secrets {}

    fn database() -> Connection {
        let mut conn = Connection::open_in_memory().unwrap();
        SqliteStorageProvider::<JsonCodec, &mut Connection>::new(&mut conn)
            .run_migrations()
            .unwrap();
        conn
    }

    fn secrets() -> Secrets {
        Secrets {
            sender_data_secret: (0..=255).collect(),
            added_at: Some(SystemTime::now()),
            past_epochs: VecDeque::from([(7, vec![1; 32]), (8, vec![2; 32])]),
        }
    }

    /// Runs `test` on a fresh in-memory store, our wrapper over it and the group it writes for.
    fn with_storage(test: impl FnOnce(&Connection, &Storage<'_>, &GroupId)) {
        let conn = database();
        let storage = Storage::new(&conn);
        test(&conn, &storage, &GroupId::from_slice(b"org/ns/svc"));
    }

    fn stored_blob(conn: &Connection) -> Vec<u8> {
        conn.query_row(
            "SELECT group_data FROM openmls_group_data WHERE data_type = 'message_secrets'",
            [],
            |row| row.get(0),
        )
        .unwrap()
    }

    #[test]
    fn message_secrets_are_stored_binary_and_read_back() {
        with_storage(|conn, storage, group| {
            let value = secrets();
            storage.write_message_secrets(group, &value).unwrap();

            let blob = stored_blob(conn);
            assert!(blob.starts_with(BINARY_TAG));
            let json = serde_json::to_vec(&value).unwrap();
            assert!(
                blob.len() * 2 < json.len(),
                "{} vs {} bytes",
                blob.len(),
                json.len()
            );
            assert_eq!(
                storage.message_secrets::<_, Secrets>(group).unwrap(),
                Some(value)
            );

            // The provider's own deletion finds the row where it keeps it.
            storage.delete_message_secrets(group).unwrap();
            assert_eq!(storage.message_secrets::<_, Secrets>(group).unwrap(), None);
        });
    }

    #[test]
    fn message_secrets_written_as_json_by_earlier_versions_are_read_then_replaced() {
        with_storage(|conn, storage, group| {
            let value = secrets();
            // As every version before the binary encoding wrote them.
            storage.inner.write_message_secrets(group, &value).unwrap();
            assert!(stored_blob(conn).starts_with(b"{"));
            assert_eq!(
                storage.message_secrets::<_, Secrets>(group).unwrap(),
                Some(value)
            );

            let next = Secrets {
                past_epochs: VecDeque::new(),
                ..secrets()
            };
            storage.write_message_secrets(group, &next).unwrap();
            assert!(stored_blob(conn).starts_with(BINARY_TAG));
            assert_eq!(
                storage.message_secrets::<_, Secrets>(group).unwrap(),
                Some(next)
            );
        });
    }

    #[test]
    fn a_damaged_binary_record_is_an_error_not_a_panic() {
        with_storage(|conn, storage, group| {
            storage.write_message_secrets(group, &secrets()).unwrap();
            let mut blob = stored_blob(conn);
            blob.truncate(BINARY_TAG.len() + 10);
            conn.execute(
                "UPDATE openmls_group_data SET group_data = ?1 WHERE data_type = 'message_secrets'",
                [blob],
            )
            .unwrap();
            assert!(storage.message_secrets::<_, Secrets>(group).is_err());
        });
    }
}
