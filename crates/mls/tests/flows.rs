//! Multi-member flows over the public `Engine` API.
#![allow(clippy::unwrap_used)]

mod common;

use common::{agent, app, group_of, member_names, CH};
use static_mls::{Engine, ErrorKind, Incoming, StoredCommit};

#[test]
fn two_members_exchange_messages_and_skip_own_echo() {
    let (a, b) = (agent("alice"), agent("bob"));
    group_of(&a, &[&b]);
    assert_eq!(a.engine.epoch(CH).unwrap(), 1);
    assert_eq!(b.engine.epoch(CH).unwrap(), 1);
    assert_eq!(
        a.engine.epoch_authenticator(CH).unwrap(),
        b.engine.epoch_authenticator(CH).unwrap()
    );

    let m = a.engine.encrypt(CH, b"hello bob").unwrap();
    assert_eq!(
        b.engine.process_incoming(CH, &m).unwrap(),
        app(b"alice", b"hello bob", 1)
    );
    // The relay echoes alice's own message back to her: recognised and skipped.
    assert_eq!(a.engine.process_incoming(CH, &m).unwrap(), Incoming::Own);

    let r = b.engine.encrypt(CH, b"hi alice").unwrap();
    assert_eq!(
        a.engine.process_incoming(CH, &r).unwrap(),
        app(b"bob", b"hi alice", 1)
    );

    assert_eq!(member_names(&a), vec![b"alice".to_vec(), b"bob".to_vec()]);
    assert_eq!(a.engine.group_names(), vec![CH.to_string()]);
}

#[test]
fn third_member_self_update_remove_and_messages_across_epochs() {
    let (a, b, c) = (agent("alice"), agent("bob"), agent("carol"));
    group_of(&a, &[&b, &c]);
    assert_eq!(c.engine.epoch(CH).unwrap(), 2);
    assert_eq!(a.engine.members(CH).unwrap().len(), 3);

    // Carol sends at epoch 2; before anyone reads it, bob's key rotation wins epoch 2.
    let early = c.engine.encrypt(CH, b"sent before the commit").unwrap();
    let update = b.engine.self_update(CH).unwrap();
    assert!(b.engine.has_pending_commit(CH).unwrap());
    assert_eq!(b.engine.merge_pending_commit(CH).unwrap(), 3);
    for x in [&a, &c] {
        assert!(matches!(
            x.engine.process_incoming(CH, &update).unwrap(),
            Incoming::Commit { epoch: 3, .. }
        ));
    }
    // The message of the previous epoch still decrypts (past epoch secrets are kept).
    assert_eq!(
        a.engine.process_incoming(CH, &early).unwrap(),
        app(b"carol", b"sent before the commit", 2)
    );
    assert_eq!(
        b.engine.process_incoming(CH, &early).unwrap(),
        app(b"carol", b"sent before the commit", 2)
    );
    let auth = a.engine.epoch_authenticator(CH).unwrap();
    assert_eq!(auth, b.engine.epoch_authenticator(CH).unwrap());
    assert_eq!(auth, c.engine.epoch_authenticator(CH).unwrap());

    // Alice removes carol.
    let removal = a.engine.remove_member(CH, b"carol").unwrap();
    assert!(matches!(
        a.engine.process_incoming(CH, &removal).unwrap(),
        Incoming::OwnCommit { epoch: 4 }
    ));
    assert!(matches!(
        b.engine.process_incoming(CH, &removal).unwrap(),
        Incoming::Commit { epoch: 4, .. }
    ));
    assert_eq!(
        c.engine.process_incoming(CH, &removal).unwrap(),
        Incoming::Removed {
            epoch: 4,
            members: a.engine.members(CH).unwrap(),
            by_relay: false,
        }
    );
    assert!(!c.engine.has_group(CH));
    let err = c.engine.encrypt(CH, b"x").unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Mls);
    assert_eq!(member_names(&b), vec![b"alice".to_vec(), b"bob".to_vec()]);

    // Carol can no longer read the channel.
    let secret = a.engine.encrypt(CH, b"carol must not read this").unwrap();
    assert_eq!(
        b.engine.process_incoming(CH, &secret).unwrap(),
        app(b"alice", b"carol must not read this", 4)
    );
    assert!(c.engine.process_incoming(CH, &secret).is_err());
    // Removing someone who is not a member, or ourselves, is refused.
    assert_eq!(
        a.engine.remove_member(CH, b"carol").unwrap_err().kind(),
        ErrorKind::Mls
    );
    assert_eq!(
        a.engine.remove_member(CH, b"alice").unwrap_err().kind(),
        ErrorKind::Mls
    );
}

#[test]
fn conflicting_commits_loser_clears_applies_winner_and_retries() {
    let (a, b, c) = (agent("alice"), agent("bob"), agent("carol"));
    group_of(&a, &[&b]);
    // Both try to commit at epoch 1; the relay takes bob's.
    let kp = c.engine.generate_key_package().unwrap();
    let lost = a.engine.add_member(CH, &kp).unwrap();
    let won = b.engine.self_update(CH).unwrap();
    assert!(matches!(
        b.engine.process_incoming(CH, &won).unwrap(),
        Incoming::OwnCommit { epoch: 2 }
    ));
    // Alice processes the winner without clearing first: her pending commit is void.
    assert!(matches!(
        a.engine.process_incoming(CH, &won).unwrap(),
        Incoming::Commit { epoch: 2, .. }
    ));
    assert!(!a.engine.has_pending_commit(CH).unwrap());
    // The Welcome of the lost commit is self-consistent (the relay must never deliver it), but
    // a member who joins from it is on a fork, which the epoch authenticator reveals.
    c.engine.join_group(CH, &lost.welcome).unwrap();
    assert_eq!(c.engine.epoch(CH).unwrap(), 2);
    assert_ne!(
        c.engine.epoch_authenticator(CH).unwrap(),
        a.engine.epoch_authenticator(CH).unwrap()
    );
    assert_eq!(
        b.engine.epoch_authenticator(CH).unwrap(),
        a.engine.epoch_authenticator(CH).unwrap()
    );
    // Retry with a fresh key package (of a fresh agent: carol is stuck on her fork).
    let c = agent("carol2");
    let kp = c.engine.generate_key_package().unwrap();
    let retry = a.engine.add_member(CH, &kp).unwrap();
    a.engine.merge_pending_commit(CH).unwrap();
    b.engine.process_incoming(CH, &retry.commit).unwrap();
    c.engine.join_group(CH, &retry.welcome).unwrap();
    assert_eq!(c.engine.epoch(CH).unwrap(), 3);
    let m = c.engine.encrypt(CH, b"in").unwrap();
    assert_eq!(
        a.engine.process_incoming(CH, &m).unwrap(),
        app(b"carol2", b"in", 3)
    );

    // Explicit clear: the relay refused alice's commit.
    let refused = a.engine.self_update(CH).unwrap();
    a.engine.clear_pending_commit(CH).unwrap();
    assert!(!a.engine.has_pending_commit(CH).unwrap());
    assert_eq!(a.engine.epoch(CH).unwrap(), 3);
    assert!(a.engine.merge_pending_commit(CH).is_err());
    // An own commit that was cleared and later shows up is not silently ignored.
    assert!(a.engine.process_incoming(CH, &refused).is_err());
    assert_eq!(a.engine.epoch(CH).unwrap(), 3);
}

#[test]
fn leave_is_committed_by_another_member() {
    let (a, b, c) = (agent("alice"), agent("bob"), agent("carol"));
    group_of(&a, &[&b, &c]);
    let proposal = b.engine.leave(CH).unwrap();
    assert_eq!(
        b.engine.process_incoming(CH, &proposal).unwrap(),
        Incoming::Own
    );
    assert_eq!(
        a.engine.process_incoming(CH, &proposal).unwrap(),
        Incoming::Proposal {
            sender: Some(b"bob".to_vec())
        }
    );
    assert!(matches!(
        c.engine.process_incoming(CH, &proposal).unwrap(),
        Incoming::Proposal { .. }
    ));
    let commit = a.engine.commit_pending_proposals(CH).unwrap().unwrap();
    assert!(matches!(
        a.engine.process_incoming(CH, &commit).unwrap(),
        Incoming::OwnCommit { .. }
    ));
    assert!(matches!(
        c.engine.process_incoming(CH, &commit).unwrap(),
        Incoming::Commit { .. }
    ));
    assert!(matches!(
        b.engine.process_incoming(CH, &commit).unwrap(),
        Incoming::Removed { .. }
    ));
    assert!(!b.engine.has_group(CH));
    assert_eq!(a.engine.members(CH).unwrap().len(), 2);
    assert_eq!(a.engine.commit_pending_proposals(CH).unwrap(), None);
}

#[test]
fn welcome_checks() {
    let (a, b, c) = (agent("alice"), agent("bob"), agent("carol"));
    a.engine.create_group(CH).unwrap();
    let kp = b.engine.generate_key_package().unwrap();
    let out = a.engine.add_member(CH, &kp).unwrap();
    a.engine.merge_pending_commit(CH).unwrap();
    // Wrong channel name.
    let err = b
        .engine
        .join_group("acme/agents/other", &out.welcome)
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Mls);
    assert!(err.to_string().starts_with("MLS engine error:"), "{err}");
    // Someone else's Welcome.
    assert_eq!(
        c.engine.join_group(CH, &out.welcome).unwrap_err().kind(),
        ErrorKind::Mls
    );
    // A rejected Welcome did not consume bob's key package: the right join still works.
    b.engine.join_group(CH, &out.welcome).unwrap();
    // Joining twice is refused.
    assert_eq!(
        b.engine.join_group(CH, &out.welcome).unwrap_err().kind(),
        ErrorKind::Mls
    );
    // Invalid names.
    let err = b.engine.join_group("bad name", &out.welcome).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidChannelName);
    assert!(err.to_string().contains("org/namespace/service"));
    assert_eq!(
        a.engine.create_group("a/b").unwrap_err().kind(),
        ErrorKind::InvalidChannelName
    );
    assert_eq!(
        a.engine.create_group(CH).unwrap_err().kind(),
        ErrorKind::Mls
    );
}

#[test]
fn replayed_and_foreign_messages_are_refused() {
    let (a, b) = (agent("alice"), agent("bob"));
    let commits = group_of(&a, &[&b]);
    let m = a.engine.encrypt(CH, b"once").unwrap();
    assert!(b.engine.process_incoming(CH, &m).is_ok());
    assert_eq!(
        b.engine.process_incoming(CH, &m).unwrap_err().kind(),
        ErrorKind::Mls
    );
    // A replayed commit of a past epoch.
    assert_eq!(
        b.engine
            .process_incoming(CH, &commits[0])
            .unwrap_err()
            .kind(),
        ErrorKind::Mls
    );
    // A message of another group handed to this channel.
    let other = "acme/agents/other";
    a.engine.create_group(other).unwrap();
    let foreign = a.engine.encrypt(other, b"elsewhere").unwrap();
    let err = b.engine.process_incoming(CH, &foreign).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Mls);
    // A key package or Welcome is not a protocol message.
    let kp = b.engine.generate_key_package().unwrap();
    assert_eq!(
        a.engine.process_incoming(CH, &kp).unwrap_err().kind(),
        ErrorKind::Mls
    );
    // The group still works.
    let m = a.engine.encrypt(CH, b"still fine").unwrap();
    assert_eq!(
        b.engine.process_incoming(CH, &m).unwrap(),
        app(b"alice", b"still fine", 1)
    );
}

#[test]
fn bare_key_package_is_accepted() {
    use openmls::prelude::tls_codec::{Deserialize, Serialize};
    use openmls::prelude::*;
    let (a, b) = (agent("alice"), agent("bob"));
    a.engine.create_group(CH).unwrap();
    let kp = b.engine.generate_key_package().unwrap();
    let bare = match MlsMessageIn::tls_deserialize_exact(&kp).unwrap().extract() {
        MlsMessageBodyIn::KeyPackage(kp) => kp.tls_serialize_detached().unwrap(),
        _ => panic!("not a key package"),
    };
    let out = a.engine.add_member(CH, &bare).unwrap();
    a.engine.merge_pending_commit(CH).unwrap();
    b.engine.join_group(CH, &out.welcome).unwrap();
}

#[test]
fn data_dir_is_locked_and_bound_to_identity() {
    let dir = tempfile::tempdir().unwrap();
    let first = Engine::open(dir.path(), b"alice").unwrap();
    let err = Engine::open(dir.path(), b"alice").err().unwrap();
    assert_eq!(err.kind(), ErrorKind::Internal);
    assert!(
        err.to_string().starts_with("runtime error:") && err.to_string().contains("in use"),
        "{err}"
    );
    drop(first);
    let err = Engine::open(dir.path(), b"mallory").err().unwrap();
    assert_eq!(err.kind(), ErrorKind::Internal);
    assert!(err.to_string().contains("belongs to identity"), "{err}");
    assert!(Engine::open(dir.path(), b"alice").is_ok());
}

#[test]
fn reopened_store_gives_back_groups_epochs_and_signature_key() {
    let (a, b) = (agent("alice"), agent("bob"));
    let other = "acme/agents/second";
    group_of(&a, &[&b]);
    a.engine.create_group(other).unwrap();
    let update = a.engine.self_update(CH).unwrap();
    a.engine.merge_pending_commit(CH).unwrap();
    b.engine.process_incoming(CH, &update).unwrap();
    let pending = a.engine.self_update(other).unwrap();
    let key = a.engine.signature_public_key().to_vec();
    let auth = a.engine.epoch_authenticator(CH).unwrap();

    let Agent2 { dir, .. } = Agent2::from(a);
    let a = Engine::open(dir.path(), b"alice").unwrap();
    assert_eq!(a.group_names(), vec![CH.to_string(), other.to_string()]);
    assert_eq!(a.epoch(CH).unwrap(), 2);
    assert_eq!(a.epoch(other).unwrap(), 0);
    assert_eq!(a.signature_public_key(), key.as_slice());
    assert_eq!(a.epoch_authenticator(CH).unwrap(), auth);
    // The pending commit survived too and is recognised when echoed.
    assert!(a.has_pending_commit(other).unwrap());
    assert_eq!(a.pending_commit(other).unwrap(), Some(pending.clone()));
    assert_eq!(
        a.process_incoming(other, &pending).unwrap(),
        Incoming::OwnCommit { epoch: 1 }
    );
    // Messaging continues in both directions.
    let m = a.encrypt(CH, b"after restart").unwrap();
    assert_eq!(
        b.engine.process_incoming(CH, &m).unwrap(),
        app(b"alice", b"after restart", 2)
    );
    let r = b.engine.encrypt(CH, b"welcome back").unwrap();
    assert_eq!(
        a.process_incoming(CH, &r).unwrap(),
        app(b"bob", b"welcome back", 2)
    );
}

/// Drops the engine, keeps the directory.
struct Agent2 {
    dir: tempfile::TempDir,
}
impl From<common::Agent> for Agent2 {
    fn from(a: common::Agent) -> Self {
        drop(a.engine);
        Agent2 { dir: a.dir }
    }
}

#[test]
fn key_package_not_before_now_is_tolerated() {
    // Regression (docs/design.md §7): OpenMLS wants not_before strictly in the past; key packages from
    // implementations that set it to "now" (or a second ahead) must still be accepted.
    use openmls::prelude::*;
    use openmls_basic_credential::SignatureKeyPair;
    use openmls_rust_crypto::RustCrypto;
    use static_mls::store::{Db, Provider};
    use std::time::{SystemTime, UNIX_EPOCH};

    let a = agent("alice");
    a.engine.create_group(CH).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(dir.path()).unwrap();
    let crypto = RustCrypto::default();
    let provider = Provider::new(&crypto, &db.conn);
    let signer = SignatureKeyPair::new(SignatureScheme::ED25519).unwrap();
    let cred = CredentialWithKey {
        credential: BasicCredential::new(b"other-impl".to_vec()).into(),
        signature_key: signer.public().into(),
    };
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let make = |not_before: u64| {
        let bundle = KeyPackage::builder()
            .key_package_lifetime(Lifetime::init(not_before, not_before + 3600))
            .build(static_mls::CIPHERSUITE, &provider, &signer, cred.clone())
            .unwrap();
        use openmls::prelude::tls_codec::Serialize;
        MlsMessageOut::from(bundle.key_package().clone())
            .tls_serialize_detached()
            .unwrap()
    };
    a.engine.add_member(CH, &make(now + 1)).unwrap();
    a.engine.clear_pending_commit(CH).unwrap();
    a.engine.add_member(CH, &make(now)).unwrap();
    a.engine.clear_pending_commit(CH).unwrap();
    // Far in the future: refused, quickly.
    let t = std::time::Instant::now();
    assert_eq!(
        a.engine
            .add_member(CH, &make(now + 3600))
            .unwrap_err()
            .kind(),
        ErrorKind::Mls
    );
    assert!(t.elapsed() < std::time::Duration::from_secs(1));
    // Wrong ciphersuite.
    let p256 = Ciphersuite::MLS_128_DHKEMP256_AES128GCM_SHA256_P256;
    let signer256 = SignatureKeyPair::new(p256.signature_algorithm()).unwrap();
    let cred256 = CredentialWithKey {
        credential: BasicCredential::new(b"p256".to_vec()).into(),
        signature_key: signer256.public().into(),
    };
    let kp = KeyPackage::builder()
        .build(p256, &provider, &signer256, cred256)
        .unwrap();
    use openmls::prelude::tls_codec::Serialize;
    let bytes = MlsMessageOut::from(kp.key_package().clone())
        .tls_serialize_detached()
        .unwrap();
    let err = a.engine.add_member(CH, &bytes).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Mls);
    assert!(err.to_string().contains("ciphersuite"), "{err}");
    assert_eq!(a.engine.epoch(CH).unwrap(), 0);
}

#[test]
fn concurrent_senders_on_one_group_and_across_groups() {
    use std::sync::{Arc, Mutex};
    let (a, b) = (agent("alice"), agent("bob"));
    group_of(&a, &[&b]);
    let other = "acme/agents/second";
    a.engine.create_group(other).unwrap();
    let engine = Arc::new(a.engine);
    let log = Arc::new(Mutex::new(Vec::new()));
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let (engine, log) = (Arc::clone(&engine), Arc::clone(&log));
            std::thread::spawn(move || {
                for i in 0..25 {
                    let payload = format!("{t}-{i}").into_bytes();
                    let m = engine.encrypt(CH, &payload).unwrap();
                    log.lock().unwrap().push((payload, m));
                    engine.encrypt(other, b"noise").unwrap();
                    let _ = engine.members(CH).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let log = log.lock().unwrap();
    assert_eq!(log.len(), 100);
    for (payload, m) in log.iter() {
        assert_eq!(
            b.engine.process_incoming(CH, m).unwrap(),
            app(b"alice", payload, 1)
        );
    }
}

/// A pending add keeps its Welcome in the store, across a reopen (the process that made it may
/// die before the relay answers: the client publishes both again), and the Welcome still
/// admits the new member; a self-update keeps none. A store made before the column existed
/// gains it at opening, its pending commit read without a Welcome.
#[test]
fn a_pending_commit_keeps_its_welcome_across_a_reopen() {
    let (a, b) = (agent("alice"), agent("bob"));
    a.engine.create_group(CH).unwrap();
    let out = a
        .engine
        .add_member(CH, &b.engine.generate_key_package().unwrap())
        .unwrap();
    let dir = a.dir;
    drop(a.engine);
    let a = Engine::open(dir.path(), b"alice").unwrap();
    assert_eq!(
        a.pending_commit_and_welcome(CH).unwrap(),
        Some(StoredCommit {
            commit: out.commit.clone(),
            welcome: Some(out.welcome.clone())
        })
    );
    b.engine.join_group(CH, &out.welcome).unwrap();
    assert_eq!(
        a.process_incoming(CH, &out.commit).unwrap(),
        Incoming::OwnCommit { epoch: 1 }
    );
    assert_eq!(a.pending_commit_and_welcome(CH).unwrap(), None);

    let update = a.self_update(CH).unwrap();
    assert_eq!(
        a.pending_commit_and_welcome(CH).unwrap(),
        Some(StoredCommit {
            commit: update.clone(),
            welcome: None
        })
    );

    // The schema of before: no welcome_bytes column.
    drop(a);
    let db = dir.path().join("mls.sqlite3");
    {
        let conn = rusqlite::Connection::open(&db).unwrap();
        conn.execute_batch(
            "CREATE TABLE old_pending AS SELECT name, commit_bytes FROM static_pending_commits;
             DROP TABLE static_pending_commits;
             CREATE TABLE static_pending_commits (
                 name TEXT PRIMARY KEY REFERENCES static_groups(name) ON DELETE CASCADE,
                 commit_bytes BLOB NOT NULL
             );
             INSERT INTO static_pending_commits SELECT * FROM old_pending;
             DROP TABLE old_pending;",
        )
        .unwrap();
    }
    let a = Engine::open(dir.path(), b"alice").unwrap();
    assert_eq!(
        a.pending_commit_and_welcome(CH).unwrap(),
        Some(StoredCommit {
            commit: update,
            welcome: None
        })
    );
    assert_eq!(a.merge_pending_commit(CH).unwrap(), 2);
}
