//! Reading a group: its members, epoch and pending state, the public state for the relay and
//! our leaf binding.

use super::*;

impl Engine {
    /// The members of the group, by leaf index.
    pub fn members(&self, channel: &str) -> Result<Vec<Member>> {
        self.with_group_read(channel, |group| Ok(members_of(group)))
    }

    /// Our leaf's index in the group's current tree.
    pub fn own_leaf_index(&self, channel: &str) -> Result<u32> {
        self.with_group_read(channel, |group| Ok(group.own_leaf_index().u32()))
    }

    /// The group's current epoch.
    pub fn epoch(&self, channel: &str) -> Result<u64> {
        self.with_group_read(channel, |group| Ok(group.epoch().as_u64()))
    }

    /// The epoch authenticator: equal for all members in the same epoch of the same group
    /// (compare it out of band to detect a fork).
    pub fn epoch_authenticator(&self, channel: &str) -> Result<Vec<u8>> {
        self.with_group_read(channel, |group| {
            Ok(group.epoch_authenticator().as_slice().to_vec())
        })
    }

    /// Whether the group holds proposals no commit has covered yet (MLS forbids sending
    /// application messages until one does).
    pub fn has_pending_proposals(&self, channel: &str) -> Result<bool> {
        self.with_group_read(channel, |group| Ok(group.has_pending_proposals()))
    }

    /// Whether the group's `external_senders` extension names the relay whose external sender
    /// signature key is `relay_key` (see [`crate::relay_external_sender`]): the relay may then
    /// propose removals in it (docs/design.md §5.2, "Removal on revocation").
    pub fn names_relay(&self, channel: &str, relay_key: &[u8]) -> Result<bool> {
        let relay = crate::relay_external_sender(relay_key);
        self.with_group_read(channel, |group| {
            Ok(group
                .extensions()
                .external_senders()
                .is_some_and(|senders| senders.contains(&relay)))
        })
    }

    /// The channel's public state at its current epoch (our pending commit, if any, not
    /// applied), for the relay: see [`PublicState`].
    pub fn public_state(&self, channel: &str) -> Result<PublicState> {
        self.with_group_read(channel, |group| {
            let group_info = group
                .export_group_info(&self.crypto, &self.signer, true)
                .map_err(|e| ExportError::GroupInfo {
                    channel: channel.to_owned(),
                    detail: openmls_detail(&e),
                })?;
            let ratchet_tree = group
                .export_ratchet_tree()
                .tls_serialize_detached()
                .map_err(|e| InternalError::Serialize {
                    detail: openmls_detail(&e),
                })?;
            Ok(PublicState {
                group_info: serialize(&group_info)?,
                ratchet_tree,
            })
        })
    }

    /// Our leaf binding to `account` in `channel` (see [`crate::binding`]), over our leaf's
    /// current encryption key: a commit that changes it (ours, e.g. [`Engine::self_update`])
    /// calls for a new binding.
    pub fn leaf_binding(&self, channel: &str, account: &str) -> Result<LeafBinding> {
        self.with_group_read(channel, |group| {
            let own = group.own_leaf_index();
            // `members()` is the public way to our leaf's encryption key bytes.
            let encryption_key = group
                .members()
                .find(|m| m.index == own)
                .map(|m| m.encryption_key)
                .ok_or_else(|| ExportError::NoOwnLeaf {
                    channel: channel.to_owned(),
                })?;
            let tbs =
                crate::binding::leaf_binding_tbs(channel.as_bytes(), account, &encryption_key);
            Ok(LeafBinding {
                leaf_index: own.u32(),
                signature: self.signer.sign_bytes(&tbs),
            })
        })
    }

    /// Whether the group has a pending (unmerged) commit of ours.
    pub fn has_pending_commit(&self, channel: &str) -> Result<bool> {
        self.with_group_read(channel, |group| Ok(group.pending_commit().is_some()))
    }
}
