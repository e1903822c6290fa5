//! The relay's contract: handshakes travel as PublicMessages (application messages as
//! PrivateMessages).
#![allow(clippy::unwrap_used)]

mod common;

use common::{agent, app, group_of, member_names, Agent, CH};
use openmls::prelude::tls_codec::{Deserialize as _, Serialize as _};
use openmls::prelude::*;
use static_mls::store::DB_FILE;
use static_mls::{Engine, Incoming};

/// The first four bytes of an `MLSMessage`: version mls10, then the wire format.
const PUBLIC: [u8; 4] = [0, 1, 0, 1];
const PRIVATE: [u8; 4] = [0, 1, 0, 2];

fn head(message: &[u8]) -> [u8; 4] {
    message[..4].try_into().unwrap()
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
        Incoming::Removed { epoch: 4 }
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
        Incoming::Removed { epoch: 6 }
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
