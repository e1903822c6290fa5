//! The relay's contract: handshakes travel as PublicMessages (application messages as
//! PrivateMessages), a `PublicGroup` built from `Engine::public_state` follows the channel's
//! commits, and a leaf binding verifies against the leaf the relay sees.
#![allow(clippy::unwrap_used)]

mod common;

use common::{agent, app, group_of, member_names, Agent, CH};
use openmls::prelude::tls_codec::{Deserialize as _, Serialize as _};
use openmls::prelude::*;
use openmls_memory_storage::MemoryStorage;
use openmls_rust_crypto::RustCrypto;
use static_mls::binding::verify_leaf_binding;
use static_mls::store::DB_FILE;
use static_mls::{Engine, Incoming, PublicState};

/// The first four bytes of an `MLSMessage`: version mls10, then the wire format.
const PUBLIC: [u8; 4] = [0, 1, 0, 1];
const PRIVATE: [u8; 4] = [0, 1, 0, 2];

fn head(message: &[u8]) -> [u8; 4] {
    message[..4].try_into().unwrap()
}

/// What the relay does with a channel's public state, as it will: OpenMLS's `PublicGroup`.
struct Relay {
    group: PublicGroup,
    storage: MemoryStorage,
    crypto: RustCrypto,
}

/// What the relay made of a handshake.
#[derive(Debug, PartialEq)]
enum Accepted {
    Commit,
    Proposal,
}

impl Relay {
    fn new(state: &PublicState) -> Self {
        let group_info = match MlsMessageIn::tls_deserialize_exact(&state.group_info)
            .unwrap()
            .extract()
        {
            MlsMessageBodyIn::GroupInfo(info) => info,
            other => panic!("not a group info: {other:?}"),
        };
        let tree = RatchetTreeIn::tls_deserialize_exact(&state.ratchet_tree).unwrap();
        let (storage, crypto) = (MemoryStorage::default(), RustCrypto::default());
        let (group, _) =
            PublicGroup::from_external(&crypto, &storage, tree, group_info, ProposalStore::new())
                .unwrap();
        Self {
            group,
            storage,
            crypto,
        }
    }

    /// Validates a handshake and applies it to the public state.
    fn accept(&mut self, message: &[u8]) -> Result<Accepted, String> {
        let protocol = MlsMessageIn::tls_deserialize_exact(message)
            .map_err(|e| format!("{e:?}"))?
            .try_into_protocol_message()
            .map_err(|e| format!("{e:?}"))?;
        let processed = self
            .group
            .process_message(&self.crypto, protocol)
            .map_err(|e| format!("{e:?}"))?;
        match processed.into_content() {
            ProcessedMessageContent::StagedCommitMessage(staged) => {
                self.group.merge_commit(&self.storage, *staged).unwrap();
                Ok(Accepted::Commit)
            }
            ProcessedMessageContent::ProposalMessage(proposal) => {
                self.group.add_proposal(&self.storage, *proposal).unwrap();
                Ok(Accepted::Proposal)
            }
            other => Err(format!("unexpected {other:?}")),
        }
    }

    /// Whether `commit` (valid for the current epoch) carries an update path; not applied.
    fn has_path(&self, commit: &[u8]) -> bool {
        let protocol = MlsMessageIn::tls_deserialize_exact(commit)
            .unwrap()
            .try_into_protocol_message()
            .unwrap();
        match self
            .group
            .process_message(&self.crypto, protocol)
            .unwrap()
            .into_content()
        {
            ProcessedMessageContent::StagedCommitMessage(staged) => {
                staged.update_path_leaf_node().is_some()
            }
            other => panic!("not a commit: {other:?}"),
        }
    }

    fn epoch(&self) -> u64 {
        self.group.group_context().epoch().as_u64()
    }

    fn tree(&self) -> Vec<u8> {
        self.group
            .export_ratchet_tree()
            .tls_serialize_detached()
            .unwrap()
    }

    /// The signature and encryption keys of a leaf, as the relay checks a binding against them.
    fn leaf_keys(&self, index: u32) -> (Vec<u8>, Vec<u8>) {
        let member = self
            .group
            .members()
            .find(|m| m.index.u32() == index)
            .unwrap();
        (member.signature_key, member.encryption_key)
    }

    /// The relay's state is the members': same epoch, same tree.
    fn assert_follows(&self, member: &Agent) {
        assert_eq!(self.epoch(), member.engine.epoch(CH).unwrap());
        let state = member.engine.public_state(CH).unwrap();
        assert_eq!(self.tree(), state.ratchet_tree);
    }
}

#[test]
fn handshakes_are_public_messages_and_application_messages_private() {
    let (a, b, c) = (agent("alice"), agent("bob"), agent("carol"));
    for add in group_of(&a, &[&b, &c]) {
        assert_eq!(head(&add), PUBLIC);
    }

    let m = a.engine.encrypt(CH, b"hello").unwrap();
    assert_eq!(head(&m), PRIVATE);
    for x in [&b, &c] {
        assert_eq!(
            x.engine.process_incoming(CH, &m).unwrap(),
            app(b"alice", b"hello", 2)
        );
    }
    assert_eq!(a.engine.process_incoming(CH, &m).unwrap(), Incoming::Own);

    // A self-update.
    let update = b.engine.self_update(CH).unwrap();
    assert_eq!(head(&update), PUBLIC);
    assert_eq!(
        b.engine.process_incoming(CH, &update).unwrap(),
        Incoming::OwnCommit { epoch: 3 }
    );
    for x in [&a, &c] {
        assert!(matches!(
            x.engine.process_incoming(CH, &update).unwrap(),
            Incoming::Commit { epoch: 3, .. }
        ));
    }
    let m = c.engine.encrypt(CH, b"after the update").unwrap();
    assert_eq!(head(&m), PRIVATE);
    assert_eq!(
        b.engine.process_incoming(CH, &m).unwrap(),
        app(b"carol", b"after the update", 3)
    );

    // A leave proposal, and the commit of it.
    let leave = c.engine.leave(CH).unwrap();
    assert_eq!(head(&leave), PUBLIC);
    // Our own proposal, now readable to us, is still recognised as ours.
    assert_eq!(
        c.engine.process_incoming(CH, &leave).unwrap(),
        Incoming::Own
    );
    for x in [&a, &b] {
        assert_eq!(
            x.engine.process_incoming(CH, &leave).unwrap(),
            Incoming::Proposal {
                sender: Some(b"carol".to_vec())
            }
        );
    }
    let commit = b.engine.commit_pending_proposals(CH).unwrap().unwrap();
    assert_eq!(head(&commit), PUBLIC);
    assert_eq!(
        b.engine.process_incoming(CH, &commit).unwrap(),
        Incoming::OwnCommit { epoch: 4 }
    );
    assert!(matches!(
        a.engine.process_incoming(CH, &commit).unwrap(),
        Incoming::Commit { epoch: 4, .. }
    ));
    assert_eq!(
        c.engine.process_incoming(CH, &commit).unwrap(),
        Incoming::Removed {
            epoch: 4,
            members: b.engine.members(CH).unwrap(),
            by_relay: false,
        }
    );

    // An add and a removal.
    let d = agent("dave");
    let added = a
        .engine
        .add_member(CH, &d.engine.generate_key_package().unwrap())
        .unwrap();
    assert_eq!(head(&added.commit), PUBLIC);
    a.engine.process_incoming(CH, &added.commit).unwrap();
    b.engine.process_incoming(CH, &added.commit).unwrap();
    d.engine.join_group(CH, &added.welcome).unwrap();
    let m = d.engine.encrypt(CH, b"hi").unwrap();
    assert_eq!(head(&m), PRIVATE);
    assert_eq!(
        a.engine.process_incoming(CH, &m).unwrap(),
        app(b"dave", b"hi", 5)
    );
    let removal = b.engine.remove_member(CH, b"dave").unwrap();
    assert_eq!(head(&removal), PUBLIC);
    b.engine.process_incoming(CH, &removal).unwrap();
    a.engine.process_incoming(CH, &removal).unwrap();
    assert_eq!(
        d.engine.process_incoming(CH, &removal).unwrap(),
        Incoming::Removed {
            epoch: 6,
            members: b.engine.members(CH).unwrap(),
            by_relay: false,
        }
    );
    assert_eq!(member_names(&a), vec![b"alice".to_vec(), b"bob".to_vec()]);
    assert_eq!(
        a.engine.epoch_authenticator(CH).unwrap(),
        b.engine.epoch_authenticator(CH).unwrap()
    );
}

#[test]
fn an_own_public_commit_that_is_not_pending_is_refused_as_such() {
    let (a, b) = (agent("alice"), agent("bob"));
    group_of(&a, &[&b]);
    let refused = a.engine.self_update(CH).unwrap();
    a.engine.clear_pending_commit(CH).unwrap();
    let err = a.engine.process_incoming(CH, &refused).unwrap_err();
    assert!(
        matches!(
            err,
            static_mls::Error::Process(static_mls::ProcessError::UnknownOwnCommit)
        ),
        "{err:?}"
    );
    assert_eq!(a.engine.epoch(CH).unwrap(), 1);
}

#[test]
fn a_public_group_built_from_the_public_state_follows_the_channel() {
    let (a, b, c) = (agent("alice"), agent("bob"), agent("carol"));
    a.engine.create_group(CH).unwrap();
    // CreateChannel: the creator's state at epoch 0.
    let mut relay = Relay::new(&a.engine.public_state(CH).unwrap());
    relay.assert_follows(&a);
    assert_eq!(relay.group.members().count(), 1);

    let add = a
        .engine
        .add_member(CH, &b.engine.generate_key_package().unwrap())
        .unwrap();
    assert_eq!(relay.accept(&add.commit), Ok(Accepted::Commit));
    a.engine.process_incoming(CH, &add.commit).unwrap();
    b.engine.join_group(CH, &add.welcome).unwrap();
    relay.assert_follows(&a);

    let update = b.engine.self_update(CH).unwrap();
    assert_eq!(relay.accept(&update), Ok(Accepted::Commit));
    for x in [&a, &b] {
        x.engine.process_incoming(CH, &update).unwrap();
    }
    relay.assert_follows(&b);

    // Application messages are not the relay's to read.
    let m = a.engine.encrypt(CH, b"private").unwrap();
    assert!(relay.accept(&m).is_err());

    // A commit of a past epoch (a replay) is refused; so is one whose signed content changed.
    assert!(relay.accept(&add.commit).is_err());
    let add = a
        .engine
        .add_member(CH, &c.engine.generate_key_package().unwrap())
        .unwrap();
    let mut tampered = add.commit.clone();
    tampered[add.commit.len() / 2] ^= 1;
    assert!(relay.accept(&tampered).is_err());
    // The membership tag (the last bytes: a MAC under a key only members hold) is beyond the
    // relay: a commit with a wrong one passes the public group, the members refuse it.
    let mut bad_tag = add.commit.clone();
    bad_tag[add.commit.len() - 1] ^= 1;
    let mut blind = Relay::new(&b.engine.public_state(CH).unwrap());
    assert_eq!(blind.accept(&bad_tag), Ok(Accepted::Commit));
    assert!(b.engine.process_incoming(CH, &bad_tag).is_err());
    assert_eq!(relay.accept(&add.commit), Ok(Accepted::Commit));
    for x in [&a, &b] {
        x.engine.process_incoming(CH, &add.commit).unwrap();
    }
    c.engine.join_group(CH, &add.welcome).unwrap();
    relay.assert_follows(&c);

    // A leave proposal, then its commit (which names the proposal by reference).
    let leave = b.engine.leave(CH).unwrap();
    assert_eq!(relay.accept(&leave), Ok(Accepted::Proposal));
    for x in [&a, &b, &c] {
        x.engine.process_incoming(CH, &leave).unwrap();
    }
    let commit = c.engine.commit_pending_proposals(CH).unwrap().unwrap();
    assert_eq!(relay.accept(&commit), Ok(Accepted::Commit));
    for x in [&a, &b, &c] {
        x.engine.process_incoming(CH, &commit).unwrap();
    }
    relay.assert_follows(&a);
    assert_eq!(relay.group.members().count(), 2);

    // The state exported by a member later on (not the creator, not at epoch 0) serves too.
    let mut late = Relay::new(&c.engine.public_state(CH).unwrap());
    let removal = c.engine.remove_member(CH, b"alice").unwrap();
    assert_eq!(late.accept(&removal), Ok(Accepted::Commit));
    assert_eq!(relay.accept(&removal), Ok(Accepted::Commit));
    assert_eq!(relay.tree(), late.tree());
}

#[test]
fn a_leaf_binding_verifies_against_the_leaf_the_relay_sees() {
    let (a, b) = (agent("alice"), agent("bob"));
    group_of(&a, &[&b]);
    let binding = b.engine.leaf_binding(CH, "account-b").unwrap();
    let relay = Relay::new(&a.engine.public_state(CH).unwrap());
    let (signature_key, encryption_key) = relay.leaf_keys(binding.leaf_index);
    assert_eq!(signature_key, b.engine.signature_public_key());
    let verify = |account: &str, encryption_key: &[u8], signature: &[u8]| {
        verify_leaf_binding(
            &signature_key,
            CH.as_bytes(),
            account,
            encryption_key,
            signature,
        )
    };
    assert!(verify("account-b", &encryption_key, &binding.signature));
    assert!(!verify("account-a", &encryption_key, &binding.signature));
    // Alice's binding is for her own leaf.
    let theirs = a.engine.leaf_binding(CH, "account-b").unwrap();
    assert_ne!(theirs.leaf_index, binding.leaf_index);
    assert!(!verify("account-b", &encryption_key, &theirs.signature));

    // Bob's update changes his leaf's encryption key: the old binding no longer holds.
    let update = b.engine.self_update(CH).unwrap();
    for x in [&a, &b] {
        x.engine.process_incoming(CH, &update).unwrap();
    }
    let relay = Relay::new(&a.engine.public_state(CH).unwrap());
    let (same_key, new_encryption_key) = relay.leaf_keys(binding.leaf_index);
    assert_eq!(same_key, signature_key);
    assert_ne!(new_encryption_key, encryption_key);
    let renewed = b.engine.leaf_binding(CH, "account-b").unwrap();
    assert_eq!(renewed.leaf_index, binding.leaf_index);
    assert_ne!(renewed.signature, binding.signature);
    assert!(verify("account-b", &new_encryption_key, &renewed.signature));
    assert!(!verify(
        "account-b",
        &new_encryption_key,
        &binding.signature
    ));
}

#[test]
fn public_state_and_leaf_binding_need_the_group() {
    let a = agent("alice");
    assert!(a.engine.public_state(CH).unwrap_err().is_unknown_group());
    assert!(a
        .engine
        .leaf_binding(CH, "x")
        .unwrap_err()
        .is_unknown_group());
}

/// A group stored by an earlier version, whose policy sent handshakes encrypted, sends them
/// as PublicMessages once reopened, and keeps the new policy on disk.
#[test]
fn a_group_stored_with_encrypted_handshakes_moves_to_public_ones() {
    let (a, b) = (agent("alice"), agent("bob"));
    group_of(&a, &[&b]);
    let Agent { dir, engine } = a;
    drop(engine);
    let db = dir.path().join(DB_FILE);
    let (new, old) = (
        r#""outgoing":"AlwaysPlaintext""#,
        r#""outgoing":"AlwaysCiphertext""#,
    );
    let config = |conn: &rusqlite::Connection| -> String {
        let blob: Vec<u8> = conn
            .query_row(
                "SELECT group_data FROM openmls_group_data WHERE data_type = 'join_group_config'",
                [],
                |row| row.get(0),
            )
            .unwrap();
        String::from_utf8(blob).unwrap()
    };
    {
        let conn = rusqlite::Connection::open(&db).unwrap();
        let stored = config(&conn);
        assert!(stored.contains(new), "{stored}");
        let legacy = stored.replace(new, old);
        conn.execute(
            "UPDATE openmls_group_data SET group_data = ?1 WHERE data_type = 'join_group_config'",
            [legacy.as_bytes()],
        )
        .unwrap();
    }
    let engine = Engine::open(dir.path(), b"alice").unwrap();
    let update = engine.self_update(CH).unwrap();
    assert_eq!(head(&update), PUBLIC);
    assert!(matches!(
        b.engine.process_incoming(CH, &update).unwrap(),
        Incoming::Commit { epoch: 2, .. }
    ));
    engine.process_incoming(CH, &update).unwrap();
    drop(engine);
    let conn = rusqlite::Connection::open(&db).unwrap();
    assert!(config(&conn).contains(new));
}

/// A member of an earlier version (an OpenMLS client whose handshakes are PrivateMessages)
/// and ours understand each other: incoming handshakes may be of either wire format.
#[test]
fn members_still_read_encrypted_handshakes() {
    use openmls_basic_credential::SignatureKeyPair;
    use openmls_rust_crypto::OpenMlsRustCrypto;

    let a = agent("alice");
    a.engine.create_group(CH).unwrap();
    let provider = OpenMlsRustCrypto::default();
    let signer = SignatureKeyPair::new(SignatureScheme::ED25519).unwrap();
    let credential = CredentialWithKey {
        credential: BasicCredential::new(b"old".to_vec()).into(),
        signature_key: signer.public().into(),
    };
    let key_package = KeyPackage::builder()
        .build(static_mls::CIPHERSUITE, &provider, &signer, credential)
        .unwrap();
    let key_package = MlsMessageOut::from(key_package.key_package().clone())
        .tls_serialize_detached()
        .unwrap();
    let add = a.engine.add_member(CH, &key_package).unwrap();
    a.engine.process_incoming(CH, &add.commit).unwrap();
    let MlsMessageBodyIn::Welcome(welcome) = MlsMessageIn::tls_deserialize_exact(&add.welcome)
        .unwrap()
        .extract()
    else {
        panic!("not a Welcome");
    };
    let legacy = MlsGroupJoinConfig::builder()
        .use_ratchet_tree_extension(true)
        .wire_format_policy(MIXED_CIPHERTEXT_WIRE_FORMAT_POLICY)
        .build();
    let mut old = StagedWelcome::new_from_welcome(&provider, &legacy, welcome, None)
        .unwrap()
        .into_group(&provider)
        .unwrap();
    let process_old = |old: &mut MlsGroup, message: &[u8]| {
        let protocol = MlsMessageIn::tls_deserialize_exact(message)
            .unwrap()
            .try_into_protocol_message()
            .unwrap();
        old.process_message(&provider, protocol)
            .unwrap()
            .into_content()
    };

    // Its encrypted commit, read by us; our public one, read by it.
    let update = old
        .self_update(&provider, &signer, LeafNodeParameters::default())
        .unwrap();
    let update = update.commit().tls_serialize_detached().unwrap();
    assert_eq!(head(&update), PRIVATE);
    assert_eq!(
        a.engine.process_incoming(CH, &update).unwrap(),
        Incoming::Commit {
            sender: Some(b"old".to_vec()),
            epoch: 2
        }
    );
    old.merge_pending_commit(&provider).unwrap();
    let ours = a.engine.self_update(CH).unwrap();
    assert_eq!(head(&ours), PUBLIC);
    a.engine.process_incoming(CH, &ours).unwrap();
    let ProcessedMessageContent::StagedCommitMessage(staged) = process_old(&mut old, &ours) else {
        panic!("not a commit");
    };
    old.merge_staged_commit(&provider, *staged).unwrap();
    assert_eq!(
        old.epoch_authenticator().as_slice(),
        a.engine.epoch_authenticator(CH).unwrap()
    );

    // Application messages both ways.
    let m = old
        .create_message(&provider, &signer, b"from before")
        .unwrap();
    let m = m.tls_serialize_detached().unwrap();
    assert_eq!(
        a.engine.process_incoming(CH, &m).unwrap(),
        app(b"old", b"from before", 3)
    );
    let m = a.engine.encrypt(CH, b"from now").unwrap();
    let ProcessedMessageContent::ApplicationMessage(m) = process_old(&mut old, &m) else {
        panic!("not an application message");
    };
    assert_eq!(m.into_bytes(), b"from now");

    // Its encrypted leave proposal, committed by us.
    let leave = old.leave_group(&provider, &signer).unwrap();
    let leave = leave.tls_serialize_detached().unwrap();
    assert_eq!(head(&leave), PRIVATE);
    assert_eq!(
        a.engine.process_incoming(CH, &leave).unwrap(),
        Incoming::Proposal {
            sender: Some(b"old".to_vec())
        }
    );
    let commit = a.engine.commit_pending_proposals(CH).unwrap().unwrap();
    a.engine.process_incoming(CH, &commit).unwrap();
    assert_eq!(member_names(&a), vec![b"alice".to_vec()]);
}

#[test]
fn add_commits_carry_no_path_unless_a_proposal_needs_one() {
    let (a, b, c, d) = (agent("alice"), agent("bob"), agent("carol"), agent("dave"));
    group_of(&a, &[&b]);
    let mut relay = Relay::new(&a.engine.public_state(CH).unwrap());
    let leaf_before = relay.leaf_keys(0);
    let secret_before = a.engine.epoch_authenticator(CH).unwrap();

    // A plain add: no path, accepted by the relay's public group and by the members, and the
    // epoch (and its secrets) advance all the same.
    let add = a
        .engine
        .add_member(CH, &c.engine.generate_key_package().unwrap())
        .unwrap();
    assert!(!relay.has_path(&add.commit));
    assert_eq!(relay.accept(&add.commit), Ok(Accepted::Commit));
    for x in [&a, &b] {
        x.engine.process_incoming(CH, &add.commit).unwrap();
    }
    c.engine.join_group(CH, &add.welcome).unwrap();
    relay.assert_follows(&c);
    let secret = a.engine.epoch_authenticator(CH).unwrap();
    assert_ne!(secret, secret_before);
    for x in [&b, &c] {
        assert_eq!(x.engine.epoch_authenticator(CH).unwrap(), secret);
    }
    // The committer's leaf was not refreshed by the add...
    assert_eq!(relay.leaf_keys(0), leaf_before);
    let m = c.engine.encrypt(CH, b"after a path-less add").unwrap();
    for x in [&a, &b] {
        assert_eq!(
            x.engine.process_incoming(CH, &m).unwrap(),
            app(b"carol", b"after a path-less add", 2)
        );
    }
    // ...a key rotation (self_update) is what refreshes it.
    let update = a.engine.self_update(CH).unwrap();
    assert!(relay.has_path(&update));
    assert_eq!(relay.accept(&update), Ok(Accepted::Commit));
    for x in [&a, &b, &c] {
        x.engine.process_incoming(CH, &update).unwrap();
    }
    assert_ne!(relay.leaf_keys(0).1, leaf_before.1);

    // An add that also commits a pending Remove (bob leaving) needs a path (RFC 9420 §12.4),
    // and gets one.
    let leave = b.engine.leave(CH).unwrap();
    assert_eq!(relay.accept(&leave), Ok(Accepted::Proposal));
    for x in [&a, &b, &c] {
        x.engine.process_incoming(CH, &leave).unwrap();
    }
    let add = a
        .engine
        .add_member(CH, &d.engine.generate_key_package().unwrap())
        .unwrap();
    assert!(relay.has_path(&add.commit));
    assert_eq!(relay.accept(&add.commit), Ok(Accepted::Commit));
    for x in [&a, &c] {
        x.engine.process_incoming(CH, &add.commit).unwrap();
    }
    assert!(matches!(
        b.engine.process_incoming(CH, &add.commit).unwrap(),
        Incoming::Removed { .. }
    ));
    d.engine.join_group(CH, &add.welcome).unwrap();
    relay.assert_follows(&d);
    assert_eq!(member_names(&d), member_names(&a));
}
