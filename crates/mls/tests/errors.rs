//! The typed errors: each refusal comes as its operation's variant (what callers match) and
//! reads, after the spec prefix, as a sentence (what Python users see).
#![allow(clippy::unwrap_used)]

mod common;

use common::{agent, group_of, CH};
use static_mls::error::{
    AddMemberError, CommitError, EncryptError, GroupLookupError, JoinError, RemoveMemberError,
};
use static_mls::{Error, ErrorKind, Incoming};

const OTHER: &str = "acme/agents/other";

/// `err`'s message: the MLS prefix, then `words` somewhere.
fn assert_mls_words(err: &Error, words: &str) {
    assert_eq!(err.kind(), ErrorKind::Mls, "{err}");
    let text = err.to_string();
    assert!(text.starts_with("MLS engine error: "), "{text}");
    assert!(text.contains(words), "{text:?} does not say {words:?}");
}

#[test]
fn adding_a_member_already_in_the_group_is_refused_in_words() {
    let (a, b) = (agent("alice"), agent("bob"));
    group_of(&a, &[&b]);
    // A fresh key package of bob's: same signature key as his leaf.
    let again = b.engine.generate_key_package().unwrap();
    let err = a.engine.add_member(CH, &again).unwrap_err();
    match &err {
        Error::AddMember(AddMemberError::AlreadyInGroup { identity, channel }) => {
            assert_eq!(identity, b"bob");
            assert_eq!(channel, CH);
        }
        other => panic!("not AlreadyInGroup: {other:?}"),
    }
    assert_eq!(
        err.to_string(),
        format!(
            "MLS engine error: cannot add b'bob': a member with this signature key is already \
             in channel \"{CH}\""
        )
    );
    // Ourselves too; and nothing was left pending.
    let own = a.engine.generate_key_package().unwrap();
    assert!(matches!(
        a.engine.add_member(CH, &own).unwrap_err(),
        Error::AddMember(AddMemberError::AlreadyInGroup { identity, .. }) if identity == b"alice"
    ));
    assert!(!a.engine.has_pending_commit(CH).unwrap());

    // Twice in one call.
    let c = agent("carol");
    let (one, two) = (
        c.engine.generate_key_package().unwrap(),
        c.engine.generate_key_package().unwrap(),
    );
    let err = a.engine.add_members(CH, &[&one, &two]).unwrap_err();
    assert!(
        matches!(&err, Error::AddMember(AddMemberError::DuplicateKeyPackage { identity }) if identity == b"carol"),
        "{err:?}"
    );
    assert_mls_words(&err, "cannot add b'carol' twice in one commit");
    // The group still takes carol once.
    a.engine.add_member(CH, &one).unwrap();
}

#[test]
fn adding_an_identity_already_in_the_group_is_refused_in_words() {
    let (a, b) = (agent("alice"), agent("bob"));
    group_of(&a, &[&b]);
    // Another client (another signature key) with bob's identity.
    let other_bob = agent("bob");
    let kp = other_bob.engine.generate_key_package().unwrap();
    let err = a.engine.add_member(CH, &kp).unwrap_err();
    match &err {
        Error::AddMember(AddMemberError::IdentityTaken { identity, channel }) => {
            assert_eq!(identity, b"bob");
            assert_eq!(channel, CH);
        }
        other => panic!("not IdentityTaken: {other:?}"),
    }
    assert_eq!(
        err.to_string(),
        format!(
            "MLS engine error: cannot add b'bob': a member with this identity is already in \
             channel \"{CH}\" (remove it first to add this key package in its place)"
        )
    );
    // Our own identity too, and among others in one call: nothing is left pending.
    let (c, other_alice) = (agent("carol"), agent("alice"));
    let err = a
        .engine
        .add_members(
            CH,
            &[
                &c.engine.generate_key_package().unwrap(),
                &other_alice.engine.generate_key_package().unwrap(),
            ],
        )
        .unwrap_err();
    assert!(
        matches!(&err, Error::AddMember(AddMemberError::IdentityTaken { identity, .. }) if identity == b"alice"),
        "{err:?}"
    );
    assert!(!a.engine.has_pending_commit(CH).unwrap());
    assert_eq!(a.engine.epoch(CH).unwrap(), 1);

    // One identity twice in one call, under two signature keys.
    let (d1, d2) = (agent("dave"), agent("dave"));
    let err = a
        .engine
        .add_members(
            CH,
            &[
                &d1.engine.generate_key_package().unwrap(),
                &d2.engine.generate_key_package().unwrap(),
            ],
        )
        .unwrap_err();
    assert!(
        matches!(&err, Error::AddMember(AddMemberError::DuplicateIdentity { identity }) if identity == b"dave"),
        "{err:?}"
    );
    assert_mls_words(
        &err,
        "cannot add b'dave' twice in one commit (two key packages with one identity)",
    );
    assert!(!a.engine.has_pending_commit(CH).unwrap());

    // The group is still usable: once bob is removed, his other client takes his place.
    let removal = a.engine.remove_member(CH, b"bob").unwrap();
    a.engine.process_incoming(CH, &removal).unwrap();
    let add = a.engine.add_member(CH, &kp).unwrap();
    a.engine.process_incoming(CH, &add.commit).unwrap();
    other_bob.engine.join_group(CH, &add.welcome).unwrap();
    let m = other_bob.engine.encrypt(CH, b"back").unwrap();
    assert!(matches!(
        a.engine.process_incoming(CH, &m).unwrap(),
        Incoming::Application { .. }
    ));
}

#[test]
fn someone_elses_welcome_is_refused_in_words() {
    let (a, b, c) = (agent("alice"), agent("bob"), agent("carol"));
    a.engine.create_group(CH).unwrap();
    let out = a
        .engine
        .add_member(CH, &b.engine.generate_key_package().unwrap())
        .unwrap();
    a.engine.merge_pending_commit(CH).unwrap();
    let words = "this Welcome is not addressed to this client: none of its key packages are ours \
                 (it was made for another agent's key package, or ours was already used)";

    let err = c.engine.join_group(CH, &out.welcome).unwrap_err();
    assert!(matches!(err, Error::Join(JoinError::NotForUs)), "{err:?}");
    assert_eq!(err.to_string(), format!("MLS engine error: {words}"));
    assert!(!c.engine.has_group(CH));

    // Bob's own Welcome under another channel's name.
    let err = b.engine.join_group(OTHER, &out.welcome).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("MLS engine error: the Welcome is for group \"{CH}\", not channel \"{OTHER}\"")
    );
    assert!(matches!(err, Error::Join(JoinError::WrongChannel { .. })));

    // Bob joins; used once, his key package cannot open the same Welcome again.
    b.engine.join_group(CH, &out.welcome).unwrap();
    assert!(matches!(
        b.engine.join_group(CH, &out.welcome).unwrap_err(),
        Error::Lookup(GroupLookupError::AlreadyMember { .. })
    ));
    b.engine.forget_group(CH).unwrap();
    let err = b.engine.join_group(CH, &out.welcome).unwrap_err();
    assert!(matches!(err, Error::Join(JoinError::NotForUs)), "{err:?}");
}

#[test]
fn encrypting_with_proposals_pending_is_a_typed_refusal() {
    let (a, b) = (agent("alice"), agent("bob"));
    group_of(&a, &[&b]);
    let leave = b.engine.leave(CH).unwrap();
    assert!(matches!(
        a.engine.process_incoming(CH, &leave).unwrap(),
        Incoming::Proposal { .. }
    ));
    for err in [
        a.engine.encrypt(CH, b"x").unwrap_err(),
        a.engine.encrypt_many(CH, &[b"x", b"y"]).unwrap_err(),
    ] {
        assert!(err.is_pending_proposals(), "{err:?}");
        assert!(matches!(
            &err,
            Error::Encrypt(EncryptError::PendingProposals { channel }) if channel == CH
        ));
        assert_mls_words(&err, "while proposals are pending");
    }
    // Once a commit covers them, encryption works again.
    a.engine.commit_pending_proposals(CH).unwrap().unwrap();
    a.engine.merge_pending_commit(CH).unwrap();
    a.engine.encrypt(CH, b"x").unwrap();
}

#[test]
fn unknown_groups_and_state_refusals_are_typed() {
    let (a, b) = (agent("alice"), agent("bob"));
    for err in [
        a.engine.encrypt(CH, b"x").unwrap_err(),
        a.engine.epoch(CH).unwrap_err(),
        a.engine.self_update(CH).unwrap_err(),
    ] {
        assert!(err.is_unknown_group(), "{err:?}");
        assert_eq!(
            err.to_string(),
            format!("MLS engine error: not a member of channel \"{CH}\"")
        );
    }
    group_of(&a, &[&b]);
    assert!(matches!(
        a.engine.create_group(CH).unwrap_err(),
        Error::Lookup(GroupLookupError::AlreadyMember { .. })
    ));

    let err = a.engine.remove_member(CH, b"carol").unwrap_err();
    assert!(matches!(
        err,
        Error::RemoveMember(RemoveMemberError::NotAMember { .. })
    ));
    assert_mls_words(&err, "b'carol' is not a member of channel");
    assert!(matches!(
        a.engine.remove_member(CH, b"alice").unwrap_err(),
        Error::RemoveMember(RemoveMemberError::RemoveSelf { .. })
    ));

    let err = a.engine.merge_pending_commit(CH).unwrap_err();
    assert!(matches!(
        err,
        Error::Commit(CommitError::NoPendingCommit { .. })
    ));
    assert_mls_words(&err, "there is no pending commit to merge");
    a.engine.self_update(CH).unwrap();
    let err = a.engine.self_update(CH).unwrap_err();
    assert!(
        matches!(err, Error::Commit(CommitError::PendingCommit { .. })),
        "{err:?}"
    );
    assert_mls_words(&err, "a commit of ours is already pending");
}

#[test]
fn store_failures_are_runtime_errors() {
    let a = agent("alice");
    let err = static_mls::Engine::open(a.dir.path(), b"alice")
        .err()
        .unwrap();
    assert!(matches!(err, Error::Store(_)), "{err:?}");
    assert_eq!(err.kind(), ErrorKind::Internal);
    assert!(err.to_string().starts_with("runtime error: "), "{err}");
    assert_eq!(
        err.to_string(),
        format!("{}{}", err.kind().prefix(), err.detail())
    );
}
