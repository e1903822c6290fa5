//! The bindings: a member's proof, for the relay, that the holder of a leaf's (or a key
//! package's) signature key acts for an account (`proto/relay.proto`, `LeafBinding` and
//! `KeyPackageOffer`; docs/design.md §5.2, §5.5).
//!
//! The proof is RFC 9420 `SignWithLabel` (§5.1.2) by the leaf's signature key, label
//! `"static relay leaf binding"`, over
//!
//! ```text
//! struct {
//!     opaque group_id<V>;        // the channel name's UTF-8 bytes
//!     opaque account<V>;         // the account the caller's token names ("" when anonymous)
//!     opaque encryption_key<V>;  // the leaf's HPKE encryption key, as in the tree
//! } LeafBindingContent;
//! ```
//!
//! Naming the account keeps a proof from being replayed by another account; naming the leaf's
//! encryption key (fresh in every key package and every update) keeps an old proof from binding
//! a later leaf that reuses the same signature key. One encoding, used by the signer (the
//! engine) and the verifier (the relay).

/// The label of the binding's `SignWithLabel` (without RFC 9420's `"MLS 1.0 "` prefix).
pub const LEAF_BINDING_LABEL: &str = "static relay leaf binding";

/// A QUIC-style variable-length length prefix (RFC 9420 §2.1.2), then the bytes.
fn push_vector(out: &mut Vec<u8>, bytes: &[u8]) {
    let n = bytes.len();
    // Lengths here are far below 2^30 (names, account ids and keys).
    if n < 0x40 {
        out.push(n as u8);
    } else if n < 0x4000 {
        out.extend_from_slice(&((n as u16) | 0x4000).to_be_bytes());
    } else {
        out.extend_from_slice(&((n as u32 & 0x3fff_ffff) | 0x8000_0000).to_be_bytes());
    }
    out.extend_from_slice(bytes);
}

/// The label of a key package's binding (`KeyPackageBindingContent`: the address's identity,
/// the account, the package's leaf encryption key).
pub const KEY_PACKAGE_BINDING_LABEL: &str = "static relay key package binding";

/// The bytes a leaf binding signs: `SignContent { label, content }` of RFC 9420 §5.1.2.
pub fn leaf_binding_tbs(group_id: &[u8], account: &str, encryption_key: &[u8]) -> Vec<u8> {
    binding_tbs(LEAF_BINDING_LABEL, group_id, account, encryption_key)
}

/// The bytes a key package's binding signs: as [`leaf_binding_tbs`], with the address's
/// identity in the group id's place and its own label.
pub fn key_package_binding_tbs(identity: &[u8], account: &str, encryption_key: &[u8]) -> Vec<u8> {
    binding_tbs(KEY_PACKAGE_BINDING_LABEL, identity, account, encryption_key)
}

/// Whether `signature` is a valid binding of a key package (whose leaf has these keys) to
/// `account` under the address's `identity`.
pub fn verify_key_package_binding(
    signature_key: &[u8],
    identity: &[u8],
    account: &str,
    encryption_key: &[u8],
    signature: &[u8],
) -> bool {
    verify(
        signature_key,
        &key_package_binding_tbs(identity, account, encryption_key),
        signature,
    )
}

fn binding_tbs(label: &str, subject: &[u8], account: &str, encryption_key: &[u8]) -> Vec<u8> {
    let mut content = Vec::with_capacity(subject.len() + account.len() + encryption_key.len() + 8);
    push_vector(&mut content, subject);
    push_vector(&mut content, account.as_bytes());
    push_vector(&mut content, encryption_key);
    let label = format!("MLS 1.0 {label}");
    let mut tbs = Vec::with_capacity(label.len() + content.len() + 8);
    push_vector(&mut tbs, label.as_bytes());
    push_vector(&mut tbs, &content);
    tbs
}

/// Whether `signature` is a valid binding of the leaf whose keys are given to `account` in
/// group `group_id` (Ed25519, strict verification as OpenMLS does).
pub fn verify_leaf_binding(
    signature_key: &[u8],
    group_id: &[u8],
    account: &str,
    encryption_key: &[u8],
    signature: &[u8],
) -> bool {
    verify(
        signature_key,
        &leaf_binding_tbs(group_id, account, encryption_key),
        signature,
    )
}

/// Ed25519, strict verification as OpenMLS does.
fn verify(signature_key: &[u8], tbs: &[u8], signature: &[u8]) -> bool {
    let Ok(key) = <[u8; 32]>::try_from(signature_key) else {
        return false;
    };
    let Ok(key) = ed25519_dalek::VerifyingKey::from_bytes(&key) else {
        return false;
    };
    let Ok(signature) = ed25519_dalek::Signature::from_slice(signature) else {
        return false;
    };
    key.verify_strict(tbs, &signature).is_ok()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use ed25519_dalek::Signer as _;

    #[test]
    fn a_binding_verifies_only_for_its_account_group_and_key() {
        let key = ed25519_dalek::SigningKey::from_bytes(&[7u8; 32]);
        let public = key.verifying_key().to_bytes();
        let tbs = leaf_binding_tbs(b"acme/a/b", "account-1", b"hpke-key");
        let signature = key.sign(&tbs).to_bytes();
        let ok = |g: &[u8], a: &str, e: &[u8], s: &[u8]| verify_leaf_binding(&public, g, a, e, s);
        assert!(ok(b"acme/a/b", "account-1", b"hpke-key", &signature));
        assert!(!ok(b"acme/a/b", "account-2", b"hpke-key", &signature));
        assert!(!ok(b"acme/a/c", "account-1", b"hpke-key", &signature));
        assert!(!ok(b"acme/a/b", "account-1", b"other-key", &signature));
        assert!(!ok(b"acme/a/b", "account-1", b"hpke-key", &signature[..63]));
        assert!(!verify_leaf_binding(
            &public[..31],
            b"acme/a/b",
            "account-1",
            b"hpke-key",
            &signature
        ));
        let mut flipped = signature;
        flipped[0] ^= 1;
        assert!(!ok(b"acme/a/b", "account-1", b"hpke-key", &flipped));
    }

    #[test]
    fn the_encoding_is_sign_with_label() {
        let tbs = leaf_binding_tbs(b"g", "", &[1; 70]);
        let label = b"MLS 1.0 static relay leaf binding";
        assert_eq!(usize::from(tbs[0]), label.len());
        assert_eq!(&tbs[1..=label.len()], label);
        // content<V>: 2 + 1 + 72 bytes, so a two-byte length prefix.
        let rest = &tbs[1 + label.len()..];
        assert_eq!(&rest[..2], &[0x40, 75]);
        assert_eq!(&rest[2..5], &[1, b'g', 0]);
        assert_eq!(&rest[5..7], &[0x40, 70]);
        assert_eq!(rest.len(), 2 + 75);
    }

    #[test]
    fn a_key_package_binding_is_not_a_leaf_binding() {
        let key = ed25519_dalek::SigningKey::from_bytes(&[9u8; 32]);
        let public = key.verifying_key().to_bytes();
        let signature = key
            .sign(&key_package_binding_tbs(b"agent", "acct", b"hpke"))
            .to_bytes();
        assert!(verify_key_package_binding(
            &public, b"agent", "acct", b"hpke", &signature
        ));
        assert!(!verify_key_package_binding(
            &public, b"agent", "other", b"hpke", &signature
        ));
        assert!(!verify_leaf_binding(
            &public, b"agent", "acct", b"hpke", &signature
        ));
    }
}
