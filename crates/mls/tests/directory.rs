//! The key packages an agent lists in the relay's directory: valid as the relay checks them
//! (signatures, lifetime, capabilities), the last one marked last-resort, each bound to the
//! account under the agent's identity, and usable to add the agent.

use openmls::prelude::tls_codec::Deserialize as _;
use openmls::prelude::*;
use openmls_rust_crypto::RustCrypto;
use static_mls::binding::verify_key_package_binding;
use static_mls::engine::key_package_encryption_key;
use static_mls::Engine;

fn key_package(bytes: &[u8]) -> KeyPackage {
    let message = MlsMessageIn::tls_deserialize_exact(bytes).expect("an MLSMessage");
    let MlsMessageBodyIn::KeyPackage(package) = message.extract() else {
        panic!("not a key package");
    };
    package
        .validate(&RustCrypto::default(), ProtocolVersion::Mls10)
        .expect("a key package the relay accepts")
}

#[test]
fn directory_packages_validate_and_bind_to_the_account() {
    let dir = tempfile::tempdir().expect("tempdir");
    let engine = Engine::open(dir.path(), b"agent-b").expect("engine");
    let packages = engine
        .directory_key_packages("acct-1", 3, true)
        .expect("packages");
    assert_eq!(packages.len(), 4);
    for (i, offered) in packages.iter().enumerate() {
        let package = key_package(&offered.key_package);
        assert_eq!(package.last_resort(), i == 3);
        assert_eq!(offered.last_resort, i == 3);
        let leaf = package.leaf_node();
        assert_eq!(leaf.credential().serialized_content(), b"agent-b");
        let key = key_package_encryption_key(&package).expect("key");
        let signature_key = leaf.signature_key().as_slice();
        assert!(verify_key_package_binding(
            signature_key,
            b"agent-b",
            "acct-1",
            &key,
            &offered.binding
        ));
        assert!(!verify_key_package_binding(
            signature_key,
            b"agent-b",
            "acct-2",
            &key,
            &offered.binding
        ));
    }

    // A member adds the agent with the last-resort package, and the agent joins.
    let dir_a = tempfile::tempdir().expect("tempdir");
    let alice = Engine::open(dir_a.path(), b"alice").expect("engine");
    alice.create_group("acme/a/b").expect("group");
    let out = alice
        .add_member("acme/a/b", &packages[3].key_package)
        .expect("add");
    engine.join_group("acme/a/b", &out.welcome).expect("join");
}
