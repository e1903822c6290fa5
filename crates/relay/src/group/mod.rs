//! A channel's public MLS group state (RFC 9750 §5: the delivery service tracks the group from
//! its PublicMessages): built from CreateChannel's GroupInfo, advanced by each accepted commit,
//! stored as bytes. Pure: no I/O.
//!
//! The state is OpenMLS's `PublicGroup` (the tree, group context, transcript hashes) plus its
//! stored form, the records OpenMLS wrote for it ([`slot`]). Both are kept: the group to check
//! handshakes without a copy, the records because `PublicGroup` can only be copied or saved
//! through them (no public `Clone` or serializer). A state with n members holds O(n) of each.
//!
//! Layout: `handshake` checks handshakes and makes the next state; `slot` is the storage OpenMLS
//! reads and writes records through; `error` is why something was refused.

mod error;
mod handshake;
mod key_package;
mod slot;

use std::collections::HashMap;
use std::sync::LazyLock;

use openmls::prelude::group_info::VerifiableGroupInfo;
use openmls::prelude::tls_codec::{Deserialize as _, VLBytes};
use openmls::prelude::{
    CreationFromExternalError, GroupId, LeafNode, LeafNodeIndex, MlsMessageBodyIn, MlsMessageIn,
    ProposalStore, PublicGroup, RatchetTreeIn,
};
use static_mls::crypto::StaticCrypto;
use static_mls::CIPHERSUITE;

pub use error::{ErrorKind, GroupError};
pub use handshake::{CommitOutcome, Handshake};
pub use key_package::{check_key_package, peek_key_package, CheckedPackage, PackageError};
use slot::{Records, Slot};

/// The first byte of [`GroupState::to_bytes`]: format 1 is four length-prefixed records
/// (tree, group context, interim transcript hash, confirmation tag), each OpenMLS 0.9's serde
/// form of the value encoded with postcard. A new OpenMLS whose serde forms differ needs a new
/// format number (and a way to read the old one).
const FORMAT: u8 = 1;

/// One verifier for every group: `StaticCrypto` caches members' decompressed Ed25519 keys.
static CRYPTO: LazyLock<StaticCrypto> = LazyLock::new(StaticCrypto::default);

fn crypto() -> &'static StaticCrypto {
    &CRYPTO
}

/// A channel's public group state at one epoch.
pub struct GroupState {
    // Boxed: a `PublicGroup` is some 700 bytes inline, and states move (into outcomes).
    group: Box<PublicGroup>,
    records: Records,
}

/// A member leaf, as the tree has it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeafInfo {
    pub leaf_index: u32,
    /// The credential's content (a BasicCredential's identity).
    pub identity: Vec<u8>,
    pub signature_key: Vec<u8>,
    /// The leaf's HPKE public key (fresh in each key package and update).
    pub encryption_key: Vec<u8>,
}

impl std::fmt::Debug for GroupState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupState")
            .field("epoch", &self.epoch())
            .field("members", &self.group.members().count())
            .finish_non_exhaustive()
    }
}

impl GroupState {
    /// The state CreateChannel gives: `group_info` is an MLSMessage holding a GroupInfo (signed by
    /// its signer leaf), `ratchet_tree` a TLS-serialized ratchet tree, or empty when the
    /// GroupInfo carries the ratchet_tree extension.
    ///
    /// Checked: the group id is `channel`'s bytes, the epoch 0, the cipher suite
    /// [`static_mls::CIPHERSUITE`]; the tree and the GroupInfo's signature (OpenMLS's
    /// `PublicGroup::from_external`: every leaf's signature, the tree hash, key uniqueness);
    /// identities unique among leaves.
    pub fn create(
        channel: &str,
        group_info: &[u8],
        ratchet_tree: &[u8],
    ) -> Result<GroupState, GroupError> {
        let (info, tree) = parse_new_group(channel, group_info, ratchet_tree)?;
        GroupState::verify_new(info, tree)
    }

    /// [`GroupState::create`] for a creator who binds leaf `binding.leaf` to `binding.account`
    /// ([`GroupState::verify_binding`]), with the cheap checks first: before any of the tree's
    /// signatures is verified, the tree must hold its creator alone (RFC 9420 §11: a group
    /// starts with one member; the others come by commits), and the binding must verify
    /// against that leaf as sent. So a tree of thousands of leaves costs a parse, not a
    /// signature check per leaf (at 9b2be07: 305-372 ms of CPU for 6,472 leaves in 1 MiB).
    pub fn create_bound(
        channel: &str,
        group_info: &[u8],
        ratchet_tree: &[u8],
        binding: &Proof<'_>,
    ) -> Result<GroupState, GroupError> {
        let (info, tree) = parse_new_group(channel, group_info, ratchet_tree)?;
        let leaves = tree.leaves().count();
        let parents = tree.parents().count();
        let Some(leaf) = tree.leaves().next().filter(|_| leaves == 1 && parents == 0) else {
            return Err(GroupError::NotAlone { leaves });
        };
        if binding.leaf != 0 {
            return Err(GroupError::NoSuchLeaf {
                leaf: binding.leaf,
                epoch: 0,
            });
        }
        let encryption_key = hpke_key_bytes(leaf.encryption_key())
            .ok_or_else(|| GroupError::InvalidGroupInfo("its leaf's encryption key".into()))?;
        if !static_mls::binding::verify_leaf_binding(
            leaf.signature_key().as_slice(),
            channel.as_bytes(),
            binding.account,
            &encryption_key,
            binding.signature,
        ) {
            return Err(GroupError::BadBinding { leaf: binding.leaf });
        }
        let state = GroupState::verify_new(info, tree)?;
        // Against the verified tree too (one signature): what is stored is what was checked.
        state.verify_binding(binding.leaf, binding.account, binding.signature)?;
        Ok(state)
    }

    /// The costly part of [`GroupState::create`]: OpenMLS verifies the tree and the GroupInfo.
    fn verify_new(
        info: VerifiableGroupInfo,
        tree: RatchetTreeIn,
    ) -> Result<GroupState, GroupError> {
        let slot = Slot::empty();
        let (group, _) =
            PublicGroup::from_external(crypto(), &slot, tree, info, ProposalStore::new())
                .map_err(creation_error)?;
        let records = slot.into_written().map_err(GroupError::internal)?;
        let state = GroupState {
            group: Box::new(group),
            records,
        };
        state.check_identities()?;
        Ok(state)
    }

    /// Members in this state.
    pub fn member_count(&self) -> usize {
        self.group.treesync().full_leaves().count()
    }

    /// The stored form: [`FORMAT`], then the records, each with a u32 big-endian length.
    /// [`GroupState::from_bytes`] reads it back to the same bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>, GroupError> {
        let r = &self.records;
        let fields = [
            &r.tree,
            &r.context,
            &r.interim_transcript_hash,
            &r.confirmation_tag,
        ];
        let mut out = Vec::with_capacity(1 + fields.iter().map(|f| 4 + f.len()).sum::<usize>());
        out.push(FORMAT);
        for field in fields {
            let len = u32::try_from(field.len())
                .map_err(|_| GroupError::internal("a group state record beyond 4 GiB"))?;
            out.extend_from_slice(&len.to_be_bytes());
            out.extend_from_slice(field);
        }
        Ok(out)
    }

    /// A state from [`GroupState::to_bytes`]. The bytes are trusted to be what `to_bytes` wrote
    /// (the store's integrity is the store's job): they are decoded, not re-verified. Bytes
    /// that do not decode are an internal error.
    pub fn from_bytes(bytes: &[u8]) -> Result<GroupState, GroupError> {
        let (&format, mut rest) = bytes
            .split_first()
            .ok_or_else(|| GroupError::internal("an empty group state"))?;
        if format != FORMAT {
            return Err(GroupError::internal(format!(
                "unknown group state format {format}"
            )));
        }
        let mut field = || -> Result<Vec<u8>, GroupError> {
            let truncated = || GroupError::internal("a truncated group state");
            let (len, tail) = rest.split_first_chunk::<4>().ok_or_else(truncated)?;
            let len = usize::try_from(u32::from_be_bytes(*len)).map_err(|_| truncated())?;
            if tail.len() < len {
                return Err(truncated());
            }
            let (value, tail) = tail.split_at(len);
            rest = tail;
            Ok(value.to_vec())
        };
        let records = Records {
            tree: field()?,
            context: field()?,
            interim_transcript_hash: field()?,
            confirmation_tag: field()?,
        };
        if !rest.is_empty() {
            return Err(GroupError::internal("trailing bytes after the group state"));
        }
        let group = load(&records)?;
        Ok(GroupState {
            group: Box::new(group),
            records,
        })
    }

    pub fn epoch(&self) -> u64 {
        self.group.group_context().epoch().as_u64()
    }

    /// The group id: the channel name's bytes.
    pub fn group_id(&self) -> &[u8] {
        self.group.group_id().as_slice()
    }

    /// Leaf `index`, if it holds a member.
    pub fn leaf(&self, index: u32) -> Option<LeafInfo> {
        let node = self.group.leaf(LeafNodeIndex::new(index))?;
        leaf_info(index, node)
    }

    /// The members, by leaf index.
    pub fn members(&self) -> Vec<LeafInfo> {
        self.group
            .members()
            .map(|m| LeafInfo {
                leaf_index: m.index.u32(),
                identity: m.credential.serialized_content().to_vec(),
                signature_key: m.signature_key,
                encryption_key: m.encryption_key,
            })
            .collect()
    }

    /// Whether `signature` binds leaf `leaf_index` to `account` ([`static_mls::binding`]): the
    /// leaf holds a member and the signature verifies with its signature key over the group id
    /// (the channel name), `account` and the leaf's current encryption key.
    ///
    /// The brief's `channel` argument is not taken: the group id is the channel name (checked at
    /// [`GroupState::create`]), so the state already knows it.
    pub fn verify_binding(
        &self,
        leaf_index: u32,
        account: &str,
        signature: &[u8],
    ) -> Result<(), GroupError> {
        let leaf = self.leaf(leaf_index).ok_or(GroupError::NoSuchLeaf {
            leaf: leaf_index,
            epoch: self.epoch(),
        })?;
        if static_mls::binding::verify_leaf_binding(
            &leaf.signature_key,
            self.group_id(),
            account,
            &leaf.encryption_key,
            signature,
        ) {
            Ok(())
        } else {
            Err(GroupError::BadBinding { leaf: leaf_index })
        }
    }

    /// Where the group context's `external_senders` extension names the relay whose signature
    /// key is `key` (with the relay's credential, [`static_mls::RELAY_SENDER_IDENTITY`]): its
    /// index there. None for a group without it (created before the relay was an external
    /// sender, or by a client that did not name it): the relay proposes nothing in it.
    pub fn relay_sender_index(&self, key: &[u8]) -> Option<u32> {
        let relay = static_mls::relay_external_sender(key);
        let senders = self.group.group_context().extensions().external_senders()?;
        let index = senders.iter().position(|sender| *sender == relay)?;
        u32::try_from(index).ok()
    }

    /// An external Remove proposal (RFC 9420 §12.1.8.1) of leaf `leaf` at this epoch, an
    /// MLSMessage signed by the relay's key pair (`public`, `private`: raw Ed25519) as external
    /// sender `index` (see [`GroupState::relay_sender_index`]).
    pub fn propose_remove(
        &self,
        leaf: u32,
        index: u32,
        public: &[u8],
        private: &[u8],
    ) -> Result<Vec<u8>, GroupError> {
        use openmls::prelude::tls_codec::Serialize as _;
        if self.leaf(leaf).is_none() {
            return Err(GroupError::NoSuchLeaf {
                leaf,
                epoch: self.epoch(),
            });
        }
        let signer = openmls_basic_credential::SignatureKeyPair::from_raw(
            openmls::prelude::SignatureScheme::ED25519,
            private.to_vec(),
            public.to_vec(),
        );
        let message = openmls::prelude::ExternalProposal::new_remove::<
            openmls_rust_crypto::OpenMlsRustCrypto,
        >(
            LeafNodeIndex::new(leaf),
            self.group.group_id().clone(),
            self.group.group_context().epoch(),
            &signer,
            openmls::prelude::SenderExtensionIndex::new(index),
        )
        .map_err(GroupError::internal)?;
        message
            .tls_serialize_detached()
            .map_err(GroupError::internal)
    }

    /// Refuses two leaves holding one identity.
    fn check_identities(&self) -> Result<(), GroupError> {
        // Leaves by reference: `PublicGroup::members` clones every credential.
        let mut seen: HashMap<&[u8], u32> = HashMap::new();
        for (index, leaf) in self.group.treesync().full_leaves() {
            let identity = leaf.credential().serialized_content();
            if let Some(first) = seen.insert(identity, index.u32()) {
                return Err(GroupError::DuplicateIdentity {
                    identity: String::from_utf8_lossy(identity).into_owned(),
                    first,
                    second: index.u32(),
                });
            }
        }
        Ok(())
    }
}

/// A leaf binding as CreateChannel and BindLeaf carry it ([`static_mls::binding`]).
#[derive(Debug, Clone, Copy)]
pub struct Proof<'a> {
    pub leaf: u32,
    pub account: &'a str,
    pub signature: &'a [u8],
}

/// A new group's GroupInfo and tree, parsed, with the checks that need no signature: the group
/// id, the epoch 0, the cipher suite, a tree given or in the GroupInfo.
fn parse_new_group(
    channel: &str,
    group_info: &[u8],
    ratchet_tree: &[u8],
) -> Result<(VerifiableGroupInfo, RatchetTreeIn), GroupError> {
    let message = MlsMessageIn::tls_deserialize_exact(group_info)
        .map_err(|e| GroupError::malformed("group info", &e))?;
    let info = match message.extract() {
        MlsMessageBodyIn::GroupInfo(info) => info,
        other => return Err(GroupError::NotGroupInfo(body_name(&other))),
    };
    // The cheap checks first: a group for another channel costs no signature check.
    if info.group_id().as_slice() != channel.as_bytes() {
        return Err(GroupError::WrongGroup);
    }
    if info.epoch().as_u64() != 0 {
        return Err(GroupError::NotNewGroup(info.epoch().as_u64()));
    }
    if info.ciphersuite() != CIPHERSUITE {
        return Err(GroupError::WrongCiphersuite(
            info.ciphersuite().into(),
            CIPHERSUITE.into(),
        ));
    }
    let tree = if ratchet_tree.is_empty() {
        info.extensions()
            .ratchet_tree()
            .map(|extension| extension.ratchet_tree().clone())
            .ok_or(GroupError::NoRatchetTree)?
    } else {
        RatchetTreeIn::tls_deserialize_exact(ratchet_tree)
            .map_err(|e| GroupError::malformed("ratchet tree", &e))?
    };
    Ok((info, tree))
}

/// A leaf's HPKE public key as bytes (OpenMLS exposes it only serialized, `opaque<V>`).
fn hpke_key_bytes(key: &impl openmls::prelude::tls_codec::Serialize) -> Option<Vec<u8>> {
    let bytes = key.tls_serialize_detached().ok()?;
    let key = VLBytes::tls_deserialize_exact(bytes).ok()?;
    Some(key.as_slice().to_vec())
}

/// A `PublicGroup` from its records (a copy of the group they were written from).
fn load(records: &Records) -> Result<PublicGroup, GroupError> {
    // `load` looks records up by group id; a slot holds one group, so any id does.
    PublicGroup::load(&Slot::reading(records), &GroupId::from_slice(&[]))
        .map_err(GroupError::internal)?
        .ok_or_else(|| GroupError::internal("a group state without its records"))
}

fn leaf_info(index: u32, node: &LeafNode) -> Option<LeafInfo> {
    Some(LeafInfo {
        leaf_index: index,
        identity: node.credential().serialized_content().to_vec(),
        signature_key: node.signature_key().as_slice().to_vec(),
        encryption_key: hpke_key_bytes(node.encryption_key())?,
    })
}

fn body_name(body: &MlsMessageBodyIn) -> &'static str {
    match body {
        MlsMessageBodyIn::PublicMessage(_) => "public message",
        MlsMessageBodyIn::PrivateMessage(_) => "private message",
        MlsMessageBodyIn::Welcome(_) => "welcome",
        MlsMessageBodyIn::GroupInfo(_) => "group info",
        MlsMessageBodyIn::KeyPackage(_) => "key package",
    }
}

fn creation_error<E: std::fmt::Display>(err: CreationFromExternalError<E>) -> GroupError {
    match err {
        CreationFromExternalError::LibraryError(e) => GroupError::internal(e),
        CreationFromExternalError::WriteToStorageError(e) => GroupError::internal(e),
        CreationFromExternalError::UnknownSender => {
            GroupError::InvalidGroupInfo("its signer is not a leaf of the tree".into())
        }
        CreationFromExternalError::InvalidGroupInfoSignature => {
            GroupError::InvalidGroupInfo("its signature does not verify".into())
        }
        CreationFromExternalError::TreeHashMismatch => GroupError::InvalidGroupInfo(
            "the ratchet tree's hash is not the group context's".into(),
        ),
        other => GroupError::InvalidGroupInfo(error::lower(&other.to_string())),
    }
}
