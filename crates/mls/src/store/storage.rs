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
//! other record (the ratchet tree too, the largest record, which every commit rewrites): about a quarter of the bytes (OpenMLS's byte strings are JSON arrays of
//! numbers) and far cheaper to encode and decode. Records written as JSON by earlier versions
//! are still read; the next write replaces them. Keys stay JSON, as the rest of the store has
//! them.
//!
//! # Only what changed
//!
//! OpenMLS's message-secrets record (`MessageSecretsStore`) holds the current epoch's secret
//! tree and, for each of the [`crate::suite::PAST_EPOCHS`] past epochs kept, its secret tree
//! *and the whole member list of that epoch*. At N=512, after a few commits, that is 218 KB,
//! rewritten (and encoded) on every message: the per-message cost grew with the group
//! (encrypt 0.30 ms at N=2, 1.12 ms at N=512). Yet a message of the current epoch changes only
//! the current epoch's secrets (OpenMLS's `message_secrets_for_epoch_mut`: an epoch at or after
//! the group's is the current one), 2.7 KB at N=512.
//!
//! So the record is stored in two parts ([`SPLIT_TAG`]): the current epoch's secrets in
//! OpenMLS's row, and the rest (`max_epochs`, the past epochs) in `static_message_secrets_past`.
//! postcard encodes a struct as its fields one after the other, so the record is the past
//! part followed by the current part, and is read back by concatenating them. A write in
//! [`Scope::CurrentEpoch`] (the engine sets it around encrypting, and around decrypting an
//! application message of the current epoch) encodes and updates only the current part, in
//! place; every other write (commits, past-epoch messages, policy changes) stores both, as one
//! write did before. Both parts are written in the caller's transaction, so crash safety is
//! unchanged. A value of another shape (the field names are checked as it is encoded) is
//! stored whole, as before.

use std::cell::{Cell, RefCell};

use openmls_sqlite_storage::SqliteStorageProvider;
use openmls_traits::storage::{traits, StorageProvider, CURRENT_VERSION};
use rusqlite::{Connection, OptionalExtension};

use openmls_sqlite_storage::Codec;

/// The serde codec for OpenMLS's stored values (JSON, as OpenMLS's own storage tests use); the
/// message secrets are the exception (see [`crate::store::storage`]).
#[derive(Default)]
pub struct JsonCodec;

impl Codec for JsonCodec {
    type Error = serde_json::Error;

    fn to_vec<T: serde::Serialize>(value: &T) -> Result<Vec<u8>, Self::Error> {
        serde_json::to_vec(value)
    }

    fn from_slice<T: serde::de::DeserializeOwned>(slice: &[u8]) -> Result<T, Self::Error> {
        serde_json::from_slice(slice)
    }
}

#[derive(Default)]
enum Deferral {
    /// Writes go through.
    #[default]
    Off,
    /// Writes of the message secrets are deferred; `dirty` holds the (encoded) id of the group
    /// whose write is owed, if any, and what the deferred writes changed (the widest scope).
    On { dirty: Option<(Vec<u8>, Scope)> },
}

/// What the operation writing the message secrets may have changed in them (see the module
/// docs). The engine narrows it with [`Storage::scoped`] where it knows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Scope {
    /// Anything: both parts are written.
    #[default]
    All,
    /// Only the current epoch's secrets (a message of the current epoch): the past part, as
    /// stored, is still right.
    CurrentEpoch,
}

impl Scope {
    fn widest(self, other: Scope) -> Scope {
        if self == Scope::All || other == Scope::All {
            Scope::All
        } else {
            Scope::CurrentEpoch
        }
    }
}

/// Puts the storage's scope back to [`Scope::All`] when dropped (see [`Storage::scoped`]).
pub struct ScopeGuard<'s> {
    scope: &'s Cell<Scope>,
}

impl Drop for ScopeGuard<'_> {
    fn drop(&mut self) {
        self.scope.set(Scope::All);
    }
}

/// See the module docs. Built per transaction (cheap).
pub struct Storage<'a> {
    conn: &'a Connection,
    inner: SqliteStorageProvider<JsonCodec, &'a Connection>,
    deferral: RefCell<Deferral>,
    scope: Cell<Scope>,
}

fn key_of<K: serde::Serialize>(key: &K) -> Result<Vec<u8>, rusqlite::Error> {
    serde_json::to_vec(key).map_err(|e| rusqlite::Error::ToSqlConversionFailure(Box::new(e)))
}

/// Starts a binary (postcard) record; no JSON text starts with a NUL byte.
pub const BINARY_TAG: &[u8] = b"\0static-postcard-1\0";

/// Starts the current-epoch part of message secrets stored in two parts (see the module docs);
/// the rest is in `static_message_secrets_past`.
pub const SPLIT_TAG: &[u8] = b"\0static-postcard-split-1\0";

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
// In place (same row, same size at the same group size): one page, no index change, where the
// REPLACE above deletes the row and appends it under a new rowid.
const UPDATE_MESSAGE_SECRETS: &str = "UPDATE openmls_group_data SET group_data = ?2, \
     provider_version = ?3 WHERE group_id = ?1 AND data_type = 'message_secrets'";
// The current part only, where the stored record is split (else nothing: a full write follows).
const UPDATE_CURRENT_PART: &str = "UPDATE openmls_group_data SET group_data = ?2 \
     WHERE group_id = ?1 AND data_type = 'message_secrets' AND provider_version = ?3 \
     AND substr(group_data, 1, ?4) = ?5";
const WRITE_PAST_PART: &str =
    "INSERT OR REPLACE INTO static_message_secrets_past (group_id, data) VALUES (?1, ?2)";
const WRITE_TREE: &str = "INSERT INTO openmls_group_data \
     (group_id, data_type, group_data, provider_version) VALUES (?1, 'tree', ?2, ?3)";
const UPDATE_TREE: &str = "UPDATE openmls_group_data SET group_data = ?2, provider_version = ?3 \
     WHERE group_id = ?1 AND data_type = 'tree'";
const READ_TREE: &str = "SELECT group_data FROM openmls_group_data \
     WHERE group_id = ?1 AND data_type = 'tree' AND provider_version = ?2";
const READ_PAST_PART: &str = "SELECT data FROM static_message_secrets_past WHERE group_id = ?1";
const DELETE_PAST_PART: &str = "DELETE FROM static_message_secrets_past WHERE group_id = ?1";

/// The fields of OpenMLS's `MessageSecretsStore`, in their order: the past part is all but the
/// last.
const STORE_NAME: &str = "MessageSecretsStore";
const STORE_FIELDS: [&str; 3] = ["max_epochs", "past_epoch_trees", "message_secrets"];

/// The two parts of the message secrets (see the module docs), each postcard-encoded; `past`
/// is empty when it was not asked for.
struct Parts {
    past: Vec<u8>,
    current: Vec<u8>,
}

/// Encodes the parts of `value` (the past one only if `want_past`); `None` if `value` is not
/// shaped as OpenMLS's `MessageSecretsStore`.
fn split<T: serde::Serialize + ?Sized>(
    value: &T,
    want_past: bool,
) -> Result<Option<Parts>, rusqlite::Error> {
    match value.serialize(split::Splitter { want_past }) {
        Ok(parts) => Ok(parts),
        Err(split::SplitError::Shape) => Ok(None),
        Err(e) => Err(rusqlite::Error::ToSqlConversionFailure(Box::new(e))),
    }
}

/// A serializer that only takes OpenMLS's `MessageSecretsStore` struct and encodes its fields
/// into the two parts.
mod split {
    use serde::ser::{Impossible, Serialize, SerializeStruct, Serializer};

    use super::{Parts, STORE_FIELDS, STORE_NAME};

    #[derive(Debug, thiserror::Error)]
    pub(super) enum SplitError {
        #[error("not shaped as the message secrets store")]
        Shape,
        #[error("encoding the message secrets: {0}")]
        Encode(#[from] postcard::Error),
        #[error("encoding the message secrets: {0}")]
        Custom(String),
    }

    impl serde::ser::Error for SplitError {
        fn custom<T: std::fmt::Display>(msg: T) -> Self {
            SplitError::Custom(msg.to_string())
        }
    }

    pub(super) struct Splitter {
        pub(super) want_past: bool,
    }

    pub(super) struct Fields {
        want_past: bool,
        seen: usize,
        shape_ok: bool,
        parts: Parts,
    }

    impl SerializeStruct for Fields {
        type Ok = Option<Parts>;
        type Error = SplitError;

        fn serialize_field<T: Serialize + ?Sized>(
            &mut self,
            key: &'static str,
            value: &T,
        ) -> Result<(), SplitError> {
            let expected = STORE_FIELDS.get(self.seen).copied();
            self.seen += 1;
            if expected != Some(key) {
                self.shape_ok = false;
            }
            if !self.shape_ok {
                return Ok(());
            }
            if self.seen == STORE_FIELDS.len() {
                let current = std::mem::take(&mut self.parts.current);
                self.parts.current = postcard::to_extend(value, current)?;
            } else if self.want_past {
                let past = std::mem::take(&mut self.parts.past);
                self.parts.past = postcard::to_extend(value, past)?;
            }
            Ok(())
        }

        fn end(self) -> Result<Option<Parts>, SplitError> {
            Ok((self.shape_ok && self.seen == STORE_FIELDS.len()).then_some(self.parts))
        }
    }

    macro_rules! not_the_store {
        ($($name:ident($($arg:ty),*) -> $ret:ty;)*) => {
            $(fn $name(self, $(_: $arg),*) -> Result<$ret, SplitError> {
                Err(SplitError::Shape)
            })*
        };
    }

    impl Serializer for Splitter {
        type Ok = Option<Parts>;
        type Error = SplitError;
        type SerializeSeq = Impossible<Option<Parts>, SplitError>;
        type SerializeTuple = Impossible<Option<Parts>, SplitError>;
        type SerializeTupleStruct = Impossible<Option<Parts>, SplitError>;
        type SerializeTupleVariant = Impossible<Option<Parts>, SplitError>;
        type SerializeMap = Impossible<Option<Parts>, SplitError>;
        type SerializeStruct = Fields;
        type SerializeStructVariant = Impossible<Option<Parts>, SplitError>;

        fn serialize_struct(self, name: &'static str, len: usize) -> Result<Fields, SplitError> {
            Ok(Fields {
                want_past: self.want_past,
                seen: 0,
                shape_ok: name == STORE_NAME && len == STORE_FIELDS.len(),
                parts: Parts {
                    past: Vec::new(),
                    current: Vec::new(),
                },
            })
        }

        fn serialize_some<T: Serialize + ?Sized>(self, _: &T) -> Result<Self::Ok, SplitError> {
            Err(SplitError::Shape)
        }

        fn serialize_newtype_struct<T: Serialize + ?Sized>(
            self,
            _: &'static str,
            _: &T,
        ) -> Result<Self::Ok, SplitError> {
            Err(SplitError::Shape)
        }

        fn serialize_newtype_variant<T: Serialize + ?Sized>(
            self,
            _: &'static str,
            _: u32,
            _: &'static str,
            _: &T,
        ) -> Result<Self::Ok, SplitError> {
            Err(SplitError::Shape)
        }

        not_the_store! {
            serialize_bool(bool) -> Self::Ok;
            serialize_i8(i8) -> Self::Ok;
            serialize_i16(i16) -> Self::Ok;
            serialize_i32(i32) -> Self::Ok;
            serialize_i64(i64) -> Self::Ok;
            serialize_u8(u8) -> Self::Ok;
            serialize_u16(u16) -> Self::Ok;
            serialize_u32(u32) -> Self::Ok;
            serialize_u64(u64) -> Self::Ok;
            serialize_f32(f32) -> Self::Ok;
            serialize_f64(f64) -> Self::Ok;
            serialize_char(char) -> Self::Ok;
            serialize_str(&str) -> Self::Ok;
            serialize_bytes(&[u8]) -> Self::Ok;
            serialize_none() -> Self::Ok;
            serialize_unit() -> Self::Ok;
            serialize_unit_struct(&'static str) -> Self::Ok;
            serialize_unit_variant(&'static str, u32, &'static str) -> Self::Ok;
            serialize_seq(Option<usize>) -> Self::SerializeSeq;
            serialize_tuple(usize) -> Self::SerializeTuple;
            serialize_tuple_struct(&'static str, usize) -> Self::SerializeTupleStruct;
            serialize_tuple_variant(&'static str, u32, &'static str, usize) -> Self::SerializeTupleVariant;
            serialize_map(Option<usize>) -> Self::SerializeMap;
            serialize_struct_variant(&'static str, u32, &'static str, usize) -> Self::SerializeStructVariant;
        }
    }
}

impl<'a> Storage<'a> {
    pub fn new(conn: &'a Connection) -> Self {
        Self {
            conn,
            inner: SqliteStorageProvider::new(conn),
            deferral: RefCell::new(Deferral::Off),
            scope: Cell::new(Scope::All),
        }
    }

    /// Until the guard is dropped, writes of the message secrets may assume only what `scope`
    /// says changed (see the module docs). The caller must know it: a write that assumed too
    /// little would leave stale past secrets on disk.
    pub fn scoped(&self, scope: Scope) -> ScopeGuard<'_> {
        self.scope.set(scope);
        ScopeGuard { scope: &self.scope }
    }

    /// From now on, writes of the message secrets of one group are deferred until
    /// [`Storage::end_deferral`] (whose caller then owes that write).
    pub fn defer_message_secrets(&self) {
        let mut deferral = self.deferral.borrow_mut();
        if matches!(*deferral, Deferral::Off) {
            *deferral = Deferral::On { dirty: None };
        }
    }

    /// Stops deferring; `Some` if a write of the message secrets was deferred and so must now
    /// be made (from the in-memory group, in the scope given) before the transaction commits.
    pub fn end_deferral(&self) -> Option<Scope> {
        match self.deferral.replace(Deferral::Off) {
            Deferral::On {
                dirty: Some((_, scope)),
            } => Some(scope),
            _ => None,
        }
    }

    /// Whether the stored message secrets of `group_id` are stale (a write is owed).
    fn is_dirty(&self, key: &[u8]) -> bool {
        matches!(&*self.deferral.borrow(), Deferral::On { dirty: Some((k, _)) } if k == key)
    }

    /// Writes the message secrets: the current part alone where the scope allows it and the
    /// stored record is split, else both parts (or the whole record, for another shape).
    fn store_message_secrets<T: serde::Serialize>(
        &self,
        key: &[u8],
        value: &T,
    ) -> Result<(), rusqlite::Error> {
        if self.scope.get() == Scope::CurrentEpoch {
            if let Some(parts) = split(value, false)? {
                let mut current = SPLIT_TAG.to_vec();
                current.extend_from_slice(&parts.current);
                let updated =
                    self.conn
                        .prepare_cached(UPDATE_CURRENT_PART)?
                        .execute(rusqlite::params![
                            key,
                            current,
                            CURRENT_VERSION,
                            SPLIT_TAG.len(),
                            SPLIT_TAG
                        ])?;
                if updated == 1 {
                    return Ok(());
                }
            }
        }
        let (record, past) = match split(value, true)? {
            Some(parts) => {
                let mut current = SPLIT_TAG.to_vec();
                current.extend_from_slice(&parts.current);
                (current, Some(parts.past))
            }
            None => (encode_binary(value)?, None),
        };
        match past {
            Some(past) => self
                .conn
                .prepare_cached(WRITE_PAST_PART)?
                .execute(rusqlite::params![key, past])?,
            None => self.conn.prepare_cached(DELETE_PAST_PART)?.execute([key])?,
        };
        let updated = self
            .conn
            .prepare_cached(UPDATE_MESSAGE_SECRETS)?
            .execute(rusqlite::params![key, record, CURRENT_VERSION])?;
        if updated == 0 {
            self.conn
                .prepare_cached(WRITE_MESSAGE_SECRETS)?
                .execute(rusqlite::params![key, record, CURRENT_VERSION])?;
        }
        Ok(())
    }
}

/// Implements trait methods that go straight through to OpenMLS's own SQLite provider
/// (`self.inner`): each entry is the method's signature less `&self` and the `Result`, with each
/// generic parameter's bound named by its `openmls_traits::storage::traits` trait.
macro_rules! forward {
    ($(fn $name:ident<$($g:ident: $bound:ident),+>($($arg:ident: $ty:ty),+) -> $ret:ty;)+) => {
        $(
            fn $name<$($g: traits::$bound<CURRENT_VERSION>),+>(
                &self,
                $($arg: $ty),+
            ) -> Result<$ret, Self::Error> {
                self.inner.$name::<$($g),+>($($arg),+)
            }
        )+
    };
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
        let key = key_of(group_id)?;
        if let Deferral::On { dirty } = &mut *self.deferral.borrow_mut() {
            let scope = self.scope.get();
            match dirty {
                None => {
                    *dirty = Some((key, scope));
                    return Ok(());
                }
                Some((k, owed)) if *k == key => {
                    *owed = owed.widest(scope);
                    return Ok(());
                }
                // Another group (the engine never does this): not deferred.
                Some(_) => {}
            }
        }
        self.store_message_secrets(&key, message_secrets)
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
        let key = key_of(group_id)?;
        let mut stmt = self.conn.prepare_cached(READ_MESSAGE_SECRETS)?;
        let blob: Option<Vec<u8>> = stmt
            .query_row(rusqlite::params![key, CURRENT_VERSION], |row| row.get(0))
            .optional()?;
        let Some(blob) = blob else {
            return Ok(None);
        };
        let Some(current) = blob.strip_prefix(SPLIT_TAG) else {
            return decode_record(&blob).map(Some);
        };
        let past: Option<Vec<u8>> = self
            .conn
            .prepare_cached(READ_PAST_PART)?
            .query_row([&key], |row| row.get(0))
            .optional()?;
        let Some(mut whole) = past else {
            return Err(rusqlite::Error::FromSqlConversionFailure(
                0,
                rusqlite::types::Type::Blob,
                "the past part of the message secrets is missing".into(),
            ));
        };
        // postcard: the struct's fields one after the other (see the module docs).
        whole.extend_from_slice(current);
        postcard::from_bytes(&whole).map(Some).map_err(|e| {
            rusqlite::Error::FromSqlConversionFailure(0, rusqlite::types::Type::Blob, Box::new(e))
        })
    }

    fn delete_message_secrets<GroupId: traits::GroupId<CURRENT_VERSION>>(
        &self,
        group_id: &GroupId,
    ) -> Result<(), Self::Error> {
        let key = key_of(group_id)?;
        if let Deferral::On { dirty } = &mut *self.deferral.borrow_mut() {
            if dirty.as_ref().is_some_and(|(k, _)| *k == key) {
                // Deleted: nothing owed any more.
                *dirty = None;
            }
        }
        self.conn
            .prepare_cached(DELETE_PAST_PART)?
            .execute([&key])?;
        self.inner.delete_message_secrets::<GroupId>(group_id)
    }

    // The ratchet tree is stored binary too, the largest record.

    fn write_tree<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        TreeSync: traits::TreeSync<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
        tree: &TreeSync,
    ) -> Result<(), Self::Error> {
        // Binary, as the message secrets: the tree is the largest record (483 KB of JSON at
        // N=512, 4 bytes per key byte) and is rewritten by every commit.
        let record = encode_binary(tree)?;
        let key = key_of(group_id)?;
        let updated = self
            .conn
            .prepare_cached(UPDATE_TREE)?
            .execute(rusqlite::params![key, record, CURRENT_VERSION])?;
        if updated == 0 {
            self.conn
                .prepare_cached(WRITE_TREE)?
                .execute(rusqlite::params![key, record, CURRENT_VERSION])?;
        }
        Ok(())
    }

    fn tree<
        GroupId: traits::GroupId<CURRENT_VERSION>,
        TreeSync: traits::TreeSync<CURRENT_VERSION>,
    >(
        &self,
        group_id: &GroupId,
    ) -> Result<Option<TreeSync>, Self::Error> {
        let blob: Option<Vec<u8>> = self
            .conn
            .prepare_cached(READ_TREE)?
            .query_row(
                rusqlite::params![key_of(group_id)?, CURRENT_VERSION],
                |row| row.get(0),
            )
            .optional()?;
        // JSON when written by an earlier version (the next commit rewrites it).
        blob.map(|b| decode_record(&b)).transpose()
    }

    // Everything else goes straight through to OpenMLS's provider.
    forward! {
        fn write_mls_join_config<GroupId: GroupId, MlsGroupJoinConfig: MlsGroupJoinConfig>(
            group_id: &GroupId, config: &MlsGroupJoinConfig) -> ();
        fn append_own_leaf_node<GroupId: GroupId, LeafNode: LeafNode>(
            group_id: &GroupId, leaf_node: &LeafNode) -> ();
        fn queue_proposal<GroupId: GroupId, ProposalRef: ProposalRef, QueuedProposal: QueuedProposal>(
            group_id: &GroupId, proposal_ref: &ProposalRef, proposal: &QueuedProposal) -> ();
        fn write_interim_transcript_hash<GroupId: GroupId, InterimTranscriptHash: InterimTranscriptHash>(
            group_id: &GroupId, interim_transcript_hash: &InterimTranscriptHash) -> ();
        fn write_context<GroupId: GroupId, GroupContext: GroupContext>(
            group_id: &GroupId, group_context: &GroupContext) -> ();
        fn write_confirmation_tag<GroupId: GroupId, ConfirmationTag: ConfirmationTag>(
            group_id: &GroupId, confirmation_tag: &ConfirmationTag) -> ();
        fn write_group_state<GroupState: GroupState, GroupId: GroupId>(
            group_id: &GroupId, group_state: &GroupState) -> ();
        fn write_resumption_psk_store<GroupId: GroupId, ResumptionPskStore: ResumptionPskStore>(
            group_id: &GroupId, resumption_psk_store: &ResumptionPskStore) -> ();
        fn write_own_leaf_index<GroupId: GroupId, LeafNodeIndex: LeafNodeIndex>(
            group_id: &GroupId, own_leaf_index: &LeafNodeIndex) -> ();
        fn write_group_epoch_secrets<GroupId: GroupId, GroupEpochSecrets: GroupEpochSecrets>(
            group_id: &GroupId, group_epoch_secrets: &GroupEpochSecrets) -> ();
        fn write_signature_key_pair<SignaturePublicKey: SignaturePublicKey, SignatureKeyPair: SignatureKeyPair>(
            public_key: &SignaturePublicKey, signature_key_pair: &SignatureKeyPair) -> ();
        fn write_encryption_key_pair<EncryptionKey: EncryptionKey, HpkeKeyPair: HpkeKeyPair>(
            public_key: &EncryptionKey, key_pair: &HpkeKeyPair) -> ();
        fn write_encryption_epoch_key_pairs<GroupId: GroupId, EpochKey: EpochKey, HpkeKeyPair: HpkeKeyPair>(
            group_id: &GroupId, epoch: &EpochKey, leaf_index: u32, key_pairs: &[HpkeKeyPair]) -> ();
        fn write_key_package<HashReference: HashReference, KeyPackage: KeyPackage>(
            hash_ref: &HashReference, key_package: &KeyPackage) -> ();
        fn write_psk<PskId: PskId, PskBundle: PskBundle>(psk_id: &PskId, psk: &PskBundle) -> ();
        fn mls_group_join_config<GroupId: GroupId, MlsGroupJoinConfig: MlsGroupJoinConfig>(
            group_id: &GroupId) -> Option<MlsGroupJoinConfig>;
        fn own_leaf_nodes<GroupId: GroupId, LeafNode: LeafNode>(
            group_id: &GroupId) -> Vec<LeafNode>;
        fn queued_proposal_refs<GroupId: GroupId, ProposalRef: ProposalRef>(
            group_id: &GroupId) -> Vec<ProposalRef>;
        fn queued_proposals<GroupId: GroupId, ProposalRef: ProposalRef, QueuedProposal: QueuedProposal>(
            group_id: &GroupId) -> Vec<(ProposalRef, QueuedProposal)>;
        fn group_context<GroupId: GroupId, GroupContext: GroupContext>(
            group_id: &GroupId) -> Option<GroupContext>;
        fn interim_transcript_hash<GroupId: GroupId, InterimTranscriptHash: InterimTranscriptHash>(
            group_id: &GroupId) -> Option<InterimTranscriptHash>;
        fn confirmation_tag<GroupId: GroupId, ConfirmationTag: ConfirmationTag>(
            group_id: &GroupId) -> Option<ConfirmationTag>;
        fn group_state<GroupState: GroupState, GroupId: GroupId>(
            group_id: &GroupId) -> Option<GroupState>;
        fn resumption_psk_store<GroupId: GroupId, ResumptionPskStore: ResumptionPskStore>(
            group_id: &GroupId) -> Option<ResumptionPskStore>;
        fn own_leaf_index<GroupId: GroupId, LeafNodeIndex: LeafNodeIndex>(
            group_id: &GroupId) -> Option<LeafNodeIndex>;
        fn group_epoch_secrets<GroupId: GroupId, GroupEpochSecrets: GroupEpochSecrets>(
            group_id: &GroupId) -> Option<GroupEpochSecrets>;
        fn signature_key_pair<SignaturePublicKey: SignaturePublicKey, SignatureKeyPair: SignatureKeyPair>(
            public_key: &SignaturePublicKey) -> Option<SignatureKeyPair>;
        fn encryption_key_pair<HpkeKeyPair: HpkeKeyPair, EncryptionKey: EncryptionKey>(
            public_key: &EncryptionKey) -> Option<HpkeKeyPair>;
        fn encryption_epoch_key_pairs<GroupId: GroupId, EpochKey: EpochKey, HpkeKeyPair: HpkeKeyPair>(
            group_id: &GroupId, epoch: &EpochKey, leaf_index: u32) -> Vec<HpkeKeyPair>;
        fn key_package<KeyPackageRef: HashReference, KeyPackage: KeyPackage>(
            hash_ref: &KeyPackageRef) -> Option<KeyPackage>;
        fn psk<PskBundle: PskBundle, PskId: PskId>(psk_id: &PskId) -> Option<PskBundle>;
        fn remove_proposal<GroupId: GroupId, ProposalRef: ProposalRef>(
            group_id: &GroupId, proposal_ref: &ProposalRef) -> ();
        fn delete_own_leaf_nodes<GroupId: GroupId>(group_id: &GroupId) -> ();
        fn delete_group_config<GroupId: GroupId>(group_id: &GroupId) -> ();
        fn delete_tree<GroupId: GroupId>(group_id: &GroupId) -> ();
        fn delete_confirmation_tag<GroupId: GroupId>(group_id: &GroupId) -> ();
        fn delete_group_state<GroupId: GroupId>(group_id: &GroupId) -> ();
        fn delete_context<GroupId: GroupId>(group_id: &GroupId) -> ();
        fn delete_interim_transcript_hash<GroupId: GroupId>(group_id: &GroupId) -> ();
        fn delete_all_resumption_psk_secrets<GroupId: GroupId>(group_id: &GroupId) -> ();
        fn delete_own_leaf_index<GroupId: GroupId>(group_id: &GroupId) -> ();
        fn delete_group_epoch_secrets<GroupId: GroupId>(group_id: &GroupId) -> ();
        fn clear_proposal_queue<GroupId: GroupId, ProposalRef: ProposalRef>(
            group_id: &GroupId) -> ();
        fn delete_signature_key_pair<SignaturePublicKey: SignaturePublicKey>(
            public_key: &SignaturePublicKey) -> ();
        fn delete_encryption_key_pair<EncryptionKey: EncryptionKey>(
            public_key: &EncryptionKey) -> ();
        fn delete_encryption_epoch_key_pairs<GroupId: GroupId, EpochKey: EpochKey>(
            group_id: &GroupId, epoch: &EpochKey, leaf_index: u32) -> ();
        fn delete_key_package<KeyPackageRef: HashReference>(hash_ref: &KeyPackageRef) -> ();
        fn delete_psk<PskKey: PskId>(psk_id: &PskKey) -> ();
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
    #[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
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
        crate::store::schema::create_tables(&conn).unwrap();
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

    /// A stand-in shaped as OpenMLS's `MessageSecretsStore` (its name, its fields in order).
    #[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
    #[serde(rename = "MessageSecretsStore")]
    struct Store {
        max_epochs: usize,
        past_epoch_trees: VecDeque<(u64, Secrets, Vec<Vec<u8>>)>,
        message_secrets: Secrets,
    }
    impl Entity<CURRENT_VERSION> for Store {}
    impl traits::MessageSecrets<CURRENT_VERSION> for Store {}

    fn store() -> Store {
        Store {
            max_epochs: 5,
            past_epoch_trees: (3..8)
                .map(|epoch| (epoch, secrets(), vec![vec![epoch as u8; 64]; 100]))
                .collect(),
            message_secrets: secrets(),
        }
    }

    fn past_blob(conn: &Connection) -> Option<Vec<u8>> {
        conn.query_row("SELECT data FROM static_message_secrets_past", [], |row| {
            row.get(0)
        })
        .optional()
        .unwrap()
    }

    #[test]
    fn the_two_parts_are_the_whole_record_cut_in_two() {
        let value = store();
        let parts = split(&value, true).unwrap().unwrap();
        let mut whole = parts.past.clone();
        whole.extend_from_slice(&parts.current);
        assert_eq!(whole, postcard::to_allocvec(&value).unwrap());
        // Without the past part, the same current part.
        let current = split(&value, false).unwrap().unwrap();
        assert!(current.past.is_empty());
        assert_eq!(current.current, parts.current);
        // Another shape is not split.
        assert!(split(&secrets(), true).unwrap().is_none());
    }

    #[test]
    fn a_current_epoch_write_rewrites_only_the_current_part() {
        with_storage(|conn, storage, group| {
            let mut value = store();
            storage.write_message_secrets(group, &value).unwrap();
            assert!(stored_blob(conn).starts_with(SPLIT_TAG));
            let past = past_blob(conn).unwrap();
            assert_eq!(
                storage.message_secrets::<_, Store>(group).unwrap(),
                Some(value.clone())
            );

            // A message of the current epoch: only its secrets change.
            value.message_secrets.sender_data_secret = vec![9; 32];
            {
                let _scope = storage.scoped(Scope::CurrentEpoch);
                storage.write_message_secrets(group, &value).unwrap();
            }
            assert_eq!(past_blob(conn).unwrap(), past);
            assert_eq!(
                storage.message_secrets::<_, Store>(group).unwrap(),
                Some(value.clone())
            );

            // What the scope promises is what is written: a change to a past epoch under
            // CurrentEpoch is not (the engine never says CurrentEpoch for those)...
            let mut wrong = value.clone();
            wrong.past_epoch_trees[0].1.sender_data_secret = vec![7; 32];
            {
                let _scope = storage.scoped(Scope::CurrentEpoch);
                storage.write_message_secrets(group, &wrong).unwrap();
            }
            assert_eq!(
                storage.message_secrets::<_, Store>(group).unwrap(),
                Some(value.clone())
            );
            // ...and the scope ends with its guard: the next write stores everything.
            storage.write_message_secrets(group, &wrong).unwrap();
            assert_ne!(past_blob(conn).unwrap(), past);
            assert_eq!(
                storage.message_secrets::<_, Store>(group).unwrap(),
                Some(wrong)
            );

            storage.delete_message_secrets(group).unwrap();
            assert_eq!(storage.message_secrets::<_, Store>(group).unwrap(), None);
            assert_eq!(past_blob(conn), None);
        });
    }

    #[test]
    fn a_current_epoch_write_over_an_unsplit_record_writes_both_parts() {
        with_storage(|conn, storage, group| {
            let value = store();
            // As earlier versions stored it: whole, binary.
            conn.execute(
                WRITE_MESSAGE_SECRETS,
                rusqlite::params![
                    key_of(group).unwrap(),
                    encode_binary(&value).unwrap(),
                    CURRENT_VERSION
                ],
            )
            .unwrap();
            assert_eq!(
                storage.message_secrets::<_, Store>(group).unwrap(),
                Some(value.clone())
            );
            {
                let _scope = storage.scoped(Scope::CurrentEpoch);
                storage.write_message_secrets(group, &value).unwrap();
            }
            assert!(stored_blob(conn).starts_with(SPLIT_TAG));
            assert!(past_blob(conn).is_some());
            assert_eq!(
                storage.message_secrets::<_, Store>(group).unwrap(),
                Some(value)
            );
        });
    }

    #[test]
    fn deferred_writes_store_the_widest_scope() {
        with_storage(|conn, storage, group| {
            let mut value = store();
            storage.write_message_secrets(group, &value).unwrap();
            let past = past_blob(conn).unwrap();
            storage.defer_message_secrets();
            {
                let _scope = storage.scoped(Scope::CurrentEpoch);
                storage.write_message_secrets(group, &value).unwrap();
            }
            assert_eq!(storage.end_deferral(), Some(Scope::CurrentEpoch));
            storage.defer_message_secrets();
            {
                let _scope = storage.scoped(Scope::CurrentEpoch);
                storage.write_message_secrets(group, &value).unwrap();
            }
            value.past_epoch_trees.pop_front();
            storage.write_message_secrets(group, &value).unwrap();
            assert_eq!(storage.end_deferral(), Some(Scope::All));
            // Nothing was written while deferred.
            assert_eq!(past_blob(conn).unwrap(), past);
            assert_eq!(storage.end_deferral(), None);
        });
    }

    #[test]
    fn a_split_record_without_its_past_part_is_an_error_not_a_panic() {
        with_storage(|conn, storage, group| {
            storage.write_message_secrets(group, &store()).unwrap();
            conn.execute("DELETE FROM static_message_secrets_past", [])
                .unwrap();
            assert!(storage.message_secrets::<_, Store>(group).is_err());
        });
    }

    impl traits::TreeSync<CURRENT_VERSION> for Secrets {}

    #[test]
    fn the_tree_is_stored_binary_and_one_stored_as_json_is_still_read() {
        with_storage(|conn, storage, group| {
            let tree_blob = || -> Vec<u8> {
                conn.query_row(
                    "SELECT group_data FROM openmls_group_data WHERE data_type = 'tree'",
                    [],
                    |row| row.get(0),
                )
                .unwrap()
            };
            let value = secrets();
            // As earlier versions wrote it.
            storage.inner.write_tree(group, &value).unwrap();
            assert!(tree_blob().starts_with(b"{"));
            assert_eq!(
                storage.tree::<_, Secrets>(group).unwrap(),
                Some(value.clone())
            );
            storage.write_tree(group, &value).unwrap();
            assert!(tree_blob().starts_with(BINARY_TAG));
            assert_eq!(storage.tree::<_, Secrets>(group).unwrap(), Some(value));
            storage.delete_tree(group).unwrap();
            assert_eq!(storage.tree::<_, Secrets>(group).unwrap(), None);
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
