//! The relay as an external sender (docs/design.md §5.2, "Removal on revocation"): a group made
//! with `create_group_with_relay` names it; a member keeps the relay's Remove proposals (and
//! commits them) but drops an Add or a context change from it, so the relay cannot add anyone.
#![allow(clippy::unwrap_used)]

mod common;

use common::{agent, CH};
use openmls::prelude::tls_codec::{Deserialize as _, Serialize as _};
use openmls::prelude::*;
use openmls_basic_credential::SignatureKeyPair;
use openmls_rust_crypto::OpenMlsRustCrypto;
use static_mls::Incoming;

#[test]
fn a_member_commits_the_relays_removes_and_drops_its_adds() {
    let relay = SignatureKeyPair::new(SignatureScheme::ED25519).unwrap();
    let alice = agent("alice");
    let bob = agent("bob");
    alice
        .engine
        .create_group_with_relay(CH, Some(relay.public()))
        .unwrap();
    assert!(alice.engine.names_relay(CH, relay.public()).unwrap());
    assert!(!alice.engine.names_relay(CH, &[7; 32]).unwrap());
    let added = alice
        .engine
        .add_member(CH, &bob.engine.generate_key_package().unwrap())
        .unwrap();
    alice.engine.process_incoming(CH, &added.commit).unwrap();
    bob.engine.join_group(CH, &added.welcome).unwrap();
    assert!(bob.engine.names_relay(CH, relay.public()).unwrap());
    let epoch = GroupEpoch::from(alice.engine.epoch(CH).unwrap());
    let group = GroupId::from_slice(CH.as_bytes());

    // An Add from the relay: refused, not kept.
    let carol = agent("carol");
    let package = carol.engine.generate_key_package().unwrap();
    let package = match MlsMessageIn::tls_deserialize_exact(&package)
        .unwrap()
        .extract()
    {
        MlsMessageBodyIn::KeyPackage(package) => package,
        _ => panic!("not a key package"),
    };
    let package = package
        .validate(
            &openmls_rust_crypto::RustCrypto::default(),
            ProtocolVersion::Mls10,
        )
        .unwrap();
    let add = ExternalProposal::new_add::<OpenMlsRustCrypto>(
        package,
        group.clone(),
        epoch,
        &relay,
        SenderExtensionIndex::new(0),
    )
    .unwrap()
    .tls_serialize_detached()
    .unwrap();
    assert!(alice.engine.process_incoming(CH, &add).is_err());
    assert!(!alice.engine.has_pending_proposals(CH).unwrap());

    // A Remove of bob from the relay: kept, and committed.
    let remove = ExternalProposal::new_remove::<OpenMlsRustCrypto>(
        LeafNodeIndex::new(1),
        group,
        epoch,
        &relay,
        SenderExtensionIndex::new(0),
    )
    .unwrap()
    .tls_serialize_detached()
    .unwrap();
    match alice.engine.process_incoming(CH, &remove).unwrap() {
        Incoming::Proposal { sender } => assert_eq!(sender.as_deref(), Some(&b"static relay"[..])),
        other => panic!("not a proposal: {other:?}"),
    }
    let commit = alice.engine.commit_pending_proposals(CH).unwrap().unwrap();
    alice.engine.process_incoming(CH, &commit).unwrap();
    assert_eq!(alice.engine.members(CH).unwrap().len(), 1);
}
