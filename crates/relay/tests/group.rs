//! The channel group state (`static_relay::group`) against real OpenMLS groups: creation,
//! handshakes accepted in sequence, refusals and their kinds, the stored form, leaf bindings;
//! and, ignored (run them in release), its timings at several group sizes.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use openmls::prelude::tls_codec::{Deserialize as _, Serialize as _};
use openmls::prelude::*;
use openmls_basic_credential::SignatureKeyPair;
use openmls_rust_crypto::{OpenMlsRustCrypto, RustCrypto};
use openmls_traits::signatures::Signer as _;
use proptest::prelude::*;
use static_mls::binding::leaf_binding_tbs;
use static_mls::CIPHERSUITE;
use static_relay::group::{CommitOutcome, ErrorKind, GroupError, GroupState, Handshake};

const CHANNEL: &str = "acme/team/general";

/// An OpenMLS client with its own storage, in at most one group.
struct Client {
    provider: OpenMlsRustCrypto,
    signer: SignatureKeyPair,
    credential: CredentialWithKey,
    /// Leaf capabilities beyond OpenMLS's defaults, for its key packages and groups.
    capabilities: Option<Capabilities>,
    group: Option<MlsGroup>,
}

/// A fresh Ed25519 key pair (private, public), to give one signature key to two clients.
fn signature_keys() -> (Vec<u8>, Vec<u8>) {
    RustCrypto::default()
        .signature_key_gen(CIPHERSUITE.signature_algorithm())
        .unwrap()
}

fn bytes(message: &MlsMessageOut) -> Vec<u8> {
    message.tls_serialize_detached().unwrap()
}

fn join_config(policy: WireFormatPolicy) -> MlsGroupJoinConfig {
    MlsGroupJoinConfig::builder()
        .use_ratchet_tree_extension(true)
        .wire_format_policy(policy)
        .build()
}

impl Client {
    fn new(identity: &str) -> Client {
        Client::with_keys(identity, signature_keys())
    }

    fn with_keys(identity: &str, (private, public): (Vec<u8>, Vec<u8>)) -> Client {
        let signer = SignatureKeyPair::from_raw(CIPHERSUITE.signature_algorithm(), private, public);
        let credential = CredentialWithKey {
            credential: BasicCredential::new(identity.as_bytes().to_vec()).into(),
            signature_key: signer.public().into(),
        };
        Client {
            provider: OpenMlsRustCrypto::default(),
            signer,
            credential,
            capabilities: None,
            group: None,
        }
    }

    /// A client whose leaves support SelfRemove proposals (not among OpenMLS's defaults).
    fn supporting_self_remove(identity: &str) -> Client {
        let capabilities = Capabilities::new(
            None,
            Some(&[CIPHERSUITE]),
            None,
            Some(&[ProposalType::SelfRemove]),
            None,
        );
        Client {
            capabilities: Some(capabilities),
            ..Client::new(identity)
        }
    }

    fn key_package(&self) -> KeyPackage {
        let mut builder = KeyPackage::builder();
        if let Some(capabilities) = &self.capabilities {
            builder = builder.leaf_node_capabilities(capabilities.clone());
        }
        builder
            .build(
                CIPHERSUITE,
                &self.provider,
                &self.signer,
                self.credential.clone(),
            )
            .unwrap()
            .key_package()
            .clone()
    }

    fn create(&mut self, group_id: &[u8]) {
        self.create_with(group_id, CIPHERSUITE);
    }

    fn create_with(&mut self, group_id: &[u8], ciphersuite: Ciphersuite) {
        let mut builder = MlsGroup::builder();
        if let Some(capabilities) = &self.capabilities {
            builder = builder.with_capabilities(capabilities.clone());
        }
        let group = builder
            .with_group_id(GroupId::from_slice(group_id))
            .ciphersuite(ciphersuite)
            .use_ratchet_tree_extension(true)
            .with_wire_format_policy(MIXED_PLAINTEXT_WIRE_FORMAT_POLICY)
            .build(&self.provider, &self.signer, self.credential.clone())
            .unwrap();
        self.group = Some(group);
    }

    fn join(&mut self, welcome: &[u8]) {
        let MlsMessageBodyIn::Welcome(welcome) = MlsMessageIn::tls_deserialize_exact(welcome)
            .unwrap()
            .extract()
        else {
            panic!("not a welcome");
        };
        let config = join_config(MIXED_PLAINTEXT_WIRE_FORMAT_POLICY);
        let group = StagedWelcome::new_from_welcome(&self.provider, &config, welcome, None)
            .unwrap()
            .into_group(&self.provider)
            .unwrap();
        self.group = Some(group);
    }

    fn index(&self) -> u32 {
        self.group.as_ref().unwrap().own_leaf_index().u32()
    }

    fn epoch(&self) -> u64 {
        self.group.as_ref().unwrap().epoch().as_u64()
    }

    /// The GroupInfo (with the ratchet_tree extension or without) as an MLSMessage.
    fn group_info(&self, with_tree: bool) -> Vec<u8> {
        let group = self.group.as_ref().unwrap();
        bytes(
            &group
                .export_group_info(self.provider.crypto(), &self.signer, with_tree)
                .unwrap(),
        )
    }

    fn ratchet_tree(&self) -> Vec<u8> {
        let group = self.group.as_ref().unwrap();
        group
            .export_ratchet_tree()
            .tls_serialize_detached()
            .unwrap()
    }

    /// An add commit (merged here at once) and its welcome.
    fn add(&mut self, key_packages: &[KeyPackage]) -> (Vec<u8>, Vec<u8>) {
        let (provider, signer) = (&self.provider, &self.signer);
        let group = self.group.as_mut().unwrap();
        let (commit, welcome, _) = group.add_members(provider, signer, key_packages).unwrap();
        group.merge_pending_commit(provider).unwrap();
        (bytes(&commit), bytes(&welcome))
    }

    fn self_update(&mut self) -> Vec<u8> {
        let (provider, signer) = (&self.provider, &self.signer);
        let group = self.group.as_mut().unwrap();
        let bundle = group
            .self_update(provider, signer, LeafNodeParameters::default())
            .unwrap();
        group.merge_pending_commit(provider).unwrap();
        bytes(bundle.commit())
    }

    fn remove(&mut self, leaves: &[u32]) -> Vec<u8> {
        let (provider, signer) = (&self.provider, &self.signer);
        let group = self.group.as_mut().unwrap();
        let leaves: Vec<_> = leaves.iter().map(|l| LeafNodeIndex::new(*l)).collect();
        let (commit, _, _) = group.remove_members(provider, signer, &leaves).unwrap();
        group.merge_pending_commit(provider).unwrap();
        bytes(&commit)
    }

    /// A Remove proposal of this client's own leaf.
    fn leave(&mut self) -> Vec<u8> {
        let (provider, signer) = (&self.provider, &self.signer);
        bytes(
            &self
                .group
                .as_mut()
                .unwrap()
                .leave_group(provider, signer)
                .unwrap(),
        )
    }

    /// A SelfRemove proposal.
    fn self_remove(&mut self) -> Vec<u8> {
        let (provider, signer) = (&self.provider, &self.signer);
        let group = self.group.as_mut().unwrap();
        bytes(&group.leave_group_via_self_remove(provider, signer).unwrap())
    }

    fn propose_remove(&mut self, leaf: u32) -> Vec<u8> {
        let (provider, signer) = (&self.provider, &self.signer);
        let group = self.group.as_mut().unwrap();
        let (proposal, _) = group
            .propose_remove_member(provider, signer, LeafNodeIndex::new(leaf))
            .unwrap();
        bytes(&proposal)
    }

    /// A commit of the proposals received (merged here at once).
    fn commit_pending(&mut self) -> Vec<u8> {
        let (provider, signer) = (&self.provider, &self.signer);
        let group = self.group.as_mut().unwrap();
        let (commit, _, _) = group.commit_to_pending_proposals(provider, signer).unwrap();
        group.merge_pending_commit(provider).unwrap();
        bytes(&commit)
    }

    /// Process a handshake from another member: merge a commit, keep a proposal.
    fn receive(&mut self, message: &[u8]) {
        let message = MlsMessageIn::tls_deserialize_exact(message)
            .unwrap()
            .try_into_protocol_message()
            .unwrap();
        let provider = &self.provider;
        let group = self.group.as_mut().unwrap();
        match group
            .process_message(provider, message)
            .unwrap()
            .into_content()
        {
            ProcessedMessageContent::StagedCommitMessage(staged) => {
                group.merge_staged_commit(provider, *staged).unwrap();
            }
            ProcessedMessageContent::ProposalMessage(proposal) => {
                group
                    .store_pending_proposal(provider.storage(), *proposal)
                    .unwrap();
            }
            _ => panic!("not a handshake"),
        }
    }

    /// This client's binding of its leaf to `account`.
    fn binding(&self, account: &str, encryption_key: &[u8]) -> Vec<u8> {
        self.signer
            .sign(&leaf_binding_tbs(
                CHANNEL.as_bytes(),
                account,
                encryption_key,
            ))
            .unwrap()
    }
}

fn commit(state: &GroupState, message: &[u8], proposals: &[&[u8]]) -> CommitOutcome {
    match state.check_handshake(message, proposals).unwrap() {
        Handshake::Commit(outcome) => outcome,
        other => panic!("not a commit: {other:?}"),
    }
}

fn refused(state: &GroupState, message: &[u8], proposals: &[&[u8]]) -> GroupError {
    match state.check_handshake(message, proposals) {
        Ok(accepted) => panic!("accepted: {accepted:?}"),
        Err(err) => err,
    }
}

/// (leaf, identity) of each member.
fn members(state: &GroupState) -> Vec<(u32, String)> {
    state
        .members()
        .into_iter()
        .map(|m| (m.leaf_index, String::from_utf8(m.identity).unwrap()))
        .collect()
}

fn roster(names: &[(u32, &str)]) -> Vec<(u32, String)> {
    names.iter().map(|(i, n)| (*i, n.to_string())).collect()
}

/// Alice's channel with the others added in one commit, everyone joined: the clients (alice
/// first) and the relay's state at epoch 1.
fn channel_of(names: &[&str]) -> (Vec<Client>, GroupState) {
    let mut alice = Client::new("alice");
    alice.create(CHANNEL.as_bytes());
    let state = GroupState::create(CHANNEL, &alice.group_info(true), &[]).unwrap();
    let mut others: Vec<Client> = names.iter().map(|n| Client::new(n)).collect();
    let key_packages: Vec<_> = others.iter().map(Client::key_package).collect();
    let (add, welcome) = alice.add(&key_packages);
    let state = commit(&state, &add, &[]).next;
    for other in &mut others {
        other.join(&welcome);
    }
    let mut clients = vec![alice];
    clients.extend(others);
    (clients, state)
}

#[test]
fn a_channel_follows_its_group_through_adds_updates_removes_and_leaves() {
    let mut alice = Client::new("alice");
    alice.create(CHANNEL.as_bytes());
    let state = GroupState::create(CHANNEL, &alice.group_info(true), &[]).unwrap();
    assert_eq!(state.epoch(), 0);
    assert_eq!(members(&state), roster(&[(0, "alice")]));
    // The same group from a GroupInfo without the tree, and the tree given apart.
    let apart =
        GroupState::create(CHANNEL, &alice.group_info(false), &alice.ratchet_tree()).unwrap();
    assert_eq!(apart.members(), state.members());
    assert_eq!(apart.to_bytes().unwrap(), state.to_bytes().unwrap());

    // An add commit.
    let mut bob = Client::new("bob");
    let mut carol = Client::new("carol");
    let mut dave = Client::new("dave");
    let key_packages = [bob.key_package(), carol.key_package(), dave.key_package()];
    let (add, welcome) = alice.add(&key_packages);
    let before = state.to_bytes().unwrap();
    let out = commit(&state, &add, &[]);
    // `check_handshake` leaves the state as it was: the commit may still lose its race.
    assert_eq!(state.to_bytes().unwrap(), before);
    assert_eq!(state.epoch(), 0);
    assert_eq!(
        (out.sender, out.added, out.removed),
        (0, vec![1, 2, 3], vec![])
    );
    let state = out.next;
    assert_eq!(state.epoch(), 1);
    assert_eq!(
        members(&state),
        roster(&[(0, "alice"), (1, "bob"), (2, "carol"), (3, "dave")])
    );
    for client in [&mut bob, &mut carol, &mut dave] {
        client.join(&welcome);
    }
    assert_eq!(bob.index(), 1);
    for member in state.members() {
        assert_eq!(state.leaf(member.leaf_index), Some(member));
    }
    assert_eq!(state.leaf(4), None);
    assert_eq!(state.leaf(u32::MAX), None);

    // A self-update commit: bob's leaf gets a new encryption key.
    let old_key = state.leaf(1).unwrap().encryption_key;
    let update = bob.self_update();
    let out = commit(&state, &update, &[]);
    assert_eq!((out.sender, out.added, out.removed), (1, vec![], vec![]));
    let state = out.next;
    assert_eq!(state.epoch(), 2);
    assert_ne!(state.leaf(1).unwrap().encryption_key, old_key);
    for client in [&mut alice, &mut carol, &mut dave] {
        client.receive(&update);
    }

    // A remove commit.
    let remove = alice.remove(&[2]);
    let out = commit(&state, &remove, &[]);
    assert_eq!((out.sender, out.added, out.removed), (0, vec![], vec![2]));
    let state = out.next;
    assert_eq!(state.epoch(), 3);
    assert_eq!(
        members(&state),
        roster(&[(0, "alice"), (1, "bob"), (3, "dave")])
    );
    assert_eq!(state.leaf(2), None);
    for client in [&mut bob, &mut dave] {
        client.receive(&remove);
    }

    // A leave proposal, then another member's commit of it by reference.
    let leave = bob.leave();
    match state.check_handshake(&leave, &[]).unwrap() {
        Handshake::Proposal { sender } => assert_eq!(sender, 1),
        other => panic!("not a proposal: {other:?}"),
    }
    for client in [&mut alice, &mut dave] {
        client.receive(&leave);
    }
    let covered = dave.commit_pending();
    let out = commit(&state, &covered, &[&leave]);
    assert_eq!((out.sender, out.added, out.removed), (3, vec![], vec![1]));
    let state = out.next;
    assert_eq!(state.epoch(), 4);
    assert_eq!(members(&state), roster(&[(0, "alice"), (3, "dave")]));
    alice.receive(&covered);

    // The stored form reads back to the same bytes, members and epoch, and goes on.
    let stored = state.to_bytes().unwrap();
    let loaded = GroupState::from_bytes(&stored).unwrap();
    assert_eq!(loaded.to_bytes().unwrap(), stored);
    assert_eq!(loaded.epoch(), 4);
    assert_eq!(loaded.members(), state.members());
    let update = alice.self_update();
    let out = commit(&loaded, &update, &[]);
    assert_eq!(out.next.epoch(), 5);
    dave.receive(&update);
    assert_eq!(dave.epoch(), 5);
}

#[test]
fn a_self_remove_proposal_committed_by_reference_removes_its_sender() {
    let mut alice = Client::supporting_self_remove("alice");
    alice.create(CHANNEL.as_bytes());
    let state = GroupState::create(CHANNEL, &alice.group_info(true), &[]).unwrap();
    let mut bob = Client::supporting_self_remove("bob");
    let mut carol = Client::supporting_self_remove("carol");
    let (add, welcome) = alice.add(&[bob.key_package(), carol.key_package()]);
    let state = commit(&state, &add, &[]).next;
    bob.join(&welcome);
    carol.join(&welcome);
    let leave = bob.self_remove();
    assert!(matches!(
        state.check_handshake(&leave, &[]).unwrap(),
        Handshake::Proposal { sender: 1 }
    ));
    alice.receive(&leave);
    let covered = alice.commit_pending();
    let out = commit(&state, &covered, &[&leave]);
    assert_eq!((out.sender, out.added, out.removed), (0, vec![], vec![1]));
    assert_eq!(members(&out.next), roster(&[(0, "alice"), (2, "carol")]));
    assert_eq!(refused(&state, &covered, &[]), GroupError::MissingProposal);
}

#[test]
fn a_member_replaced_in_one_commit_keeps_its_identity_free() {
    let (mut clients, state) = channel_of(&["bob", "carol"]);
    // Bob's new device: the identity "bob" with a new key, added as the old leaf is removed.
    let new_bob = Client::new("bob");
    let remove = clients[0].propose_remove(1);
    assert!(matches!(
        state.check_handshake(&remove, &[]).unwrap(),
        Handshake::Proposal { sender: 0 }
    ));
    let (add, _) = clients[0].add(&[new_bob.key_package()]);
    let out = commit(&state, &add, &[&remove]);
    assert_eq!((out.added, out.removed), (vec![1], vec![1]));
    assert_eq!(
        members(&out.next),
        roster(&[(0, "alice"), (1, "bob"), (2, "carol")])
    );
    assert_eq!(
        out.next.leaf(1).unwrap().signature_key,
        new_bob.credential.signature_key.as_slice()
    );
}

#[test]
fn a_second_leaf_with_an_identity_in_the_group_is_refused() {
    let (mut clients, state) = channel_of(&["bob"]);
    let impostor = Client::new("bob");
    let (add, _) = clients[0].add(&[impostor.key_package()]);
    let err = refused(&state, &add, &[]);
    assert_eq!(
        err,
        GroupError::DuplicateIdentity {
            identity: "bob".into(),
            first: 1,
            second: 2
        }
    );
    assert_eq!(err.kind(), ErrorKind::InvalidArgument);
    assert_eq!(
        err.to_string(),
        "identity \"bob\" would be held by leaves 1 and 2"
    );
}

#[test]
fn a_private_message_handshake_is_refused() {
    let (mut clients, state) = channel_of(&["bob"]);
    let bob = &mut clients[1];
    let config = join_config(MIXED_CIPHERTEXT_WIRE_FORMAT_POLICY);
    bob.group
        .as_mut()
        .unwrap()
        .set_configuration(bob.provider.storage(), &config)
        .unwrap();
    let update = bob.self_update();
    let err = refused(&state, &update, &[]);
    assert_eq!(err, GroupError::NotPublic);
    assert_eq!(err.kind(), ErrorKind::InvalidArgument);
    assert_eq!(err.to_string(), "handshake messages must be PublicMessages");
}

#[test]
fn a_commit_signed_by_a_non_member_is_refused() {
    let (_clients, state) = channel_of(&["bob"]);
    // Mallory's look-alike: the same group id, brought to the same epoch, she at leaf 0.
    let mut mallory = Client::new("alice");
    mallory.create(CHANNEL.as_bytes());
    mallory.self_update();
    assert_eq!(mallory.epoch(), state.epoch());
    let forged = mallory.self_update();
    let err = refused(&state, &forged, &[]);
    assert_eq!(err, GroupError::BadSignature("commit"));
    assert_eq!(err.kind(), ErrorKind::PermissionDenied);
    assert_eq!(err.to_string(), "the commit's signature does not verify");
}

#[test]
fn a_commit_by_a_removed_member_is_refused() {
    let (mut clients, state) = channel_of(&["bob", "carol"]);
    let remove = clients[0].remove(&[1]);
    let state = commit(&state, &remove, &[]).next;
    assert_eq!(state.epoch(), 2);
    // Bob, with his real key, in a look-alike group at leaf 1 and the channel's new epoch.
    let bob_keys = signature_keys();
    let mut bob_now = Client::with_keys("bob", bob_keys.clone());
    let mut mallory = Client::new("mallory");
    mallory.create(CHANNEL.as_bytes());
    let (_, welcome) = mallory.add(&[bob_now.key_package()]);
    bob_now.join(&welcome);
    assert_eq!((bob_now.index(), bob_now.epoch()), (1, 1));
    mallory.receive(&bob_now.self_update());
    assert_eq!(bob_now.epoch(), state.epoch());
    let late = bob_now.self_update();
    let err = refused(&state, &late, &[]);
    assert_eq!(err, GroupError::NotMember { epoch: 2 });
    assert_eq!(err.kind(), ErrorKind::PermissionDenied);
    assert_eq!(
        err.to_string(),
        "the sender is not a member of the group at epoch 2"
    );
}

#[test]
fn a_handshake_from_an_external_sender_or_a_new_member_is_refused() {
    let (mut clients, state) = channel_of(&["bob"]);
    let update = clients[1].self_update();
    // The sender field follows version, wire format, the group id and the epoch.
    let at = 4 + 1 + CHANNEL.len() + 8;
    assert_eq!(&update[at..at + 5], &[1, 0, 0, 0, 1]);
    // Without a member sender there is no membership tag (a one-byte length and 32 bytes).
    let resent = |sender: &[u8]| {
        let mut forged = update[..at].to_vec();
        forged.extend_from_slice(sender);
        forged.extend_from_slice(&update[at + 5..update.len() - 33]);
        refused(&state, &forged, &[])
    };
    for (sender, who) in [
        (&[2u8, 0, 0, 0, 0][..], "an external sender"),
        (&[4u8][..], "a new member"),
    ] {
        let err = resent(sender);
        assert_eq!(err, GroupError::NotMemberSender(who));
        assert_eq!(err.kind(), ErrorKind::PermissionDenied);
    }
}

#[test]
fn a_commit_at_another_epoch_is_refused() {
    let mut alice = Client::new("alice");
    alice.create(CHANNEL.as_bytes());
    let state0 = GroupState::create(CHANNEL, &alice.group_info(true), &[]).unwrap();
    let first = alice.self_update();
    let state1 = commit(&state0, &first, &[]).next;
    let second = alice.self_update();
    // An old commit, and one from an epoch the channel has not reached.
    assert_eq!(
        refused(&state1, &first, &[]),
        GroupError::WrongEpoch {
            message: 0,
            group: 1
        }
    );
    let err = refused(&state0, &second, &[]);
    assert_eq!(
        err,
        GroupError::WrongEpoch {
            message: 1,
            group: 0
        }
    );
    assert_eq!(err.kind(), ErrorKind::InvalidArgument);
    assert_eq!(commit(&state1, &second, &[]).next.epoch(), 2);
}

#[test]
fn a_commit_by_reference_needs_its_proposals() {
    let (mut clients, state) = channel_of(&["bob", "carol"]);
    let leave = clients[1].leave();
    clients[0].receive(&leave);
    let covered = clients[0].commit_pending();
    for proposals in [&[][..], &[&b"not a proposal"[..]][..]] {
        let err = refused(&state, &covered, proposals);
        assert_eq!(err, GroupError::MissingProposal);
        assert_eq!(err.kind(), ErrorKind::InvalidArgument);
    }
    // A proposal from another epoch is skipped, as if not given.
    let stale = {
        let (mut others, _) = channel_of(&["bob"]);
        others[1].leave()
    };
    assert_eq!(
        refused(&state, &covered, &[&stale]),
        GroupError::MissingProposal
    );
    let out = commit(&state, &covered, &[&stale, &leave]);
    assert_eq!(out.removed, vec![1]);
}

#[test]
fn garbage_is_refused_as_malformed() {
    let (_clients, state) = channel_of(&["bob"]);
    for garbage in [&b""[..], b"\x00", b"\x00\x01\x00\x01", b"hello world"] {
        let err = refused(&state, garbage, &[]);
        assert!(matches!(err, GroupError::Malformed { .. }), "{err}");
        assert_eq!(err.kind(), ErrorKind::InvalidArgument);
    }
    // Other MLSMessages: a key package, a group info.
    let outsider = Client::new("erin");
    let key_package = bytes(&MlsMessageOut::from(outsider.key_package()));
    assert_eq!(
        refused(&state, &key_package, &[]),
        GroupError::NotHandshake("a key package")
    );
    let mut erin = outsider;
    erin.create(b"elsewhere");
    assert_eq!(
        refused(&state, &erin.group_info(false), &[]),
        GroupError::NotHandshake("a group info")
    );
    // A handshake for another group.
    assert_eq!(
        refused(&state, &erin.self_update(), &[]),
        GroupError::WrongGroup
    );
}

#[test]
fn create_checks_the_group_it_is_given() {
    let mut alice = Client::new("alice");
    alice.create(CHANNEL.as_bytes());
    let info = alice.group_info(true);
    let err = |gi: &[u8], tree: &[u8]| GroupState::create(CHANNEL, gi, tree).unwrap_err();
    assert_eq!(
        GroupState::create("acme/team/other", &info, &[]).unwrap_err(),
        GroupError::WrongGroup
    );
    assert_eq!(
        err(&alice.group_info(false), &[]),
        GroupError::NoRatchetTree
    );
    assert!(matches!(
        err(&info[..info.len() - 1], &[]),
        GroupError::Malformed {
            what: "group info",
            ..
        }
    ));
    assert!(matches!(
        err(&info, b"\x01\x02"),
        GroupError::Malformed {
            what: "ratchet tree",
            ..
        }
    ));
    assert_eq!(
        err(&bytes(&MlsMessageOut::from(alice.key_package())), &[]),
        GroupError::NotGroupInfo("key package")
    );
    // A tree that is not the group's.
    let mut other = Client::new("alice");
    other.create(CHANNEL.as_bytes());
    let e = err(&alice.group_info(false), &other.ratchet_tree());
    assert!(matches!(e, GroupError::InvalidGroupInfo(_)), "{e}");
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    // A group past its first epoch.
    alice.self_update();
    assert_eq!(
        err(&alice.group_info(true), &[]),
        GroupError::NotNewGroup(1)
    );
    // Another cipher suite.
    let mut chacha = Client::new("alice");
    chacha.create_with(
        CHANNEL.as_bytes(),
        Ciphersuite::MLS_128_DHKEMX25519_CHACHA20POLY1305_SHA256_Ed25519,
    );
    assert_eq!(
        err(&chacha.group_info(true), &[]),
        GroupError::WrongCiphersuite(3, 1)
    );
}

#[test]
fn the_stored_form_reads_back_exactly_and_refuses_damage() {
    let (_clients, state) = channel_of(&["bob", "carol"]);
    let stored = state.to_bytes().unwrap();
    assert_eq!(stored[0], 1);
    let loaded = GroupState::from_bytes(&stored).unwrap();
    assert_eq!(loaded.to_bytes().unwrap(), stored);
    assert_eq!(loaded.members(), state.members());
    for cut in [0, 1, 3, 5, stored.len() / 2, stored.len() - 1] {
        let err = GroupState::from_bytes(&stored[..cut]).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Internal, "cut at {cut}: {err}");
    }
    let mut trailing = stored.clone();
    trailing.push(0);
    assert!(GroupState::from_bytes(&trailing).unwrap_err().is_internal());
    let mut future = stored;
    future[0] = 2;
    assert!(GroupState::from_bytes(&future).unwrap_err().is_internal());
}

#[test]
fn a_leaf_binding_verifies_for_its_leaf_account_and_key_only() {
    let (mut clients, state) = channel_of(&["bob", "carol"]);
    let bob_key = state.leaf(1).unwrap().encryption_key;
    let binding = clients[1].binding("acct-bob", &bob_key);
    assert_eq!(state.verify_binding(1, "acct-bob", &binding), Ok(()));
    let denied = |leaf, account, signature: &[u8]| {
        let err = state.verify_binding(leaf, account, signature).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::PermissionDenied, "{err}");
        err
    };
    assert_eq!(
        denied(1, "acct-mallory", &binding),
        GroupError::BadBinding { leaf: 1 }
    );
    assert_eq!(
        denied(2, "acct-bob", &binding),
        GroupError::BadBinding { leaf: 2 }
    );
    assert_eq!(
        denied(7, "acct-bob", &binding),
        GroupError::NoSuchLeaf { leaf: 7, epoch: 1 }
    );
    // Carol's key over bob's binding content.
    let carols = clients[2].binding("acct-bob", &bob_key);
    assert_eq!(
        denied(1, "acct-bob", &carols),
        GroupError::BadBinding { leaf: 1 }
    );
    assert_eq!(
        denied(1, "acct-bob", &binding[..10]),
        GroupError::BadBinding { leaf: 1 }
    );
    // After an update the leaf has a new encryption key: the old binding no longer holds.
    let update = clients[1].self_update();
    let next = commit(&state, &update, &[]).next;
    assert!(next.verify_binding(1, "acct-bob", &binding).is_err());
    let fresh = clients[1].binding("acct-bob", &next.leaf(1).unwrap().encryption_key);
    assert_eq!(next.verify_binding(1, "acct-bob", &fresh), Ok(()));
}

#[test]
fn group_state_is_send_and_sync() {
    fn shareable<T: Send + Sync>() {}
    shareable::<GroupState>();
    shareable::<GroupError>();
}

/// A valid commit and the state it is checked against, for the property tests.
fn fixture() -> (GroupState, Vec<u8>) {
    let (mut clients, state) = channel_of(&["bob"]);
    (state, clients[1].self_update())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn truncated_commits_are_malformed(cut in 0usize..1usize << 16) {
        thread_local!(static FIXTURE: (GroupState, Vec<u8>) = fixture());
        FIXTURE.with(|(state, commit)| {
            let cut = cut % commit.len();
            let err = state.check_handshake(&commit[..cut], &[]).unwrap_err();
            prop_assert!(matches!(err, GroupError::Malformed { .. }), "{}", err);
            Ok(())
        })?;
    }

    #[test]
    fn random_bytes_are_refused(garbage in proptest::collection::vec(any::<u8>(), 0..600)) {
        thread_local!(static FIXTURE: (GroupState, Vec<u8>) = fixture());
        FIXTURE.with(|(state, _)| {
            let err = state.check_handshake(&garbage, &[]).unwrap_err();
            prop_assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{}", err);
            Ok(())
        })?;
    }
}

/// Median time of `f` over `runs` runs (the machine is shared: the median shrugs off others'
/// bursts).
fn timed<T>(runs: u32, mut f: impl FnMut() -> T) -> Duration {
    let mut times: Vec<Duration> = (0..runs)
        .map(|_| {
            let start = Instant::now();
            std::hint::black_box(f());
            start.elapsed()
        })
        .collect();
    times.sort_unstable();
    times[times.len() / 2]
}

/// The figures of the brief: `cargo test --release -p static-relay --test group -- --ignored
/// --nocapture timings`.
#[test]
#[ignore]
fn timings() {
    for size in [2usize, 32, 128, 512] {
        let mut alice = Client::new("alice");
        alice.create(CHANNEL.as_bytes());
        let state0 = GroupState::create(CHANNEL, &alice.group_info(true), &[]).unwrap();
        let others: Vec<_> = (1..size).map(|i| Client::new(&format!("m{i}"))).collect();
        let key_packages: Vec<_> = others.iter().map(Client::key_package).collect();
        let (add_all, _) = alice.add(&key_packages);
        let started = Instant::now();
        let state = commit(&state0, &add_all, &[]).next;
        let add_all_time = started.elapsed();
        assert_eq!(state.members().len(), size);

        let (add, _) = alice.add(&[Client::new("newcomer").key_package()]);
        let runs = if size > 128 { 31 } else { 101 };
        let check = timed(runs, || commit(&state, &add, &[]));
        // A self-update (a commit with a path) at the epoch after the add.
        let state1 = commit(&state, &add, &[]).next;
        let update = alice.self_update();
        let update_check = timed(runs, || commit(&state1, &update, &[]));
        let stored = state.to_bytes().unwrap();
        let to_bytes = timed(runs, || state.to_bytes().unwrap());
        let from_bytes = timed(runs, || GroupState::from_bytes(&stored).unwrap());
        let mut mallory = Client::new("alice");
        mallory.create(CHANNEL.as_bytes());
        mallory.self_update();
        let forged = mallory.self_update();
        let forged_check = timed(runs, || refused(&state, &forged, &[]));
        let garbage_check = timed(runs, || refused(&state, &add[..add.len() / 2], &[]));
        println!(
            "size {size:>3}: check add commit {check:>10.2?}  check update commit \
             {update_check:>10.2?}  to_bytes {to_bytes:>9.2?}  from_bytes {from_bytes:>10.2?}  stored {:>7} B  forged {forged_check:>8.2?}  \
             truncated {garbage_check:>8.2?}  add {} at once {add_all_time:>9.2?}",
            stored.len(),
            size - 1,
        );
    }
}

/// Every byte of a commit flipped in turn: never a bug, and refused unless the flip lands in
/// one of the two MACs a commit ends with, the confirmation tag and the membership tag, which
/// the relay cannot check (it has neither key, and the signature covers neither).
#[test]
fn every_flipped_byte_of_a_commit_is_refused_outside_the_macs() {
    let (state, commit) = fixture();
    let len = commit.len();
    let mut accepted = Vec::new();
    for at in 0..len {
        let mut flipped = commit.clone();
        flipped[at] ^= 0x01;
        match state.check_handshake(&flipped, &[]) {
            Ok(_) => accepted.push(at),
            Err(err) => assert!(!err.is_internal(), "flip at {at}: {err}"),
        }
    }
    let macs: Vec<usize> = (len - 65..len - 33).chain(len - 32..len).collect();
    assert_eq!(accepted, macs);
}
