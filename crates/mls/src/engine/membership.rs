//! Changing who is in a group (adding, removing, leaving, self-updates) and the pending
//! commit each leaves.

use super::*;

/// Whether OpenMLS refused because a commit of ours is pending.
fn is_pending_commit(state: &MlsGroupStateError) -> bool {
    matches!(state, MlsGroupStateError::PendingCommit)
}

/// Parses and validates a key package of our ciphersuite. A `not_before` at most
/// [`MAX_KEY_PACKAGE_SKEW`] in the future is waited out (OpenMLS requires it in the past).
fn validate_key_package(crypto: &StaticCrypto, bytes: &[u8]) -> Result<KeyPackage> {
    let invalid = |reason| Error::from(AddMemberError::InvalidKeyPackage(reason));
    check_len(bytes, InvalidKeyPackage::Empty, |len| {
        InvalidKeyPackage::TooLarge { len }
    })
    .map_err(invalid)?;
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        validate_key_package_inner(crypto, bytes).map_err(invalid)
    }))
    .unwrap_or_else(|_| {
        Err(InternalError::Panic {
            what: "validating a key package",
        }
        .into())
    })
}

fn validate_key_package_inner(
    crypto: &StaticCrypto,
    bytes: &[u8],
) -> Result<KeyPackage, InvalidKeyPackage> {
    let mut waited = false;
    loop {
        let kp_in = parse_key_package(bytes)?;
        match kp_in.validate(crypto, ProtocolVersion::Mls10) {
            Ok(kp) => {
                if kp.ciphersuite() != CIPHERSUITE {
                    return Err(InvalidKeyPackage::Ciphersuite {
                        found: kp.ciphersuite(),
                    });
                }
                return Ok(kp);
            }
            Err(KeyPackageVerifyError::LifetimeError(LifetimeError::NotValidYet {
                not_before,
                ..
            })) if !waited => {
                let ahead = not_before.saturating_sub(now_secs());
                if Duration::from_secs(ahead) > MAX_KEY_PACKAGE_SKEW {
                    return Err(InvalidKeyPackage::NotValidYet {
                        not_before,
                        now: now_secs(),
                    });
                }
                // Sleep until the second `not_before` has fully begun.
                let target = UNIX_EPOCH + Duration::from_secs(not_before);
                if let Ok(d) = target.duration_since(SystemTime::now()) {
                    std::thread::sleep(d + Duration::from_millis(5));
                }
                waited = true;
            }
            Err(e) => {
                return Err(InvalidKeyPackage::Verify {
                    detail: openmls_detail(&e),
                })
            }
        }
    }
}

/// Refuses, before OpenMLS does in its own words, to add a signature key that is already a
/// member's, or twice in one commit (MLS allows one leaf per signature key); and, which MLS
/// allows but the relay's access rule does not (one identity, one leaf), an identity
/// (credential) that is already a member's or twice in one commit.
fn refuse_members_twice(
    group: &MlsGroup,
    channel: &str,
    key_packages: &[KeyPackage],
) -> Result<(), AddMemberError> {
    let members: Vec<openmls::group::Member> = group.members().collect();
    for (i, kp) in key_packages.iter().enumerate() {
        let leaf = kp.leaf_node();
        let key = leaf.signature_key().as_slice();
        let earlier = &key_packages[..i];
        if members.iter().any(|m| m.signature_key.as_slice() == key) {
            return Err(AddMemberError::AlreadyInGroup {
                identity: key_package_identity(kp),
                channel: channel.to_owned(),
            });
        }
        if earlier
            .iter()
            .any(|other| other.leaf_node().signature_key().as_slice() == key)
        {
            return Err(AddMemberError::DuplicateKeyPackage {
                identity: key_package_identity(kp),
            });
        }
        // Credentials compared whole (type and content): the identity as the relay sees it.
        if members.iter().any(|m| &m.credential == leaf.credential()) {
            return Err(AddMemberError::IdentityTaken {
                identity: key_package_identity(kp),
                channel: channel.to_owned(),
            });
        }
        if earlier
            .iter()
            .any(|other| other.leaf_node().credential() == leaf.credential())
        {
            return Err(AddMemberError::DuplicateIdentity {
                identity: key_package_identity(kp),
            });
        }
    }
    Ok(())
}

/// Parses a key package sent as an `MLSMessage` or as a bare `KeyPackage`.
fn parse_key_package(bytes: &[u8]) -> Result<KeyPackageIn, InvalidKeyPackage> {
    if let Ok(msg) = MlsMessageIn::tls_deserialize_exact(bytes) {
        return match msg.extract() {
            MlsMessageBodyIn::KeyPackage(kp) => Ok(kp),
            _ => Err(InvalidKeyPackage::NotAKeyPackage),
        };
    }
    KeyPackageIn::tls_deserialize_exact(bytes).map_err(|e| InvalidKeyPackage::Malformed {
        detail: decode_detail(&e),
    })
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The identity in a key package's basic credential (empty if it has none).
fn key_package_identity(kp: &KeyPackage) -> Vec<u8> {
    identity_of(kp.leaf_node().credential()).unwrap_or_default()
}

impl Engine {
    /// Adds the owner of `key_package` (an `MLSMessage` or a bare `KeyPackage`): returns the
    /// pending commit and the Welcome (ratchet tree included).
    pub fn add_member(&self, channel: &str, key_package: &[u8]) -> Result<AddMemberOutput> {
        self.add_members(channel, &[key_package])
    }

    /// Adds several members in one commit (one Welcome for all of them).
    ///
    /// The commit carries no update path unless a proposal it covers needs one (RFC 9420
    /// §12.4: an Add does not): a path costs N - 1 HPKE encryptions and grows the commit with
    /// the tree (42.8 KB and 48.6 ms at N=512 against 464 B for mls-rs, which sends none
    /// either). Our leaf is therefore not refreshed by adds; [`Engine::self_update`] is what
    /// does that (see docs/design.md, "Add commits without a path").
    pub fn add_members(&self, channel: &str, key_packages: &[&[u8]]) -> Result<AddMemberOutput> {
        if key_packages.is_empty() {
            return Err(AddMemberError::NoKeyPackages.into());
        }
        let key_packages = key_packages
            .iter()
            .map(|kp| validate_key_package(&self.crypto, kp))
            .collect::<Result<Vec<_>>>()?;
        self.with_group(channel, |group, provider, conn| {
            refuse_members_twice(group, channel, &key_packages)?;
            let (commit, welcome, _) = group
                .add_members_without_update(provider, &self.signer, &key_packages)
                .map_err(|e| match e {
                    AddMembersError::GroupStateError(ref s) if is_pending_commit(s) => {
                        AddMemberError::PendingCommit {
                            channel: channel.to_owned(),
                        }
                    }
                    AddMembersError::CreateCommitError(
                        CreateCommitError::ProposalValidationError(
                            ProposalValidationError::DuplicateSignatureKey,
                        ),
                    ) if key_packages.len() == 1 => AddMemberError::AlreadyInGroup {
                        identity: key_package_identity(&key_packages[0]),
                        channel: channel.to_owned(),
                    },
                    e => AddMemberError::Commit {
                        channel: channel.to_owned(),
                        detail: openmls_detail(&e),
                    },
                })?;
            let (commit, welcome) = (serialize(&commit)?, serialize(&welcome)?);
            store::rows::set_pending_commit(conn, channel, &commit, Some(&welcome))?;
            Ok(AddMemberOutput { commit, welcome })
        })
    }

    /// Rotates our leaf keys (a commit with a path): returns the pending commit.
    pub fn self_update(&self, channel: &str) -> Result<Vec<u8>> {
        self.with_group(channel, |group, provider, conn| {
            let bundle = group
                .self_update(provider, &self.signer, LeafNodeParameters::default())
                .map_err(|e| match e {
                    SelfUpdateError::GroupStateError(ref s) if is_pending_commit(s) => {
                        CommitError::PendingCommit {
                            channel: channel.to_owned(),
                        }
                    }
                    e => CommitError::SelfUpdate {
                        channel: channel.to_owned(),
                        detail: openmls_detail(&e),
                    },
                })?;
            let commit = serialize(bundle.commit())?;
            store::rows::set_pending_commit(conn, channel, &commit, None)?;
            Ok(commit)
        })
    }

    /// Removes the member(s) whose credential identity is `identity`: returns the pending
    /// commit. Removing ourselves is refused (use [`Engine::leave`]).
    pub fn remove_member(&self, channel: &str, identity: &[u8]) -> Result<Vec<u8>> {
        self.with_group(channel, |group, provider, conn| {
            let own = group.own_leaf_index();
            let targets: Vec<LeafNodeIndex> = group
                .members()
                .filter(|m| identity_of(&m.credential).as_deref() == Some(identity))
                .map(|m| m.index)
                .collect();
            if targets.is_empty() {
                return Err(RemoveMemberError::NotAMember {
                    identity: identity.to_vec(),
                    channel: channel.to_owned(),
                }
                .into());
            }
            if targets.contains(&own) {
                return Err(RemoveMemberError::RemoveSelf {
                    channel: channel.to_owned(),
                }
                .into());
            }
            let (commit, _, _) = group
                .remove_members(provider, &self.signer, &targets)
                .map_err(|e| match e {
                    RemoveMembersError::GroupStateError(ref s) if is_pending_commit(s) => {
                        RemoveMemberError::PendingCommit {
                            channel: channel.to_owned(),
                        }
                    }
                    e => RemoveMemberError::Commit {
                        identity: identity.to_vec(),
                        channel: channel.to_owned(),
                        detail: openmls_detail(&e),
                    },
                })?;
            let commit = serialize(&commit)?;
            store::rows::set_pending_commit(conn, channel, &commit, None)?;
            Ok(commit)
        })
    }

    /// Proposes our own removal: returns the proposal to publish. Another member commits it
    /// ([`Engine::commit_pending_proposals`]); processing that commit deletes our state.
    pub fn leave(&self, channel: &str) -> Result<Vec<u8>> {
        self.with_group(channel, |group, provider, _| {
            let proposal =
                group
                    .leave_group(provider, &self.signer)
                    .map_err(|e| LeaveError::Propose {
                        channel: channel.to_owned(),
                        detail: openmls_detail(&e),
                    })?;
            serialize(&proposal)
        })
    }

    /// Deletes our local state of `channel`: for a group joined from a Welcome whose channel
    /// the relay refuses us, which could never be used and must not be listed as ours.
    pub fn forget_group(&self, channel: &str) -> Result<()> {
        self.with_group(channel, |group, provider, conn| {
            group.delete(provider.storage()).map_err(StoreError::from)?;
            store::rows::delete_group(conn, channel)?;
            Ok(())
        })?;
        self.drop_group(channel);
        Ok(())
    }

    /// Commits the proposals received so far (e.g. a member's leave); `None` if there are none.
    pub fn commit_pending_proposals(&self, channel: &str) -> Result<Option<Vec<u8>>> {
        self.with_group(channel, |group, provider, conn| {
            if !group.has_pending_proposals() {
                return Ok(None);
            }
            let (commit, _, _) = group
                .commit_to_pending_proposals(provider, &self.signer)
                .map_err(|e| match e {
                    CommitToPendingProposalsError::GroupStateError(ref s)
                        if is_pending_commit(s) =>
                    {
                        CommitError::PendingCommit {
                            channel: channel.to_owned(),
                        }
                    }
                    e => CommitError::PendingProposals {
                        channel: channel.to_owned(),
                        detail: openmls_detail(&e),
                    },
                })?;
            let commit = serialize(&commit)?;
            store::rows::set_pending_commit(conn, channel, &commit, None)?;
            Ok(Some(commit))
        })
    }

    /// The bytes of our pending commit, if any.
    pub fn pending_commit(&self, channel: &str) -> Result<Option<Vec<u8>>> {
        Ok(self
            .pending_commit_and_welcome(channel)?
            .map(|stored| stored.commit))
    }

    /// Our pending commit and the Welcome it was made with (an add's), if any: what to publish
    /// again when the call that made it was cut off before the relay answered.
    pub fn pending_commit_and_welcome(&self, channel: &str) -> Result<Option<StoredCommit>> {
        self.with_group_read(channel, |_| Ok(()))?;
        let db = lock(&self.db);
        Ok(store::rows::pending_commit_and_welcome(&db.conn, channel)?)
    }

    /// Applies our pending commit (the relay accepted it).
    pub fn merge_pending_commit(&self, channel: &str) -> Result<u64> {
        let epoch = self.with_group(channel, |group, provider, conn| {
            if group.pending_commit().is_none() {
                return Err(CommitError::NoPendingCommit {
                    channel: channel.to_owned(),
                }
                .into());
            }
            group
                .merge_pending_commit(provider)
                .map_err(|e| CommitError::Merge {
                    channel: channel.to_owned(),
                    detail: openmls_detail(&e),
                })?;
            store::rows::own_commit_merged(conn, channel)?;
            Ok(group.epoch().as_u64())
        })?;
        self.checkpoint();
        Ok(epoch)
    }

    /// Drops our pending commit (the relay refused it). A no-op without one.
    pub fn clear_pending_commit(&self, channel: &str) -> Result<()> {
        self.with_group(channel, |group, provider, conn| {
            group
                .clear_pending_commit(provider.storage())
                .map_err(StoreError::from)?;
            store::rows::clear_pending_commit(conn, channel)?;
            Ok(())
        })
    }
}
